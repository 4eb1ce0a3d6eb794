"""DPO stage: train the policy on pairs.jsonl with TRL's DPOTrainer and save an HF checkpoint.

    accelerate launch --config_file configs/accelerate/cpu.yaml dpo_iteration/run_dpo.py \
        --config configs/dpo.yaml policy=default pairs=runs/x/iter_1/pairs.jsonl output_dir=runs/x/iter_1/model

Reads one pairs file (``{prompt, chosen, rejected}`` as message lists, online_rlhf/records.py), writes
one checkpoint directory (safetensors + tokenizer + chat template + generation_config, with the
input policy's bos/eos/pad) and a stats JSON (``<output_dir>.stats.json``: ``online_rlhf.stats.DPOStats``).

Order of work (torchtune-recipe style: :func:`main` calls one function a step, :func:`construct` 1,
:func:`setup_data` 2, :func:`setup` 3-4 up to training, :func:`train`, :func:`save` 5, :func:`write_stats`):
  1. validate the config: every ``training`` key is a ``trl.DPOConfig`` field, every ``lora`` key a
     ``peft.LoraConfig`` field, dtypes of policy and reference agree -- before any weight is loaded;
  2. read and check the pairs; tokenize them once with the policy's chat template
     (:func:`tokenize_pairs`: message contents as plain text, so a ``<|im_end|>`` written inside a
     response is text, not an EOS; BOS exactly once, as generation gave it); drop (and count by
     reason) invalid pairs and pairs whose prompt leaves no room for the response; count the
     sequences ``max_length`` will truncate and the pairs holding special-token strings
     (``special_token_text`` in the stats and the log line);
  3. load policy, reference (only when it differs from the policy, or when reference log-probs
     are not precomputed) and tokenizer;
  4. build ``DPOTrainer`` on those token ids (TRL does not tokenize again; precomputes reference
     log-probs once when ``training.precompute_ref_log_probs`` is on, the stage default), train;
  5. save into ``<output_dir>.tmp`` (LoRA adapters merged first), rename to ``output_dir``.

Dry run (``dry_run=true``, :func:`dry_run`): step 1, then steps 3-4 for one optimizer step on dummy
pairs of ``training.max_length`` tokens; it writes only ``<output_dir>.dry_run.json``.

The reference model: ``reference=None`` (or the policy's own path) means "the policy as it is
before this stage", i.e. the loop's ``ref_model: previous``; ``reference=<dir>`` (the loop's
``ref_model: initial``) loads that checkpoint as ``ref_model``. The stats record which one.

Token ids: a response is trained on as the tokenization of its text (the record holds the text,
not the sampled ids). That equals the sampled ids except where the sampler chose another split of
the same text, or generated a special id vLLM leaves out of the text; the generation stage counts
those responses (``response_ids_differ_from_text`` in its stats). The prompt gets a BOS when the
policy's tokenizer adds one and the template does not write it, as generation does (TRL's own
tokenization leaves it out; SmolLM2 and Llama-3 are unaffected).

Truncation in TRL 1.9: there is no ``max_prompt_length``; the collator cuts prompt+response to
``max_length`` keeping the start (``truncation_mode="keep_start"``), and the trainer silently drops
examples whose prompt alone fills ``max_length``. This stage drops those itself, counted, plus
prompts over the stage's own ``max_prompt_length``; so every trained sequence keeps at least one
response token.
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from online_rlhf.checkpoint import finish_checkpoint, publish, restore_input_config, rmtree
from online_rlhf.chat_tokens import ChatTokenError, messages_have_special_text, prompt_response_ids
from online_rlhf.config import ConfigError, run_main
from online_rlhf.dry_run import dummy_ids, exit_if_out_of_memory, finish, is_main_rank, out_of_memory_errors
from online_rlhf.hardware import compute_dtype, describe, processes_here, stage_threads
from online_rlhf.jsonl import DataError, iter_jsonl, write_jsonl
from online_rlhf.memory import PeakMemory
from online_rlhf.paths import resolve_model, setup_cache_env
from online_rlhf.records import validate_pair
from online_rlhf.stage_configs import DPOStageConfig
from online_rlhf.stage_table import check_process_count
from online_rlhf.stats import DPOStats, DryRunStats, PairsStats, stats_path
from online_rlhf.trl_args import check_dpo_training, check_lora
from online_rlhf.trl_args import per_device_batch as split_batch

_HALF = {"float16", "bfloat16"}
# config.json keys put back from the input policy before saving (the Trainer may change them,
# e.g. use_cache=False under gradient checkpointing).
_MAX_EXAMPLES = 5  # dropped-record examples kept per reason in the stats


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _under_deepspeed() -> bool:
    """Started by ``accelerate launch`` with a DeepSpeed profile (it sets this variable)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def training_defaults(on_gpu: bool, world_size: int) -> dict:
    """The stage's defaults under ``cfg.training`` (the user's keys win).

    - Mixed precision from the hardware (:func:`online_rlhf.hardware.compute_dtype`): on CPU,
      ``bf16=True`` (autocast, fp32 master weights) only with native bf16 (AVX512-BF16/AMX),
      else ``bf16=False`` (emulated bf16 is ~100x slower); on a GPU without bf16, ``fp16=True``.
    - ``precompute_ref_log_probs=True``: one reference pass over the pairs before training
      instead of one per step (see bench/bench_dpo_ref.py).
    - ``report_to="none"``; ``save_strategy="no"`` (the stage saves once, at the end);
      ``logging_steps=1`` (the stats report first/last step values).
    - ``ddp_backend="gloo"`` on CPU with several processes (DeepSpeed/DDP need it there).
    """
    d = {"precompute_ref_log_probs": True, "report_to": "none", "save_strategy": "no", "logging_steps": 1,
         "seed": 42, "dataloader_pin_memory": on_gpu}
    mixed = compute_dtype("cuda" if on_gpu else "cpu")
    if on_gpu:
        if mixed == "float16":  # a GPU without bf16 (e.g. V100): fp16 mixed precision instead of TRL's bf16
            d.update(bf16=False, fp16=True)
    else:
        # bf16 autocast over fp32 weights only where the CPU has native bf16; DeepSpeed on CPU stays fp32
        d["bf16"] = mixed == "bfloat16" and not _under_deepspeed()
        if world_size > 1:
            d["ddp_backend"] = "gloo"
    return d


