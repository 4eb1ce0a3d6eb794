"""GRPO stage: group-relative policy optimization on the iteration's scored rollouts (rewards.jsonl).

    accelerate launch --config_file configs/accelerate/cpu.yaml grpo_iteration/run_grpo.py \
        --config configs/grpo.yaml policy=default rewards=runs/x/iter_1/rewards.jsonl output_dir=runs/x/iter_1/model

Reads one rewards file (generated records with ``rewards: [K float | null]``, online_rlhf/records.py),
writes one checkpoint directory (save_pretrained of policy + tokenizer, as the DPO stage writes it)
and a stats JSON (``<output_dir>.stats.json``: ``online_rlhf.stats.GRPOStats``).

The objective (TRL 1.9's names; ``online_rlhf.stage_configs.GRPOStageConfig`` documents each key):

- GRPO (Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300): each prompt's K responses form a
  group; a response's advantage is its reward minus the group mean, divided by the group's std
  (``scale_rewards=group``); the policy maximizes the clipped surrogate
  ``min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)`` per completion token, with
  ``rho = pi(token) / pi_old(token)``, minus ``beta`` times the k3 estimate of KL(pi || pi_ref),
  ``exp(ref - logp) - (ref - logp) - 1``; token losses are averaged per completion, then over
  completions (``loss_type=grpo``).
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
  arXiv 2503.20783): no division by the std (``scale_rewards=none``), and token losses summed and
  divided by a constant, completions x ``max_completion_length`` (``loss_type=dr_grpo``), which
  removes the length and difficulty biases of the per-completion mean.
- DAPO (Yu et al. 2025, arXiv 2503.14476): ``epsilon_high`` (clip-higher), token losses summed over
  the optimizer step and divided by its token count (``loss_type=dapo``, TRL's default),
  ``mask_truncated_completions``. ``bnpo``: the token mean of each micro-batch.

TRL's ``GRPOTrainer`` generates its own completions; here the loop has generated (vLLM) and scored
them already, so the stage computes the loss itself (:func:`grpo_loss`, checked against TRL's
``GRPOTrainer._compute_loss`` in tests/test_grpo.py) in a plain training loop under
``accelerate.Accelerator`` (DDP over gloo on CPU, DeepSpeed on the zero2/zero3 profiles). On a CPU
with native bf16 (AVX512-BF16 or AMX) the steps and the log-prob passes run under bf16 autocast over
fp32 weights, like the DPO stage's; elsewhere in fp32 on CPU (emulated bf16 is ~100x slower).

Order of work (:func:`main` calls one function a step: :func:`construct`, :func:`setup_data` 1-3,
:func:`setup` 4-5, :func:`train` 6, :func:`save` 7, :func:`write_stats`):
  1. read the groups (:func:`load_groups`), subtract ``truncated_penalty`` from truncated responses;
  2. advantages (:func:`group_advantages`); groups whose scored rewards are all equal carry no
     signal and are skipped, as are groups with fewer than 2 scored responses (counted);
  3. tokenize with the policy's chat template (:func:`build_completions`; the same ids as the DPO
     stage, ``online_rlhf.chat_tokens.prompt_response_ids``; a truncated response has no
     end-of-turn token);
  4. load the policy (and the reference when ``beta > 0`` and it differs from the policy);
  5. the "old" log-probs: the policy's, recomputed here before any update
     (:func:`online_rlhf.stages.grpo_objective.old_log_probs`).
     The sampler's own log-probs come from vLLM's numeric path (another kernel, on CPU often
     another dtype), so a ratio against them would not be 1 before the first update; recomputed
     with the training forward, it is (up to float rounding), as in TRL when ``num_iterations > 1``.
     With ``ref_model: previous`` (reference = this policy) they are the reference log-probs too;
  6. ``num_iterations`` passes over the completions, shuffled into optimizer steps of
     ``per_device_train_batch_size x gradient_accumulation_steps x processes`` completions;
  7. save into ``<output_dir>.tmp``, rename to ``output_dir``.

Dry run (``dry_run=true``, :func:`dry_run`): :func:`construct`, then steps 4-6 for one optimizer step
on dummy completions of ``max_length`` tokens; it writes only ``<output_dir>.dry_run.json``.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from online_rlhf.adapters import continued_lora_config, load_with_adapter, save_adapter, split_model
from online_rlhf.checkpoint import finish_checkpoint, folder_mb, publish, restore_input_config, rmtree
from online_rlhf.config import ConfigError, run_main
from online_rlhf.dry_run import dummy_ids, exit_if_out_of_memory, finish, out_of_memory_errors
from online_rlhf.hardware import (check_process_count, compute_dtype, describe, launch_world_size, processes_here,
                                  stage_threads)
from online_rlhf.jsonl import DataError
from online_rlhf.memory import PeakMemory
from online_rlhf.paths import resolve_model, setup_cache_env
from online_rlhf.stage_configs import GRPOStageConfig
from online_rlhf.stages.dpo_trainer import load_causal_lm, prepared_forward, stored_dtype
from online_rlhf.stats import DryRunStats, GRPOStats, stats_path
from online_rlhf.trl_args import check_lora
from online_rlhf.stages.grpo_data import load_groups, group_advantages, build_completions, data_warnings
from online_rlhf.stages.grpo_objective import all_log_probs, collate, completion_log_probs, grpo_loss, pad_rows


# ------------------------------------------------------------------------------ loss
def train(cfg: GRPOStageConfig, accelerator, model, optimizer, completions: list[dict], old: list[list[float]],
          ref: list[list[float]] | None, pad_id: int) -> list[dict]:
    """``num_iterations`` passes over ``completions``; returns one history row per optimizer step:
    ``{step, pass, loss, kl, clip_fraction, ratio_max_dev, completions}`` (means over the step's
    tokens, all ranks).

    Each optimizer step takes ``per_device_train_batch_size x gradient_accumulation_steps x ranks``
    completions of the pass's order; rank r gets every r-th of them, as exactly
    ``gradient_accumulation_steps`` micro-batches (an empty one reuses a completion at weight 0, so
    every rank runs the same forward/backward passes).
    """
    import torch

    world, rank, ga = accelerator.num_processes, accelerator.process_index, cfg.gradient_accumulation_steps
    per, eps_hi = cfg.per_device_train_batch_size, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    step_size = per * ga * world
    history = []
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.num_iterations * -(-len(completions) // step_size), desc="grpo optimizer steps",
               disable=not accelerator.is_main_process)
    for p in range(cfg.num_iterations):
        order = list(range(len(completions)))
        if cfg.shuffle_dataset:
            random.Random(cfg.seed + p).shuffle(order)
        for s in range(0, len(order), step_size):
            chunk = order[s:s + step_size]
            share = chunk[rank::world]
            n_items = sum(len(completions[i]["completion_ids"]) for i in chunk)  # dapo: tokens of the step
            sums = torch.zeros(5, device=accelerator.device)  # loss, kl x tokens, clipped tokens, tokens, micro-batches
            dev = torch.zeros(1, device=accelerator.device)
            for j in range(ga):
                idx = share[j * per:(j + 1) * per]
                weight = 1.0 if idx else 0.0
                idx = idx or [order[0]]
                with accelerator.accumulate(model):
                    batch = collate([completions[i] for i in idx], pad_id, accelerator.device)
                    C = batch["completion_mask"].size(1)
                    logps = completion_log_probs(model, batch, cfg.temperature)  # (b, C)
                    old_lp = pad_rows([old[i] for i in idx], C, accelerator.device)  # (b, C)
                    ref_lp = pad_rows([ref[i] for i in idx], C, accelerator.device) if ref is not None else None
                    loss, m = grpo_loss(logps, old_lp, ref_lp, batch["advantages"], batch["completion_mask"],
                                        beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=eps_hi,
                                        loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                                        num_items_in_batch=n_items, num_processes=world)
                    # accelerator.backward divides by ga (as TRL divides its loss); dapo's divisor
                    # already spans the whole step, so TRL does not divide it: undo that here.
                    scale = weight * (ga if cfg.loss_type == "dapo" else 1.0)
                    accelerator.backward(loss * scale)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                tokens = batch["completion_mask"].sum() * weight
                sums += torch.stack([loss.detach().float() * weight,
                                     (m["kl"].float() if m["kl"] is not None else torch.zeros((), device=tokens.device)) * tokens,
                                     m["clip_fraction"].float() * tokens, tokens, torch.tensor(weight, device=tokens.device)])
                dev = torch.maximum(dev, m["ratio_max_dev"].float().reshape(1) * weight)
            sums = accelerator.reduce(sums, reduction="sum")
            dev = accelerator.gather(dev).max() if world > 1 else dev
            tok = float(sums[3].clamp(min=1.0))
            # dapo's loss is already per token of the step on each rank; others are means per micro-batch
            loss_v = float(sums[0]) / world if cfg.loss_type == "dapo" else float(sums[0] / sums[4].clamp(min=1.0))
            history.append({"step": len(history) + 1, "pass": p + 1, "loss": loss_v,
                            "kl": float(sums[1]) / tok if cfg.beta != 0.0 else None,
                            "clip_fraction": float(sums[2]) / tok, "ratio_max_dev": float(dev), "completions": len(chunk)})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.4f}", clip=f"{history[-1]['clip_fraction']:.3f}")
    bar.close()
    return history


def save(accelerator, model, tmp_dir: Path, out_dir: Path, policy_path: str, orig_config: dict, trust: bool,
         lora: str | None = None) -> None:
    """Step 7: write the policy to ``tmp_dir`` (safetensors, the input's tokenizer, generation_config
    and bos/eos/pad ids), then rename it to ``out_dir`` (rank 0). A failure removes ``tmp_dir``
    (rank 0) and is raised again. ``lora``: ``"adapter"`` saves the LoRA adapter only (naming
    ``policy_path`` as its base), ``"merged"`` merges it into a full checkpoint first (LoRA is
    refused under ZeRO-3, so the model is whole on rank 0)."""
    try:
        state = accelerator.get_state_dict(model) if lora is None else None  # every rank: gathers ZeRO-3 shards
        if accelerator.is_main_process:
            rmtree(tmp_dir)
            unwrapped = accelerator.unwrap_model(model)
            if lora == "adapter":
                save_adapter(unwrapped, tmp_dir, policy_path)
            else:
                if lora == "merged":
                    unwrapped = unwrapped.merge_and_unload()
                restore_input_config(unwrapped, policy_path, orig_config)
                unwrapped.save_pretrained(tmp_dir, state_dict=state, safe_serialization=True)
            finish_checkpoint(tmp_dir, policy_path, trust)
            publish(tmp_dir, out_dir)
        accelerator.wait_for_everyone()
    except BaseException:
        if accelerator.is_main_process:
            rmtree(tmp_dir)
        raise


def _cpu_bf16_autocast(cfg: GRPOStageConfig) -> bool:
    """True on a CPU with native bf16 (:func:`online_rlhf.hardware.compute_dtype`), fp32 weights and
    no DeepSpeed: the steps then run under bf16 autocast over fp32 master weights, as the DPO stage's
    do (about twice the fp32 speed there); elsewhere the launch's mixed precision stands."""
    import torch

    if torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return False
    return cfg.torch_dtype in ("auto", "float32") and compute_dtype("cpu") == "bfloat16"


