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
  5. save into ``<output_dir>.tmp`` (LoRA adapters merged first, or the adapter alone with
     ``save_adapter``), rename to ``output_dir``.

Dry run (``dry_run=true``, :func:`dry_run`): step 1, then steps 3-4 for one optimizer step on dummy
pairs of ``training.max_length`` tokens; it writes only ``<output_dir>.dry_run.json``.

The reference model: ``reference=None`` (or the policy's own path) means "the policy as it is
before this stage", i.e. the loop's ``ref_model: previous``; ``reference=<dir>`` (the loop's
``ref_model: initial``) loads that checkpoint as ``ref_model``. The stats record which one.

LoRA through the loop (``lora`` with ``adapter`` / ``save_adapter``; docs/dpo.md): the policy is
``policy`` (the base, unchanged) plus the adapter folder ``adapter`` (none at the first iteration),
and only the adapter trains. The reference is never a second model: ``reference`` equal to the base
(the loop's ``ref_model: initial``) is the base with the adapter switched off; ``reference: null``
(``previous``) is a frozen copy of the adapter as the stage got it (TRL's ``ref`` adapter), whose
log-probs are precomputed like any reference's. ``reference.lora_reference`` in the stats says which.

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
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from online_rlhf.adapters import (continued_lora_config, is_adapter, load_adapter_weights, load_with_adapter,
                                  save_adapter, split_model)
from online_rlhf.checkpoint import finish_checkpoint, folder_mb, publish, rmtree
from online_rlhf.config import ConfigError, run_main
from online_rlhf.dry_run import dummy_ids, exit_if_out_of_memory, finish, is_main_rank, out_of_memory_errors
from online_rlhf.hardware import check_process_count, describe, launch_world_size, processes_here, stage_threads
from online_rlhf.jsonl import DataError, write_jsonl
from online_rlhf.memory import PeakMemory
from online_rlhf.paths import resolve_model, setup_cache_env
from online_rlhf.stage_configs import DPOStageConfig
from online_rlhf.stats import DPOStats, DryRunStats, PairsStats, stats_path
from online_rlhf.dpo_config import build_dpo_args
from online_rlhf.stages.dpo_data import check_lengths, load_pairs, special_text_counts, tokenize_pairs
from online_rlhf.stages.dpo_trainer import (build_lora_config, load_causal_lm, log_probs_layout, resolve_load_dtypes,
                                            save_checkpoint, stored_dtype, summarize_log_history,
                                            timed_trainer_class)


@dataclass
class DPORun:
    """The stage as :func:`construct` checked it, before any weight is loaded: what the later steps read.

    Attributes:
        t_start: ``time.perf_counter()`` at the start.  on_gpu: CUDA is available.
        out_dir, tmp_dir, work_dir: ``output_dir`` (resolved), ``<output_dir>.tmp`` (the checkpoint
            while it is written), ``<output_dir>.work`` (the pairs dataset).
        args: the ``trl.DPOConfig``; lora_config: the ``peft.LoraConfig`` or None (a continued
            adapter's own config: :func:`online_rlhf.adapters.continued_lora_config`).
        policy_path, ref_path: resolved checkpoints (``ref_path`` None: the policy is the reference).
        adapter: the LoRA adapter folder the policy starts from (on ``policy_path``, its base), or None.
        lora_reference: with LoRA and no reference model, what stands in for it: ``adapter_off``
            (the base with the adapter switched off: a reference equal to the base, or a fresh
            adapter) or ``previous_adapter`` (a frozen copy of ``adapter``: TRL's ``ref`` adapter).
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
    adapter: Optional[str]
    lora_reference: Optional[str]
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
        torch.set_num_threads(stage_threads(processes_here(launch_world_size())))
    out_dir = Path(cfg.output_dir).resolve()
    tmp_dir, work_dir = Path(f"{out_dir}.tmp"), Path(f"{out_dir}.work")
    if for_dry_run:  # one optimizer step on dummy pairs in <output_dir>.dry_run.work
        args = build_dpo_args(cfg, dry_run_work_dir(out_dir), on_gpu, overrides=DRY_RUN_ARGS)
    else:
        args = build_dpo_args(cfg, work_dir, on_gpu)
    lora_config = build_lora_config(cfg.lora)
    log_probs_layout(cfg.log_probs, on_gpu, cfg.attn_implementation)  # a layout the attention allows
    trust = args.trust_remote_code
    policy_path, adapter = split_model(cfg.policy, cfg.adapter)
    if adapter is not None:
        lora_config = continued_lora_config(adapter, cfg.lora)
    ref_path = resolve_model(cfg.reference) if cfg.reference is not None else None
    if ref_path is not None and is_adapter(ref_path):
        raise ConfigError(f"reference={cfg.reference} is a LoRA adapter folder; the DPO reference is a full checkpoint, "
                          "the policy's base with its adapter switched off (reference=<the base>), or the policy as it "
                          "starts (reference=null). Merge the adapter first (scripts/merge_lora.py) to use it as "
                          "a reference model.")
    same_as_policy = ref_path is not None and Path(ref_path).exists() and Path(policy_path).exists() and \
        Path(ref_path).resolve() == Path(policy_path).resolve()
    if same_as_policy:
        ref_path = None  # the same checkpoint: treat as "reference = policy" (with an adapter: its base)
    lora_reference = None
    if lora_config is not None and ref_path is None:
        # a reference equal to the adapter's base, or a fresh adapter (zero update): the adapter switched
        # off; no reference given while an adapter is continued: the adapter as it was (TRL's "ref" copy)
        lora_reference = "previous_adapter" if adapter is not None and not same_as_policy else "adapter_off"
    pol_stored = stored_dtype(policy_path, trust)
    ref_stored = stored_dtype(ref_path, trust) if ref_path else pol_stored
    pol_dtype, ref_dtype = resolve_load_dtypes(cfg.torch_dtype, pol_stored, ref_stored, on_gpu, args.fp16, args.bf16)
    if lora_config is not None and args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3:
        raise ConfigError("lora with DeepSpeed ZeRO-3 is not supported by this stage (the merge needs the full "
                          "weights on one rank); use the zero2 profile for LoRA.")
    return DPORun(cfg=cfg, t_start=t_start, on_gpu=on_gpu, out_dir=out_dir, tmp_dir=tmp_dir, work_dir=work_dir,
                  args=args, lora_config=lora_config, policy_path=policy_path, ref_path=ref_path, adapter=adapter,
                  lora_reference=lora_reference, pol_stored=pol_stored, ref_stored=ref_stored, pol_dtype=pol_dtype,
                  ref_dtype=ref_dtype)


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
    if run.lora_reference == "previous_adapter":  # TRL copies it into a frozen "ref" adapter: the reference
        policy = load_with_adapter(policy, run.adapter, trainable=True)
    ref_model, reference_kind = None, "policy"
    if run.ref_path is not None:
        ref_model, reference_kind = load_causal_lm(run.ref_path, run.ref_dtype, attn, trust), "explicit"
    elif not run.args.precompute_ref_log_probs and run.lora_config is None:
        # no precompute: TRL needs a frozen copy; load it here, explicitly, in the same dtype
        ref_model = load_causal_lm(run.policy_path, run.pol_dtype, attn, trust)
    return policy, orig_config, ref_model, reference_kind


def build_trainer(run: DPORun, policy, ref_model, train_ds, tokenizer):
    """Step 4's trainer: the stage's ``DPOTrainer`` (:func:`timed_trainer_class`, in the
    :func:`log_probs_layout` of ``cfg.log_probs``) on ``train_ds``'s token ids. TRL precomputes the
    reference log-probs here when ``training.precompute_ref_log_probs`` is on.

    A continued LoRA adapter whose reference is the base (``lora_reference`` ``adapter_off``): TRL
    wraps the base in a fresh adapter of the same config (its reference is then the adapter switched
    off, and no ``ref`` copy is made), and the adapter's weights are loaded into it after TRL's init,
    i.e. after the reference log-probs were precomputed without it."""
    from accelerate.utils import is_peft_model

    trainer = timed_trainer_class(log_probs_layout(run.cfg.log_probs, run.on_gpu, run.cfg.attn_implementation))(
        model=policy, ref_model=ref_model, args=run.args, train_dataset=train_ds, processing_class=tokenizer,
        peft_config=None if is_peft_model(policy) else run.lora_config)
    if run.adapter is not None and run.lora_reference == "adapter_off":
        try:
            load_adapter_weights(trainer.model, run.adapter)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return trainer


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
                               "itself (a TRL version change? see timed_trainer_class).")
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
        if run.cfg.save_adapter:  # the adapter only, naming policy_path as its base
            if is_main:
                save_adapter(trainer.accelerator.unwrap_model(trainer.model), run.tmp_dir, run.policy_path)
                finish_checkpoint(run.tmp_dir, run.policy_path, run.trust)
            trainer.accelerator.wait_for_everyone()
        else:
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
                   "lora_adapter_disabled": run.lora_reference == "adapter_off",
                   "lora_reference": run.lora_reference},
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
        adapter=run.adapter,
        saved="adapter" if cfg.save_adapter else "checkpoint",
        saved_mb=round(folder_mb(run.out_dir), 2),
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
        dropped = "".join(f", {n} dropped ({reason})" for reason, n in sorted(stats.pairs_dropped.items()) if n)
        layout, because = stats.log_probs["layout"], stats.log_probs["trl_because"]
        if layout is None and cfg.log_probs not in ("auto", "trl"):
            print(f"warning: dpo: log_probs={cfg.log_probs} was asked for, but {because}: TRL's own log-probs ran "
                  f"(same loss, slower)", file=sys.stderr)
        log_probs_ran = f"log-probs {layout}" if layout else f"TRL's log-probs ({because})"
        print(f"dpo: {len(kept)}/{data.pairs_in} pairs{dropped}, {stats.steps} step{'s' * (stats.steps != 1)}, {loss}, "
              f"{log_probs_ran}, "
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
    B, ga, world = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps), launch_world_size()
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