def per_device_batch(cfg: DPOStageConfig, world_size: int) -> dict:
    """``{"per_device_train_batch_size": n}`` from ``cfg.train_batch_size`` over ``world_size``
    processes (:func:`online_rlhf.trl_args.per_device_batch`, which raises ConfigError on a
    conflicting or indivisible setting); ``{}`` when it is not set."""
    per = split_batch(cfg.train_batch_size, cfg.training, world_size)
    return {} if per is None else {"per_device_train_batch_size": per}


def build_dpo_args(cfg: DPOStageConfig, work_dir: Path, on_gpu: bool, overrides: dict | None = None,
                   world_size: int | None = None):
    """``trl.DPOConfig`` from the stage defaults + ``cfg.training`` (+ ``overrides``, e.g. the dry
    run's ``max_steps=1``); invalid values raise ConfigError. Nothing is written (``work_dir`` is
    only named), so the loop's plan builds it too, before any stage runs.

    Args:
        world_size: the processes ``train_batch_size`` is split over (default: this run's
            ``WORLD_SIZE``; the plan passes the planned ``num_processes``). The DDP settings follow
            this run's ``WORLD_SIZE`` (in the plan: 1, no process group to set up).
    """
    from trl import DPOConfig

    world = _world_size() if world_size is None else world_size
    kw = {**training_defaults(on_gpu, _world_size()), **per_device_batch(cfg, world),
          **check_dpo_training(cfg.training), **(overrides or {})}
    if not on_gpu and kw.get("bf16"):
        compute_dtype("cpu", "bfloat16")  # warns when the CPU has no native bf16
        if not _under_deepspeed():
            kw.setdefault("use_cpu", True)  # transformers refuses bf16 on CPU without it
    report_to = kw.get("report_to")
    if report_to == "wandb" or (isinstance(report_to, list) and "wandb" in report_to) or report_to == "all":
        os.environ.setdefault("WANDB_MODE", "offline")  # never block on a network we may not have
    try:
        return DPOConfig(output_dir=str(work_dir), **kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"training: trl.DPOConfig refused the values: {e}") from None


def build_lora_config(lora: dict | None):
    """``peft.LoraConfig`` from ``cfg.lora`` (task_type CAUSAL_LM by default); unknown keys raise ConfigError
    (see ``online_rlhf.trl_args.check_lora``, which the loop's plan also runs)."""
    return check_lora(lora, "lora")


def stored_dtype(model: str, trust_remote_code: bool = False) -> str | None:
    """dtype a checkpoint's config.json declares (``"bfloat16"``...), or None when it declares none."""
    from transformers import AutoConfig

    try:
        conf = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise FileNotFoundError(f"cannot read the model config of {model!r}: {e}") from None
    dt = getattr(conf, "dtype", None) or getattr(conf, "torch_dtype", None)
    return str(dt).replace("torch.", "") if dt is not None else None


def resolve_load_dtypes(torch_dtype: str, policy_stored: str | None, ref_stored: str | None, on_gpu: bool,
                        fp16: bool, bf16: bool) -> tuple[str, str]:
    """The dtypes policy and reference are loaded in; refuse half-precision mismatches.

    ``auto``: float32 on CPU; on GPU each checkpoint's stored dtype (float32 when it names none).
    An explicit ``torch_dtype`` loads both in that dtype.

    Raises:
        ConfigError: one checkpoint is float16 and the other bfloat16 under ``auto`` (their
        log-probs would come from different number formats; the error names the fix), or the
        loaded policy dtype contradicts the mixed precision asked in ``training`` (fp16 / bf16).
    """
    if torch_dtype == "auto" and {policy_stored, ref_stored} == _HALF:
        raise ConfigError(
            f"the policy is stored in {policy_stored} but the reference in {ref_stored}: DPO compares their "
            "log-probs, and float16 vs bfloat16 differ in range and rounding. Set torch_dtype=bfloat16 (or "
            "float32) to load both in one dtype, or convert one checkpoint."
        )
    if torch_dtype != "auto":
        pol = ref = torch_dtype
    elif not on_gpu:
        pol = ref = "float32"
    else:
        pol, ref = policy_stored or "float32", ref_stored or "float32"
    if pol == "float16" and bf16:
        raise ConfigError("the policy is loaded in float16 but training.bf16 is on; set training.fp16=true "
                          "and training.bf16=false, or torch_dtype=bfloat16.")
    if pol == "bfloat16" and fp16:
        raise ConfigError("the policy is loaded in bfloat16 but training.fp16 is on; set training.bf16=true "
                          "and training.fp16=false, or torch_dtype=float16.")
    return pol, ref