def _accelerator(cfg: GRPOStageConfig):
    """``accelerate.Accelerator`` as launched (plain, DDP over gloo on CPU, DeepSpeed), with the
    stage's accumulation; under DeepSpeed its batch size, accumulation and clipping set in its config."""
    from accelerate import Accelerator

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        import torch
        from accelerate import PartialState

        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(cfg.gradient_accumulation_steps)
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(cfg.max_grad_norm)
        if not torch.cuda.is_available() and launch_world_size() > 1:
            PartialState(backend="gloo")  # DeepSpeed on CPU: without it every rank sees a world of 1
    kwargs = {}
    if _cpu_bf16_autocast(cfg):
        kwargs["mixed_precision"] = "bf16"
    acc = Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps, **kwargs)
    ds = acc.state.deepspeed_plugin
    if ds is not None:
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.per_device_train_batch_size
        ds.deepspeed_config["train_batch_size"] = (cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                                                   * acc.num_processes)
        ds.deepspeed_config["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
        ds.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    return acc


def policy_and_adapter(cfg: GRPOStageConfig) -> tuple[str, str | None]:
    """``(the policy's resolved checkpoint, the LoRA adapter folder it starts from or None)``: a
    ``policy`` that is an adapter folder is its base plus itself (:func:`online_rlhf.adapters.split_model`).

    Raises:
        ConfigError: both are adapters, an adapter without ``lora``, a ``lora`` key peft refuses or one
            the continued adapter was not trained with.
    """
    base, adapter = split_model(cfg.policy, cfg.adapter)
    if cfg.lora:  # every key, before any weight is loaded, continued adapter or fresh
        check_lora(cfg.lora, "lora")
    if adapter is not None:
        continued_lora_config(adapter, cfg.lora)
    return base, adapter


def _with_lora(cfg: GRPOStageConfig, model, adapter: str | None):
    """``model`` wrapped for LoRA training (``cfg.lora``): the adapter folder ``adapter`` continued
    (its own config; ``r`` / ``lora_alpha`` of ``cfg.lora`` must agree), or a fresh adapter; only
    the adapter's weights train."""
    from peft import get_peft_model

    if adapter is not None:  # its lora keys were checked against it by policy_and_adapter
        model = load_with_adapter(model, adapter, trainable=True)
    else:
        model = get_peft_model(model, check_lora(cfg.lora, "lora"))
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings' output must carry gradients
    return model


def load_policy(cfg: GRPOStageConfig, policy_path: str, on_gpu: bool, with_reference: bool,
                adapter: str | None = None):
    """The policy to train (in the stage's dtype, gradient checkpointing as set; with ``cfg.lora`` a
    LoRA adapter on it, ``adapter`` continued) and, when ``with_reference`` and ``beta > 0`` and
    ``reference`` is another checkpoint, the reference model.

    Returns:
        ``(model, its config as loaded (a dict, for the save), ref_model | None, ref_path | None (None: the
        policy is the reference), stored dtype, dtype, ref_adapter_off)``; ``ref_adapter_off``: the
        reference is the policy's base with the continued adapter switched off (no second model).
    """
    pol_stored = stored_dtype(policy_path)
    dtype = cfg.torch_dtype if cfg.torch_dtype != "auto" else ("float32" if not on_gpu else pol_stored or "float32")
    model = load_causal_lm(policy_path, dtype, cfg.attn_implementation, False)
    orig_config = model.config.to_dict()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.lora:
        model = _with_lora(cfg, model, adapter)
    ref_path = resolve_model(cfg.reference) if cfg.reference is not None else None
    ref_adapter_off = False
    if ref_path is not None and Path(ref_path).exists() and Path(policy_path).exists() and \
            Path(ref_path).resolve() == Path(policy_path).resolve():
        ref_path = None  # the same checkpoint: its log-probs are the old log-probs
        ref_adapter_off = adapter is not None  # ... unless an adapter sits on it: then the adapter switched off
    ref_model = None
    if cfg.beta != 0.0 and ref_path is not None and with_reference:
        ref_model = load_causal_lm(ref_path, dtype, cfg.attn_implementation, False)
    return model, orig_config, ref_model, ref_path, pol_stored, dtype, ref_adapter_off


def prepare_models(cfg: GRPOStageConfig, accelerator, policy_path: str, on_gpu: bool, with_reference: bool,
                   adapter: str | None = None):
    """:func:`load_policy`, the reference on the accelerator's device, AdamW over the policy's
    trainable weights (with LoRA: the adapter's), and ``accelerator.prepare`` of both (the stage and
    its dry run).

    Returns:
        ``(model, optimizer, ref_model or None, orig_config, ref_path, pol_stored, dtype, ref_adapter_off)``.
    """
    import torch

    model, orig_config, ref_model, ref_path, pol_stored, dtype, ref_adapter_off = load_policy(
        cfg, policy_path, on_gpu, with_reference, adapter)
    if ref_model is not None:
        ref_model = ref_model.to(accelerator.device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, ref_model, orig_config, ref_path, pol_stored, dtype, ref_adapter_off


def old_and_reference_log_probs(cfg: GRPOStageConfig, accelerator, model, ref_model, completions: list[dict],
                                pad_id: int, ref_adapter_off: bool = False
                                ) -> tuple[list[list[float]], list[list[float]] | None]:
    """Every completion's per-token log-probs under the policy before any update (``old``) and, when
    ``beta != 0``, under the reference (the policy's own when ``ref_model`` is None: the reference is
    the policy; with ``ref_adapter_off`` the policy's LoRA adapter switched off: its base); ``ref``
    is None at ``beta == 0``."""
    old = all_log_probs(accelerator, model, completions, cfg.per_device_train_batch_size, pad_id, cfg.temperature)
    if cfg.beta == 0.0:
        return old, None
    if ref_adapter_off:
        with accelerator.unwrap_model(model).disable_adapter():
            return old, all_log_probs(accelerator, model, completions, cfg.per_device_train_batch_size, pad_id,
                                      cfg.temperature)
    if ref_model is None:
        return old, old
    with prepared_forward(accelerator, ref_model):  # the reference as the prepared policy runs: same precision
        ref = all_log_probs(accelerator, ref_model, completions, cfg.per_device_train_batch_size, pad_id,
                             cfg.temperature)
    return old, ref


# ------------------------------------------------------------------------------ the recipe

def construct(cfg: GRPOStageConfig) -> bool:
    """The stage's environment, before anything is read: caches, the process-count check, the
    threads (CPU) and the seed. Returns whether CUDA is available.

    Raises:
        ConfigError: another process count than planned.
    """
    setup_cache_env()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch

    check_process_count(cfg.num_processes, "grpo")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # a stage alone on the machine: every usable core, split between the ranks
        torch.set_num_threads(stage_threads(processes_here(launch_world_size())))
    torch.manual_seed(cfg.seed)
    return on_gpu


def load_tokenizer(policy_path: str):
    """The policy's tokenizer and its pad id (the eos id when it has no pad token).

    Raises:
        ConfigError: it has no chat template (conversational prompts need one).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    if tokenizer.chat_template is None:
        raise ConfigError(f"{policy_path}: the tokenizer has no chat template; conversational prompts need one.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer, pad_id


@dataclass
class GRPOData:
    """Steps 1-3 (:func:`setup_data`): the groups read, the policy and its pad id, the training
    completions and :func:`build_completions`' info."""

    groups: list[dict]
    read_info: dict
    policy_path: str
    pad_id: int
    completions: list[dict]
    info: dict
    adapter: Optional[str] = None  # the LoRA adapter the policy starts from (on policy_path), or None


def setup_data(cfg: GRPOStageConfig) -> GRPOData:
    """Steps 1-3: the groups (:func:`load_groups`), their advantages (:func:`group_advantages`) and
    the completions' token ids (:func:`build_completions`).

    Raises:
        DataError: the rewards file is empty or holds an invalid record.
        ConfigError: the policy's tokenizer has no chat template.
    """
    import torch

    groups, read_info = load_groups(cfg.rewards, cfg.truncated_penalty)
    if not groups:
        raise DataError(f"{cfg.rewards}: the rewards file is empty, nothing to train on. More prompts "
                        "(prompts_per_iteration) give more groups.")
    K = max(len(g["rewards"]) for g in groups)
    rewards = torch.tensor([[math.nan if r is None else r for r in g["rewards"]] + [math.nan] * (K - len(g["rewards"]))
                            for g in groups], dtype=torch.float64)  # (G, K)
    advantages, usable = group_advantages(rewards, cfg.scale_rewards)
    policy_path, adapter = policy_and_adapter(cfg)
    tokenizer, pad_id = load_tokenizer(policy_path)
    completions, info = build_completions(groups, advantages, usable, tokenizer, cfg.max_length,
                                          cfg.mask_truncated_completions)
    return GRPOData(groups=groups, read_info=read_info, policy_path=policy_path, pad_id=pad_id,
                    completions=completions, info=info, adapter=adapter)


@dataclass
class GRPOModels:
    """Steps 4-5 (:func:`setup`): the accelerator, the prepared policy and its optimizer, what the
    save and the stats need of the loading, and the old (and reference) log-probs."""

    accelerator: Any
    model: Any
    optimizer: Any
    orig_config: dict
    ref_path: Optional[str]
    pol_stored: Optional[str]
    dtype: str
    old: list[list[float]]
    ref: Optional[list[list[float]]]
    ref_adapter_off: bool = False


def setup(cfg: GRPOStageConfig, data: GRPOData, on_gpu: bool) -> tuple[GRPOModels, dict]:
    """Steps 4-5: the accelerator (:func:`_accelerator`), the models (:func:`prepare_models`; the
    reference only when there is something to train) and the old (and reference) log-probs before
    any update (:func:`old_and_reference_log_probs`; the reference model is freed after).

    Returns:
        ``(models, seconds {model_loading, old_log_probs})``.
    """
    accelerator = _accelerator(cfg)
    t0 = time.perf_counter()
    model, optimizer, ref_model, orig_config, ref_path, pol_stored, dtype, ref_adapter_off = prepare_models(
        cfg, accelerator, data.policy_path, on_gpu, with_reference=bool(data.completions), adapter=data.adapter)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    old, ref = old_and_reference_log_probs(cfg, accelerator, model, ref_model, data.completions, data.pad_id,
                                           ref_adapter_off)
    ref_model = None
    old_s = time.perf_counter() - t0
    models = GRPOModels(accelerator=accelerator, model=model, optimizer=optimizer, orig_config=orig_config,
                        ref_path=ref_path, pol_stored=pol_stored, dtype=dtype, old=old, ref=ref,
                        ref_adapter_off=ref_adapter_off)
    return models, {"model_loading": load_s, "old_log_probs": old_s}


def write_stats(cfg: GRPOStageConfig, data: GRPOData, m: GRPOModels, history: list[dict], out_dir: Path,
                on_gpu: bool, seconds: dict, t_start: float) -> GRPOStats:
    """The stage's stats (written to ``<output_dir>.stats.json`` by rank 0, with the summary line)."""
    accelerator, completions, info, groups = m.accelerator, data.completions, data.info, data.groups
    used_adv = [abs(c["advantage"]) for c in completions]
    ds = accelerator.state.deepspeed_plugin
    stats = GRPOStats(
        stage="grpo", policy=data.policy_path,
        reference={"source": "none" if cfg.beta == 0.0 else ("explicit" if m.ref_path else "policy"),
                   "path": m.ref_path or data.policy_path,
                   "lora_reference": None if cfg.beta == 0.0 or m.ref_path or not cfg.lora else
                   ("adapter_off" if m.ref_adapter_off or data.adapter is None else "previous_adapter")},
        adapter=data.adapter, saved="adapter" if cfg.save_adapter else "checkpoint",
        saved_mb=round(folder_mb(out_dir), 2),
        rewards_file=str(cfg.rewards), groups_in=len(groups), groups_used=info["groups_used"],
        groups_skipped=info["skipped"], skipped_examples=info["examples"], completions_used=len(completions),
        completions_masked=info["masked"], completions_cut=info["cut"], reward_mean=info["reward_mean"],
        reward_mean_all=data.read_info["reward_mean_all"],
        advantage_abs_mean=sum(used_adv) / len(used_adv) if used_adv else None,
        loss_type=cfg.loss_type, scale_rewards=cfg.scale_rewards, beta=cfg.beta, epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon,
        learning_rate=cfg.learning_rate, num_iterations=cfg.num_iterations,
        steps=len(history), loss_first=history[0]["loss"] if history else None,
        loss_last=history[-1]["loss"] if history else None, kl_last=history[-1]["kl"] if history else None,
        clip_fraction_mean=sum(h["clip_fraction"] for h in history) / len(history) if history else None,
        ratio_first_step_max_dev=history[0]["ratio_max_dev"] if history else None, history=history,
        dtype={"policy_stored": m.pol_stored, "loaded": m.dtype, "mixed_precision": accelerator.mixed_precision},
        hardware=describe("cuda" if on_gpu else "cpu", m.dtype + ("" if accelerator.mixed_precision == "no"
                                                                  else f" + {accelerator.mixed_precision} autocast"),
                          processes=accelerator.num_processes),
        num_processes=accelerator.num_processes,
        deepspeed_zero_stage=ds.zero_stage if ds is not None else None,
        output_dir=str(out_dir),
        seconds={"total": time.perf_counter() - t_start, **seconds},
        input_blank_lines=data.read_info["blank_lines"],
    )
    if accelerator.is_main_process:
        stats.write(stats_path(out_dir))
        loss = "no step" if not history else f"loss {stats.loss_first:.4f} -> {stats.loss_last:.4f}"
        print(f"grpo: {info['groups_used']}/{len(groups)} groups ({len(completions)} completions; skipped "
              f"{info['skipped'] or 'none'}), mean reward {stats.reward_mean}, {len(history)} steps, {loss}, "
              f"clip fraction {stats.clip_fraction_mean}; saved {out_dir} ({stats_path(out_dir)})")
    return stats


def main(cfg: GRPOStageConfig) -> GRPOStats:
    """Run the GRPO stage (:func:`construct`, :func:`setup_data`, :func:`setup`, :func:`train`,
    :func:`save`, :func:`write_stats`); return its stats (also written to
    ``<output_dir>.stats.json`` by rank 0). With ``cfg.dry_run``: :func:`dry_run` instead,
    returning :class:`~online_rlhf.stats.DryRunStats` (``<output_dir>.dry_run.json``).

    When every group is skipped (e.g. all rewards equal), the policy is saved unchanged with
    ``steps=0`` and a warning: the loop goes on to the next iteration.

    Raises:
        ConfigError: a tokenizer without a chat template, a process count other than planned.
        DataError: the rewards file is empty or holds an invalid record (names file:line).
    """
    if cfg.dry_run:  # one optimizer step on dummy max-length completions; nothing read or saved
        return dry_run(cfg)
    t_start = time.perf_counter()
    on_gpu = construct(cfg)
    out_dir = Path(cfg.output_dir).resolve()
    data = setup_data(cfg)  # 1-3. groups, advantages, token ids
    m, seconds = setup(cfg, data, on_gpu)  # 4-5. models, old (and reference) log-probs
    t0 = time.perf_counter()  # 6. passes
    history = (train(cfg, m.accelerator, m.model, m.optimizer, data.completions, m.old, m.ref, data.pad_id)
               if data.completions else [])
    seconds["train_steps"] = time.perf_counter() - t0
    if m.accelerator.is_main_process:
        for w in data_warnings(data.info, len(data.groups), len(data.completions), cfg.max_length, cfg.rewards):
            print(f"WARNING: {w}")
    t0 = time.perf_counter()  # 7. save
    save(m.accelerator, m.model, Path(f"{out_dir}.tmp"), out_dir, data.policy_path, m.orig_config, False,
         lora=None if not cfg.lora else "adapter" if cfg.save_adapter else "merged")
    seconds["save"] = time.perf_counter() - t0
    return write_stats(cfg, data, m, history, out_dir, on_gpu, seconds, t_start)


# ------------------------------------------------------------------------------ the dry run

def dry_run_lengths(cfg: GRPOStageConfig) -> tuple[int, int, int]:
    """``(L, C, P)`` of the dry run's dummy completions: ``max_length`` tokens in all, ``C`` of them
    completion (``max_completion_length``, leaving at least one prompt token) and ``P`` prompt.

    Raises:
        ConfigError: ``max_length`` is null (no largest shape to try).
    """
    if cfg.max_length is None:
        raise ConfigError("dry_run needs max_length (prompt + completion tokens to try); it is null. Set it, e.g. "
                          "max_length=1024 (in the loop: grpo.max_length).")
    L = int(cfg.max_length)
    C = min(int(cfg.max_completion_length), L - 1)  # at least one prompt token
    return L, C, L - C


def dry_run_record(cfg: GRPOStageConfig, L: int, C: int, P: int, world: int, dtype: str) -> tuple[str, dict, dict]:
    """``(step, shapes, settings)`` of the dry run's :class:`~online_rlhf.stats.DryRunStats`: the step
    it tried in words, the shapes of its batch and the settings that decide its memory."""
    B, ga = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    settings = {"per_device_train_batch_size": B, "gradient_accumulation_steps": ga, "max_length": L,
                "gradient_checkpointing": cfg.gradient_checkpointing, "beta": cfg.beta, "torch_dtype": dtype,
                "launch_profile": cfg.launch_profile, "num_processes": world}
    step = (f"1 optimizer step: {ga} micro-batch(es) x {B} completions x {L} tokens ({P} prompt + {C} completion) "
            "per process, forward + backward + AdamW step, old log-probs" + (" and reference log-probs"
                                                                           if cfg.beta != 0.0 else "") + " first")
    shapes = {"completions_per_process": B * ga, "micro_batch_completions": B, "sequence_tokens": L,
              "prompt_tokens": P, "completion_tokens": C}
    return step, shapes, settings


def dry_run(cfg: GRPOStageConfig) -> Optional[DryRunStats]:
    """The GRPO stage's dry run (``dry_run=true``): :func:`construct`, then the stage's own path:
    its model loading (:func:`prepare_models`: dtype, gradient checkpointing, the reference when
    ``beta > 0``), ``accelerate`` set-up (DDP / DeepSpeed profile), old (and reference) log-prob
    passes and :func:`train` for one optimizer step on ``per_device_train_batch_size x
    gradient_accumulation_steps x processes`` dummy completions whose prompt + completion is exactly
    ``max_length`` tokens (``max_completion_length`` of completion): forward + backward of every
    micro-batch, then the AdamW step. Nothing is read or saved; only
    :class:`~online_rlhf.stats.DryRunStats` is written, beside ``output_dir``
    (``online_rlhf.dry_run.finish``).

    Raises:
        ConfigError: ``max_length`` is null (no largest shape to try), or the tokenizer has no chat template.
        SystemExit(1): the step ran out of (GPU) memory, after the result was written.
    """
    t_start = time.perf_counter()
    on_gpu = construct(cfg)
    import torch

    L, C, P = dry_run_lengths(cfg)
    B, ga = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    status, error, step_s, world, dtype = "ok", None, None, launch_world_size(), cfg.torch_dtype
    with PeakMemory("cuda" if on_gpu else "cpu") as mem:
        try:
            policy_path, adapter = policy_and_adapter(cfg)
            tokenizer, pad_id = load_tokenizer(policy_path)
            accelerator = _accelerator(cfg)
            world = accelerator.num_processes
            n = B * ga * world  # one optimizer step
            ids = dummy_ids(tokenizer, 2 * n, max(P, C), seed=5)
            completions = [{"prompt_ids": ids[2 * j][:P], "completion_ids": ids[2 * j + 1][:C],
                            "advantage": 1.0 if j % 2 == 0 else -1.0, "group": j // 2} for j in range(n)]
            model, optimizer, ref_model, _, _, _, dtype, ref_adapter_off = prepare_models(
                cfg, accelerator, policy_path, on_gpu, with_reference=True, adapter=adapter)
            old, ref = old_and_reference_log_probs(cfg, accelerator, model, ref_model, completions, pad_id,
                                                   ref_adapter_off)
            ref_model = None
            t0 = time.perf_counter()
            train(cfg.model_copy(update={"num_iterations": 1}), accelerator, model, optimizer, completions, old, ref,
                  pad_id)
            if on_gpu:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        except out_of_memory_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    step, shapes, settings = dry_run_record(cfg, L, C, P, world, dtype)
    result = finish("grpo", mem, cfg.output_dir, status=status, error=error, step_s=step_s, step=step, shapes=shapes,
                    settings=settings, t_start=t_start)
    exit_if_out_of_memory("grpo", status, error)
    return result


def cli() -> None:
    """Command-line entry point (grpo_iteration/run_grpo.py calls this)."""
    run_main(main, GRPOStageConfig)


if __name__ == "__main__":
    cli()