def _pair_problem(rec: dict, where: str) -> tuple[str, str] | None:
    """Why a pair cannot be trained on: ``(drop reason, what exactly is wrong)``, or None when it is fine."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
    if missing:
        return "malformed", f"missing {', '.join(missing)}"
    try:
        validate_pair(rec, where)
    except DataError as e:
        if rec.get("chosen") == rec.get("rejected"):
            return "chosen_equals_rejected", "chosen and rejected are the same"
        return "malformed", str(e).removeprefix(f"{where}: ")
    for side in ("chosen", "rejected"):
        msgs = rec[side]
        roles = [m["role"] for m in msgs]
        if any(r != "assistant" for r in roles):
            return "malformed", f"{side} must be assistant messages only, got roles {roles}"
        if not "".join(m["content"] for m in msgs).strip():
            return "empty_response", f"{side} is empty"
    return None


def load_pairs(path: str) -> tuple[list[dict], dict]:
    """Read pairs.jsonl; return the valid pairs (prompt/chosen/rejected only) and drop counts.

    Returns:
        (pairs, info) with info = ``{"in": n, "dropped": {reason: n}, "examples": {reason: ["file:line"]}}``.
        Reasons: ``malformed`` (missing key, bad message list, non-assistant response),
        ``chosen_equals_rejected``, ``empty_response``; each example is ``"file:line (what is wrong)"``.
    Raises:
        FileNotFoundError: no such file.  DataError: a line is not JSON (names file:line).
    """
    pairs, dropped, examples = [], Counter(), {}
    n = 0
    for lineno, rec in iter_jsonl(path):
        n += 1
        where = f"{path}:{lineno}"
        problem = _pair_problem(rec, where)
        if problem:
            reason, why = problem
            dropped[reason] += 1
            examples.setdefault(reason, [])
            if len(examples[reason]) < _MAX_EXAMPLES:
                examples[reason].append(f"{where} ({why})")
            continue
        pairs.append({**{k: [{"role": m["role"], "content": m["content"]} for m in rec[k]]
                         for k in ("prompt", "chosen", "rejected")}, "_where": where})
    return pairs, {"in": n, "dropped": dict(dropped), "examples": examples}


def tokenize_pairs(pairs: list[dict], tokenizer) -> tuple[list[dict], dict]:
    """Token ids of each pair as the trainer will use them; message contents stay text.

    ``online_rlhf.chat_tokens.prompt_response_ids`` with the policy's chat template: ``prompt_ids``
    = the prompt with the generation prompt, BOS exactly once (the ids generation gave the policy);
    ``chosen_ids`` / ``rejected_ids`` = the rest of prompt + response (the response text and the
    template's end-of-turn marker). Only the template's own markers are special ids: a
    ``<|im_end|>`` written inside a response or a prompt is the text's sub-tokens, not an EOS or a
    new turn. (TRL's own tokenization, ``apply_chat_template(tokenize=True)``, parses them as
    special tokens; the trainer here is given these ids instead, see :func:`_timed_trainer_class`.)

    Returns:
        (pairs with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` added, info) with info =
        ``{"dropped": {reason: n}, "examples": {reason: ["file:line (why)"]}}``, reason
        ``ChatTokenError.reason``: ``special_text_not_tokenizable`` (a content holds a special-token
        string and the template rewrites contents beyond stripping whitespace),
        ``template_renders_prompt_differently`` (the template writes the prompt differently once a
        response follows) or ``response_not_tokenizable_alone``. A response whose first characters
        merge with the prompt's last token (Qwen2's ``"\\n"`` + ``"\\n"``) is kept: its ids are its
        text tokenized on its own (``prompt_response_ids``).
    """
    out, dropped, examples = [], Counter(), {}
    for p in pairs:
        try:
            prompt_ids, (chosen_ids, rejected_ids) = prompt_response_ids(tokenizer, p["prompt"], p["chosen"],
                                                                         p["rejected"])
        except ChatTokenError as e:
            dropped[e.reason] += 1
            ex = examples.setdefault(e.reason, [])
            if len(ex) < _MAX_EXAMPLES:
                ex.append(f"{p['_where']} ({e})")
            continue
        out.append({**p, "prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids})
    return out, {"dropped": dict(dropped), "examples": examples}


def special_text_counts(pairs: list[dict], tokenizer) -> dict:
    """How many pairs hold a special-token string of the policy's tokenizer in their prompt, chosen, rejected.

    Returns:
        ``{"prompts": n, "chosen": n, "rejected": n}`` (each side counted once per pair).
    """
    return {side: sum(1 for p in pairs if messages_have_special_text(tokenizer, p[key]))
            for side, key in (("prompts", "prompt"), ("chosen", "chosen"), ("rejected", "rejected"))}


def check_lengths(pairs: list[dict], max_length: int | None, max_prompt_length: int | None,
                  truncation_mode: str) -> tuple[list[dict], dict]:
    """Drop pairs whose prompt leaves no response token; count what ``max_length`` will truncate.

    Token counts are the lengths of the ids the trainer gets (:func:`tokenize_pairs`):
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids``.

    A pair is dropped (reason ``prompt_too_long``) when its prompt is longer than
    ``max_prompt_length``, or, with ``keep_start`` truncation, when the prompt alone has
    ``>= max_length`` tokens (TRL would drop it silently; every kept sequence then keeps at least
    one response token). Kept pairs over ``max_length`` lose tokens from the end of the response
    (``keep_start``) or the start of the prompt (``keep_end``); they are counted, not dropped.

    Returns:
        (kept pairs, info) with info holding ``dropped``, ``examples``, ``truncation`` counts and
        ``sequence_tokens`` (the kept pairs' prompt + chosen and prompt + rejected tokens after
        truncation: the tokens one epoch trains on, padding not counted).
    """
    kept, dropped, examples = [], Counter(), {}
    trunc = Counter()
    max_p = max_seq = seq_tokens = 0
    for p in pairs:
        n_p, n_c, n_r = len(p["prompt_ids"]), len(p["chosen_ids"]), len(p["rejected_ids"])
        max_p, max_seq = max(max_p, n_p), max(max_seq, n_p + n_c, n_p + n_r)
        too_long = (max_prompt_length is not None and n_p > max_prompt_length) or (
            max_length is not None and truncation_mode == "keep_start" and n_p >= max_length)
        if too_long:
            dropped["prompt_too_long"] += 1
            ex = examples.setdefault("prompt_too_long", [])
            if len(ex) < _MAX_EXAMPLES:
                ex.append(f"{p['_where']} ({n_p} prompt tokens)")
            continue
        cap = max_length if max_length is not None else n_p + max(n_c, n_r)
        seq_tokens += min(n_p + n_c, cap) + min(n_p + n_r, cap)
        if max_length is not None:
            c_over, r_over = n_p + n_c > max_length, n_p + n_r > max_length
            trunc["chosen_truncated"] += c_over
            trunc["rejected_truncated"] += r_over
            trunc["pairs_truncated"] += c_over or r_over
        kept.append(p)
    info = {"dropped": dict(dropped), "examples": examples, "sequence_tokens": seq_tokens,
            "truncation": {"max_length": max_length, "max_prompt_length": max_prompt_length,
                           "truncation_mode": truncation_mode, "pairs_truncated": trunc["pairs_truncated"],
                           "chosen_truncated": trunc["chosen_truncated"],
                           "rejected_truncated": trunc["rejected_truncated"],
                           "prompt_tokens_max": max_p, "sequence_tokens_max": max_seq}}
    return kept, info


def log_probs_layout(log_probs: str, on_gpu: bool) -> str | None:
    """The :mod:`online_rlhf.completion_logps` layout for ``cfg.log_probs``: ``auto`` is
    ``"sequence"`` on CPU (no padding at all; measured fastest there, bench/bench_dpo_step.py) and
    ``"side"`` on GPU (two larger products per step instead of 2B small ones; not measured: no GPU
    was lent); ``trl`` is None (TRL's own computation)."""
    if log_probs == "auto":
        return "side" if on_gpu else "sequence"
    return None if log_probs == "trl" else log_probs


def load_causal_lm(path: str, dtype: str, attn: str, trust_remote_code: bool):
    """``AutoModelForCausalLM`` of the checkpoint at ``path`` in ``dtype`` (``"float32"``, ``"bfloat16"``,
    ...) with attention ``attn`` (``"sdpa"``, ...); the DPO and GRPO stages load policy and reference so."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attn,
                                                trust_remote_code=trust_remote_code)


@contextmanager
def prepared_forward(accelerator, model):
    """While the block runs, ``model.forward`` runs under ``accelerator``'s mixed-precision autocast
    and returns fp32 outputs, as it does once ``accelerator.prepare`` has wrapped it (accelerate's
    ``prepare_model``: autocast, then ``convert_outputs_to_fp32``; fp32 logits matter, a bf16
    log-softmax over the vocabulary is off by ~0.05 nats per token). A no-op without native
    mixed precision (fp32, DeepSpeed) or without a model."""
    if model is None or not accelerator.native_amp:
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32

    own = "forward" in vars(model)
    original = model.forward

    def forward(*args, **kwargs):
        with accelerator.autocast():
            return original(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(forward)
    try:
        yield
    finally:
        if own:
            model.forward = original
        else:
            del model.forward  # back to the class's method


def _timed_trainer_class(layout: str | None = "sequence"):
    """The stage's ``trl.DPOTrainer`` subclass. ``layout``: how :mod:`online_rlhf.completion_logps`
    runs the rows (``"sequence"``, ``"side"``), or None for TRL's own log-prob computation."""
    from trl import DPOTrainer

    from online_rlhf.completion_logps import row_groups

    if layout is not None:
        row_groups(2, layout)  # ValueError on an unknown layout

    class TimedDPOTrainer(DPOTrainer):
        """DPOTrainer that trains on the stage's token ids and records the seconds spent precomputing
        reference log-probs (for the stats).

        Overrides TRL 1.9's ``_prepare_dataset`` and wraps its ``_precompute_ref_logps`` (private;
        pinned version). A dataset that already holds ``prompt_ids``, ``chosen_ids`` and
        ``rejected_ids`` (:func:`tokenize_pairs`) is used as it is: TRL would otherwise tokenize
        the text again with ``apply_chat_template(tokenize=True)``, which turns a special-token
        string inside a message into a special token. TRL's drop of prompts that fill
        ``max_length`` is kept (a no-op here: :func:`check_lengths` dropped them, counted).
        """

        precompute_seconds = 0.0
        # Log-probs from the completion positions only, rows unpadded (online_rlhf.completion_logps),
        # in this layout; None = TRL's own computation. Settings that need TRL's code (e.g. another
        # loss type) turn it off at the first use: `completion_logps_refused` keeps the reason.
        completion_logps_request: str | None = layout
        completion_logps_refused: str | None = None
        _completion_layout_resolved = False
        _completion_layout: str | None = None

        def completion_layout(self) -> str | None:
            """The layout :mod:`online_rlhf.completion_logps` runs in for this trainer, or None when
            TRL's ``_compute_loss`` runs (the request was None, or ``fast_path_refusal`` named a
            reason, kept in ``completion_logps_refused``). Decided once, at the first batch."""
            if not self._completion_layout_resolved:
                from online_rlhf.completion_logps import fast_path_refusal

                if self.completion_logps_request is None:
                    self.completion_logps_refused = "turned off"
                else:
                    self.completion_logps_refused = fast_path_refusal(self)
                self._completion_layout = None if self.completion_logps_refused else self.completion_logps_request
                self._completion_layout_resolved = True
            return self._completion_layout

        def _compute_loss(self, model, inputs, return_outputs):
            layout = self.completion_layout()
            if layout is None or return_outputs:  # return_outputs wants the full logits
                return super()._compute_loss(model, inputs, return_outputs)
            from online_rlhf.completion_logps import compute_loss

            return compute_loss(self, model, inputs, layout)

        def compute_ref_log_probs(self, model, inputs):
            layout = self.completion_layout()
            if layout is None:
                return super().compute_ref_log_probs(model, inputs)
            from online_rlhf.completion_logps import reference_logps

            return reference_logps(self, model, inputs, layout).chunk(2)

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names or ()):
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            if args.max_length is not None and args.truncation_mode == "keep_start":
                dataset = dataset.filter(lambda ex: len(ex["prompt_ids"]) < args.max_length,
                                         desc=f"Dropping fully truncated examples from {dataset_name} dataset")
            return dataset

        def _precompute_ref_logps(self, *args, **kwargs):
            t = time.perf_counter()
            try:
                # TRL runs this pass before `train` prepares the model, so without the mixed precision
                # the steps run under: fp32 reference log-probs against the policy's bf16-autocast ones
                # (and the fp32 time on a CPU with native bf16). The forward of both models now runs as
                # accelerate's prepare makes it run in the steps.
                with prepared_forward(self.accelerator, self.model), \
                        prepared_forward(self.accelerator, self.ref_model):
                    return super()._precompute_ref_logps(*args, **kwargs)
            finally:
                self.precompute_seconds += time.perf_counter() - t

    return TimedDPOTrainer


def summarize_log_history(history: list[dict]) -> dict:
    """First/last training loss, reward accuracy and margin from ``trainer.state.log_history``."""
    steps = [h for h in history if "loss" in h]
    keys = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
    out = {"history": [{"step": h.get("step"), **{k: h[k] for k in keys if k in h}} for h in steps]}
    for name, key in (("train_loss", "loss"), ("rewards_accuracies", "rewards/accuracies"),
                      ("rewards_margins", "rewards/margins")):
        vals = [h[key] for h in steps if key in h]
        out[f"{name}_first"] = vals[0] if vals else None
        out[f"{name}_last"] = vals[-1] if vals else None
    return out


def save_checkpoint(trainer, tmp_dir: Path, policy_path: str, orig_config: dict, is_lora: bool,
                    trust_remote_code: bool) -> None:
    """Write the trained policy to ``tmp_dir`` (all ranks call this; rank 0 writes).

    Weights as safetensors (LoRA adapters merged, so vLLM loads a plain model); tokenizer, chat
    template and generation_config copied from the input policy unchanged; config.json keeps the
    input's bos/eos/pad ids and use_cache. No optimizer state, no training_args.bin.
    """
    model = trainer.accelerator.unwrap_model(trainer.model)
    if is_lora:
        model = model.merge_and_unload()
    restore_input_config(model, policy_path, orig_config)
    if is_lora:
        if trainer.accelerator.is_main_process:
            model.save_pretrained(tmp_dir, safe_serialization=True)
    else:
        trainer.save_model(str(tmp_dir))  # gathers ZeRO-3 shards; writes on rank 0 only
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        for junk in ("training_args.bin", "README.md"):
            (tmp_dir / junk).unlink(missing_ok=True)
        # The trainer's tokenizer may have been given a pad token; save the input's untouched one.
        finish_checkpoint(tmp_dir, policy_path, trust_remote_code)


# ------------------------------------------------------------------------------ the recipe

@dataclass
class DPORun:
    """The stage as :func:`construct` checked it, before any weight is loaded: what the later steps read.

    Attributes:
        t_start: ``time.perf_counter()`` at the start.  on_gpu: CUDA is available.
        out_dir, tmp_dir, work_dir: ``output_dir`` (resolved), ``<output_dir>.tmp`` (the checkpoint
            while it is written), ``<output_dir>.work`` (the pairs dataset).
        args: the ``trl.DPOConfig``; lora_config: the ``peft.LoraConfig`` or None.
        policy_path, ref_path: resolved checkpoints (``ref_path`` None: the policy is the reference).
        pol_stored, ref_stored: the dtypes their config.json declare; pol_dtype, ref_dtype: as loaded.
    """

    cfg: DPOStageConfig
    t_start: float
    on_gpu: bool
    out_dir: Path
    tmp_dir: Path
    work_dir: Path
    args: Any
    lora_config: Any
    policy_path: str
    ref_path: Optional[str]
    pol_stored: Optional[str]
    ref_stored: Optional[str]
    pol_dtype: str
    ref_dtype: str

    @property
    def trust(self) -> bool:
        """``training.trust_remote_code``: passed to every model and tokenizer load."""
        return self.args.trust_remote_code


@dataclass
class DPOData:
    """The pairs as the trainer gets them (:func:`setup_data`): the kept pairs (with their token ids),
    the file-backed dataset of those ids, the policy's tokenizer and the counts for the stats."""

    tokenizer: Any
    kept: list[dict]
    train_ds: Any
    pairs_in: int
    dropped: Counter
    examples: dict
    len_info: dict
    special: dict


def construct(cfg: DPOStageConfig, for_dry_run: bool = False) -> DPORun:
    """Step 1, the config checks, before any weight is loaded: the process count, every
    ``training`` key (``trl.DPOConfig``; with ``for_dry_run`` over :data:`DRY_RUN_ARGS`, in
    :func:`dry_run_work_dir`), every ``lora`` key, the dtypes of policy and reference.

    Raises:
        ConfigError: a bad DPO/LoRA setting, a dtype mix, LoRA under ZeRO-3, another process count
            than planned.
    """
    t_start = time.perf_counter()
    setup_cache_env()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch

    check_process_count(cfg.num_processes, "dpo")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # a stage alone on the machine: every usable core, split between the ranks
        torch.set_num_threads(stage_threads(processes_here(_world_size())))
    out_dir = Path(cfg.output_dir).resolve()
    tmp_dir, work_dir = Path(f"{out_dir}.tmp"), Path(f"{out_dir}.work")
    if for_dry_run:  # one optimizer step on dummy pairs in <output_dir>.dry_run.work
        args = build_dpo_args(cfg, dry_run_work_dir(out_dir), on_gpu, overrides=DRY_RUN_ARGS)
    else:
        args = build_dpo_args(cfg, work_dir, on_gpu)
    lora_config = build_lora_config(cfg.lora)
    trust = args.trust_remote_code
    policy_path = resolve_model(cfg.policy)
    ref_path = resolve_model(cfg.reference) if cfg.reference is not None else None
    if ref_path is not None and Path(ref_path).exists() and Path(policy_path).exists() and \
            Path(ref_path).resolve() == Path(policy_path).resolve():
        ref_path = None  # the same checkpoint: treat as "reference = policy"
    pol_stored = stored_dtype(policy_path, trust)
    ref_stored = stored_dtype(ref_path, trust) if ref_path else pol_stored
    pol_dtype, ref_dtype = resolve_load_dtypes(cfg.torch_dtype, pol_stored, ref_stored, on_gpu, args.fp16, args.bf16)
    if lora_config is not None and args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3:
        raise ConfigError("lora with DeepSpeed ZeRO-3 is not supported by this stage (the merge needs the full "
                          "weights on one rank); use the zero2 profile for LoRA.")
    return DPORun(cfg=cfg, t_start=t_start, on_gpu=on_gpu, out_dir=out_dir, tmp_dir=tmp_dir, work_dir=work_dir,
                  args=args, lora_config=lora_config, policy_path=policy_path, ref_path=ref_path,
                  pol_stored=pol_stored, ref_stored=ref_stored, pol_dtype=pol_dtype, ref_dtype=ref_dtype)


def _empty_pairs_error(pairs: str) -> DataError:
    """The error for an empty pairs file, with make_pairs' skip reasons and the fixes that fit them
    when its stats are beside the file."""
    why, fix = "", ("More prompts (prompts_per_iteration) or samples (generation.k), a smaller "
                    "pairs.min_margin, or pairs.truncated=penalize instead of exclude give more pairs.")
    try:  # a pairs file made by make_pairs has its stats beside it: its skip reasons, and the fixes that fit them
        st = PairsStats.read(stats_path(pairs))
        causes, fixes = st.no_pair_causes()
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(st.skipped.items())) or "nothing"
        why = f" make_pairs skipped: {skipped}." + (f" {'; '.join(causes)}." if causes else "")
        if fixes:
            fix = f"Change: {'; '.join(fixes)}."
    except FileNotFoundError:
        pass
    except DataError as e:  # stats of another version: say so, the empty pairs file is the error
        why = f" ({e})"
    return DataError(f"{pairs}: the pairs file is empty, nothing to train on.{why} {fix}")


def load_tokenizer(run: DPORun):
    """The policy's tokenizer.

    Raises:
        ConfigError: it has no chat template (conversational pairs need one).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.policy_path, trust_remote_code=run.trust)
    if tokenizer.chat_template is None:
        raise ConfigError(f"{run.policy_path}: the tokenizer has no chat template; conversational pairs need one.")
    return tokenizer


def setup_data(run: DPORun) -> DPOData:
    """Step 2: read and check the pairs, tokenize them (:func:`tokenize_pairs`), drop what cannot
    be trained on (:func:`check_lengths`) and write the kept ids as the trainer's dataset.

    Raises:
        DataError: the pairs file is empty or none of its pairs can be trained on.
        ConfigError: the tokenizer has no chat template.
    """
    cfg, args = run.cfg, run.args
    pairs, read_info = load_pairs(cfg.pairs)
    if read_info["in"] == 0:
        raise _empty_pairs_error(cfg.pairs)
    tokenizer = load_tokenizer(run)
    tokenized, tok_info = tokenize_pairs(pairs, tokenizer)
    kept, len_info = check_lengths(tokenized, args.max_length, cfg.max_prompt_length, args.truncation_mode)
    dropped = Counter(read_info["dropped"]) + Counter(tok_info["dropped"]) + Counter(len_info["dropped"])
    examples = {**read_info["examples"], **tok_info["examples"], **len_info["examples"]}
    special = special_text_counts(kept, tokenizer)
    if not kept:
        raise DataError(f"{cfg.pairs}: none of the {read_info['in']} pairs can be trained on "
                        f"(dropped: {dict(dropped)}; e.g. {examples}). " + (
                            "Raise training.max_length / max_prompt_length: the prompts are too long."
                            if set(len_info["dropped"]) == set(dropped) else
                            "Fix the pairs (schema: docs/run-directory.md; annotate_data/make_pairs.py "
                            "writes it)" + (", and raise training.max_length / max_prompt_length for the prompts "
                                            "that are too long." if len_info["dropped"] else ".")))

    # The kept pairs as a file-backed dataset in <output_dir>.work: TRL's reference precompute
    # names its cache file after the dataset's cache directory, which must be the same for every
    # rank (an in-memory dataset gets a random per-process path and rank 1 finds no file).
    # Written by the global rank 0 only: with several machines the folder is on a shared filesystem.
    with args.main_process_first(local=False, desc="DPO pairs dataset"):
        if args.process_index == 0:
            # stale leftovers of a crashed run (never look like a checkpoint: they end in .tmp / .work)
            rmtree(run.tmp_dir)
            rmtree(run.work_dir)
            write_jsonl(run.work_dir / "pairs_kept.jsonl",
                        ({k: p[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for p in kept))
        import datasets

        train_ds = datasets.load_dataset("json", data_files=str(run.work_dir / "pairs_kept.jsonl"), split="train",
                                         cache_dir=str(run.work_dir / "hf_datasets"))
    return DPOData(tokenizer=tokenizer, kept=kept, train_ds=train_ds, pairs_in=read_info["in"], dropped=dropped,
                   examples=examples, len_info=len_info, special=special)


def load_models(run: DPORun):
    """Step 3: the policy and, when it differs from the policy or reference log-probs are not
    precomputed (and no LoRA adapter stands in for it), the reference.

    Returns:
        ``(policy, its config as loaded (a dict, for the save), ref_model | None, reference kind:
        "policy" | "explicit")``.
    """
    attn, trust = run.cfg.attn_implementation, run.trust
    policy = load_causal_lm(run.policy_path, run.pol_dtype, attn, trust)
    orig_config = policy.config.to_dict()
    ref_model, reference_kind = None, "policy"
    if run.ref_path is not None:
        ref_model, reference_kind = load_causal_lm(run.ref_path, run.ref_dtype, attn, trust), "explicit"
    elif not run.args.precompute_ref_log_probs and run.lora_config is None:
        # no precompute: TRL needs a frozen copy; load it here, explicitly, in the same dtype
        ref_model = load_causal_lm(run.policy_path, run.pol_dtype, attn, trust)
    return policy, orig_config, ref_model, reference_kind


def build_trainer(run: DPORun, policy, ref_model, train_ds, tokenizer):
    """Step 4's trainer: the stage's ``DPOTrainer`` (:func:`_timed_trainer_class`, in the
    :func:`log_probs_layout` of ``cfg.log_probs``) on ``train_ds``'s token ids. TRL precomputes the
    reference log-probs here when ``training.precompute_ref_log_probs`` is on."""
    return _timed_trainer_class(log_probs_layout(run.cfg.log_probs, run.on_gpu))(
        model=policy, ref_model=ref_model, args=run.args, train_dataset=train_ds, processing_class=tokenizer,
        peft_config=run.lora_config)


def setup(run: DPORun, data: DPOData):
    """Steps 3-4 up to training: the models (:func:`load_models`) and the trainer
    (:func:`build_trainer`), checked to train on the stage's own ids; a precomputed reference is
    freed.

    Returns:
        ``(trainer, the policy's config as loaded, reference kind, seconds {model_loading, trainer_init})``.
    Raises:
        RuntimeError: TRL kept other pairs or other token ids than the stage gave it.
    """
    t0 = time.perf_counter()
    policy, orig_config, ref_model, reference_kind = load_models(run)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer = build_trainer(run, policy, ref_model, data.train_ds, data.tokenizer)
    init_s = time.perf_counter() - t0
    kept = data.kept
    if len(trainer.train_dataset) != len(kept):  # TRL dropped something we did not count
        raise RuntimeError(f"TRL kept {len(trainer.train_dataset)} of {len(kept)} pairs; the stage's length "
                           "check disagrees with the trainer's (a TRL version change?).")
    for col in ("prompt_ids", "chosen_ids", "rejected_ids"):  # TRL trains on the stage's ids, not its own
        if [list(x) for x in trainer.train_dataset[col]] != [p[col] for p in kept]:
            raise RuntimeError(f"the trainer's {col} differ from the stage's tokenization; TRL tokenized the pairs "
                               "itself (a TRL version change? see _timed_trainer_class).")
    if run.args.precompute_ref_log_probs and trainer.ref_model is not None:
        trainer.ref_model = None  # its log-probs are in the dataset now; free the memory
        ref_model = None
        gc.collect()
    return trainer, orig_config, reference_kind, {"model_loading": load_s, "trainer_init": init_s}


def train(trainer):
    """Step 4: ``trainer.train()``; returns ``(its output, seconds)``."""
    t0 = time.perf_counter()
    train_out = trainer.train()
    return train_out, time.perf_counter() - t0


def save(run: DPORun, trainer, orig_config: dict) -> float:
    """Step 5: the checkpoint into ``<output_dir>.tmp`` (:func:`save_checkpoint`), renamed to
    ``output_dir``; the work folder removed. A crash leaves only ``*.tmp`` / ``*.work``. Returns
    the seconds it took."""
    t0 = time.perf_counter()
    is_main = trainer.accelerator.is_main_process
    try:
        save_checkpoint(trainer, run.tmp_dir, run.policy_path, orig_config, run.lora_config is not None, run.trust)
        if is_main:
            publish(run.tmp_dir, run.out_dir)
            rmtree(run.work_dir)
    except BaseException:
        if is_main:
            rmtree(run.tmp_dir)
        raise
    trainer.accelerator.wait_for_everyone()
    return time.perf_counter() - t0


def write_stats(run: DPORun, data: DPOData, trainer, train_out, reference_kind: str, seconds: dict) -> DPOStats:
    """The stage's stats (written to ``<output_dir>.stats.json`` by rank 0, with the summary line)."""
    cfg, args, on_gpu, kept, special = run.cfg, run.args, run.on_gpu, data.kept, data.special
    stats = DPOStats(
        stage="dpo",
        policy=run.policy_path,
        reference={"source": reference_kind, "path": run.ref_path or run.policy_path,
                   "precomputed_log_probs": bool(args.precompute_ref_log_probs),
                   "lora_adapter_disabled": run.lora_config is not None and run.ref_path is None},
        pairs_file=str(cfg.pairs),
        pairs_in=data.pairs_in,
        pairs_used=len(kept),
        pairs_dropped=dict(data.dropped),
        dropped_examples=data.examples,
        truncation=data.len_info["truncation"],
        special_token_text=special,
        loss_type=list(args.loss_type),
        beta=args.beta,
        learning_rate=args.learning_rate,
        dtype={"policy_stored": run.pol_stored, "reference_stored": run.ref_stored, "loaded": run.pol_dtype,
               "bf16": bool(args.bf16), "fp16": bool(args.fp16)},
        lora=cfg.lora,
        hardware=describe("cuda" if on_gpu else "cpu",
                          run.pol_dtype + (" + bf16 autocast" if args.bf16 else " + fp16 autocast" if args.fp16 else ""),
                          processes=trainer.accelerator.num_processes),
        num_processes=trainer.accelerator.num_processes,
        deepspeed_zero_stage=args.deepspeed_plugin.zero_stage if args.deepspeed_plugin else None,
        steps=trainer.state.global_step,
        sequence_tokens=data.len_info["sequence_tokens"],
        log_probs={"layout": trainer.completion_layout(), "trl_because": trainer.completion_logps_refused},
        epochs=round(float(trainer.state.epoch or 0.0), 4),
        train_loss_mean=train_out.training_loss,
        **summarize_log_history(trainer.state.log_history),
        output_dir=str(run.out_dir),
        seconds={"total": time.perf_counter() - run.t_start, "model_loading": seconds["model_loading"],
                 "trainer_init": seconds["trainer_init"], "reference_precompute": trainer.precompute_seconds,
                 "train_steps": seconds["train_steps"], "save": seconds["save"]},
    )
    if trainer.accelerator.is_main_process:
        stats_file = stats_path(run.out_dir)
        stats.write(stats_file)
        plain_sigmoid = list(args.loss_type) == ["sigmoid"] and not getattr(args, "loss_weights", None)
        loss = (f"loss {stats.train_loss_first}" + (" (one step: log(2) = 0.6931 is the loss before any update)"
                                                    if plain_sigmoid else "")
                if stats.steps == 1 else f"loss {stats.train_loss_first} -> {stats.train_loss_last}")
        print(f"dpo: {len(kept)}/{data.pairs_in} pairs, {stats.steps} step{'s' * (stats.steps != 1)}, {loss}, "
              f"special-token strings kept as text in {special['prompts']} prompts, {special['chosen']} chosen, "
              f"{special['rejected']} rejected; saved {run.out_dir} ({stats_file})")
    return stats


def main(cfg: DPOStageConfig) -> DPOStats:
    """Run the DPO stage (the module docstring's order: :func:`construct`, :func:`setup_data`,
    :func:`setup`, :func:`train`, :func:`save`, :func:`write_stats`); return its stats (also
    written to ``<output_dir>.stats.json`` by rank 0). With ``cfg.dry_run``: :func:`dry_run`
    instead, returning :class:`~online_rlhf.stats.DryRunStats` (``<output_dir>.dry_run.json``).

    Raises:
        ConfigError: a bad DPO/LoRA setting, dtype mix, or a tokenizer without a chat template.
        DataError: the pairs file is empty or none of its pairs can be trained on.
    """
    if cfg.dry_run:  # memory check: no pairs read, output_dir untouched, no stats (DryRunStats instead)
        return dry_run(cfg)
    run = construct(cfg)
    data = setup_data(run)
    trainer, orig_config, reference_kind, seconds = setup(run, data)
    train_out, seconds["train_steps"] = train(trainer)
    seconds["save"] = save(run, trainer, orig_config)
    return write_stats(run, data, trainer, train_out, reference_kind, seconds)


# ------------------------------------------------------------------------------ the dry run

DRY_RUN_ARGS = {"max_steps": 1, "report_to": "none", "save_strategy": "no", "logging_steps": 1}


def dry_run_work_dir(output_dir: str | os.PathLike) -> Path:
    """The DPO trainer's working folder in a dry run: ``<output_dir>.dry_run.work`` (removed at the end)."""
    return Path(f"{Path(output_dir).resolve()}.dry_run.work")


def _dummy_pairs_dataset(args, tokenizer, n: int, length: int, prompt_len: int):
    """``n`` dummy pairs of token ids (:func:`online_rlhf.dry_run.dummy_ids`): a ``prompt_len``-token
    prompt, chosen and rejected each filling ``length`` with it, as a file-backed dataset in the
    dry run's work folder (``args.output_dir``), written by each machine's rank 0."""
    import datasets

    work = Path(args.output_dir)
    ids = dummy_ids(tokenizer, 3 * n, length - prompt_len, seed=1)
    rows = [{"prompt_ids": ids[3 * j][:prompt_len], "chosen_ids": ids[3 * j + 1], "rejected_ids": ids[3 * j + 2]}
            for j in range(n)]
    with args.main_process_first(local=True, desc="DPO dry-run pairs"):
        if args.local_process_index == 0:
            rmtree(work)
            write_jsonl(work / "pairs_dummy.jsonl", rows)
        return datasets.load_dataset("json", data_files=str(work / "pairs_dummy.jsonl"), split="train",
                                     cache_dir=str(work / "hf_datasets"))


def _step_timer(times: list[float], on_gpu: bool):
    """A ``TrainerCallback`` that appends the seconds of each optimizer step to ``times`` (CUDA
    synchronized at both ends on a GPU)."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    return StepTimer()


def dry_run(cfg: DPOStageConfig) -> Optional[DryRunStats]:
    """The DPO stage's dry run (``dry_run=true``): :func:`construct` (with :data:`DRY_RUN_ARGS` over
    the stage's ``DPOConfig``), then TRL's own path: the stage's ``DPOTrainer`` (:func:`load_models`,
    :func:`build_trainer`: same model loading, dtype, precision, LoRA, DeepSpeed profile, reference
    log-prob precompute) trains ``max_steps=1`` on ``per_device_train_batch_size x
    gradient_accumulation_steps x processes`` dummy pairs whose prompt + response fills
    ``training.max_length`` for chosen and rejected alike: one optimizer step (forward + backward of
    every micro-batch, then the optimizer step). The trainer works in :func:`dry_run_work_dir`,
    removed at the end. No pairs are read; only :class:`~online_rlhf.stats.DryRunStats` is written,
    beside ``output_dir`` (``online_rlhf.dry_run.finish``).

    Returns:
        the result on rank 0 (None on the other ranks).
    Raises:
        ConfigError: as :func:`construct`; ``training.max_length`` is null (no largest shape to
            try), or the tokenizer has no chat template.
        SystemExit(1): the step ran out of (GPU) memory, after the result was written.
    """
    run = construct(cfg, for_dry_run=True)
    args, on_gpu = run.args, run.on_gpu
    if args.max_length is None:
        raise ConfigError("dry_run needs training.max_length (the sequence length to try); it is null.")
    L = int(args.max_length)
    B, ga, world = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps), _world_size()
    prompt_len = max(1, L // 2)
    times: list[float] = []
    status, error = "ok", None
    with PeakMemory("cuda" if on_gpu else "cpu") as mem:
        try:
            tokenizer = load_tokenizer(run)
            train_ds = _dummy_pairs_dataset(args, tokenizer, B * ga * world, L, prompt_len)
            policy, _, ref_model, _ = load_models(run)
            trainer = build_trainer(run, policy, ref_model, train_ds, tokenizer)
            trainer.add_callback(_step_timer(times, on_gpu))
            if args.precompute_ref_log_probs and trainer.ref_model is not None:
                trainer.ref_model = None  # as the stage does: freed before training
                ref_model = None
            trainer.train()
        except out_of_memory_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {"train_batch_size": cfg.train_batch_size, "training.per_device_train_batch_size": B,
                "training.gradient_accumulation_steps": ga, "training.max_length": L,
                "training.gradient_checkpointing": bool(args.gradient_checkpointing),
                "training.precompute_ref_log_probs": bool(args.precompute_ref_log_probs), "lora": cfg.lora,
                "torch_dtype": run.pol_dtype, "bf16": bool(args.bf16), "fp16": bool(args.fp16),
                "launch_profile": cfg.launch_profile, "num_processes": world}
    step = (f"1 optimizer step: {ga} micro-batch(es) x {B} pairs x (chosen + rejected) x {L} tokens per process, "
            f"forward + backward + {getattr(args.optim, 'value', args.optim)} step" + (", reference log-probs precomputed first"
                                                          if args.precompute_ref_log_probs else ", reference in the step"))
    shapes = {"pairs_per_process": B * ga, "micro_batch_pairs": B, "sequences_per_forward": 2 * B,
              "sequence_tokens": L, "prompt_tokens": prompt_len, "response_tokens": L - prompt_len}
    result = finish("dpo", mem, cfg.output_dir, status=status, error=error, step_s=times[-1] if times else None,
                    step=step, shapes=shapes, settings=settings, t_start=run.t_start)
    if is_main_rank():
        rmtree(Path(args.output_dir))
    exit_if_out_of_memory("dpo", status, error)
    return result


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(main, DPOStageConfig)


if __name__ == "__main__":
    cli()
