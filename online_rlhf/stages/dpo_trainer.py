"""The DPO stage's trainer and checkpoint: how the log-probs are computed (``log_probs``), the
policy/reference loader (with the dtypes they load in and the LoRA config), TRL's ``DPOTrainer`` subclass that times its phases and computes the
log-probs at completion positions only, the training log summary, and the atomic save
(LoRA merged, the input policy's config and tokens restored).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from online_rlhf.checkpoint import finish_checkpoint, restore_input_config
from online_rlhf.completion_logps import PACKED_FOR
from online_rlhf.config import ConfigError
from online_rlhf.dpo_loss import project_only_loss_types
from online_rlhf.trl_args import check_lora

_HALF = {"float16", "bfloat16"}


def log_probs_layout(log_probs: str, on_gpu: bool, attn: str = "sdpa") -> str | None:
    """The :mod:`online_rlhf.completion_logps` layout for ``cfg.log_probs``: ``auto`` is
    ``"packed"`` on CPU (all rows of a micro-batch in one unpadded sequence, one forward; measured
    fastest there, bench/bench_dpo_step.py: 0.78x the steps and 0.55x the reference pass of
    ``"sequence"`` on an AMX Xeon) and ``"side"`` on GPU (two padded products per step; works with
    any attention kernel; not measured: no GPU was lent), and ``"side"`` on CPU too when the model's
    attention ``attn`` is not one of :data:`online_rlhf.completion_logps.PACKED_FOR`; ``trl`` is None (TRL's own computation).

    Raises:
        ConfigError: ``packed`` asked for with an attention the packed layout does not stand in for.
    """
    if log_probs == "auto":
        return "side" if on_gpu or attn not in PACKED_FOR else "packed"
    if log_probs == "packed" and attn not in PACKED_FOR:
        raise ConfigError(f"log_probs=packed computes attention with sdpa per sequence, which stands in for "
                          f"{' or '.join(PACKED_FOR)} attention only; attn_implementation is {attn!r}: use "
                          f"log_probs=side or sequence (or auto, which picks side here)")
    return None if log_probs == "trl" else log_probs


# flash attention kernels transformers can be asked for, and the package each one imports
FLASH_ATTENTION_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def check_attn_implementation(attn: str, on_gpu: bool) -> None:
    """Refuse a flash-attention ``attn_implementation`` this machine cannot run, before any weight
    is loaded (transformers would raise an ImportError deep in ``from_pretrained``).

    Raises:
        ConfigError: ``attn`` is ``flash_attention_2``/``_3`` and there is no CUDA GPU, or its
            package (``flash_attn`` / ``flash_attn_interface``) is not installed in this env; the
            message names the fix (``attn_implementation=sdpa``, or installing flash-attn on a GPU
            machine: scripts/setup_envs.sh, ``FLASH_ATTN_SPEC``).
    """
    import importlib.util
    import sys

    package = FLASH_ATTENTION_PACKAGES.get(attn)
    if package is None:
        return
    fix = "set attn_implementation=sdpa (in the loop: dpo.attn_implementation / grpo.attn_implementation)"
    if not on_gpu:
        raise ConfigError(f"attn_implementation={attn} needs a CUDA GPU and this machine has none; {fix}.")
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"attn_implementation={attn} needs the {package!r} package, which is not installed in "
                          f"this env ({sys.prefix}); install flash-attn there (scripts/setup_envs.sh builds it on "
                          f"a GPU machine, FLASH_ATTN_SPEC picks the version) or {fix}.")


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
def load_causal_lm(path: str, dtype: str, attn: str, trust_remote_code: bool):
    """``AutoModelForCausalLM`` of the checkpoint at ``path`` in ``dtype`` (``"float32"``, ``"bfloat16"``,
    ...) with attention ``attn`` (``"sdpa"``, ...); the DPO and GRPO stages load policy and reference so.

    Raises:
        ConfigError: a flash-attention ``attn`` this machine cannot run (:func:`check_attn_implementation`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    check_attn_implementation(attn, torch.cuda.is_available())
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


def timed_trainer_class(layout: str | None = "sequence"):
    """The stage's ``trl.DPOTrainer`` subclass. ``layout``: how :mod:`online_rlhf.completion_logps`
    runs the rows (``"sequence"``, ``"side"``, ``"packed"``), or None for TRL's own log-prob computation."""
    from trl import DPOTrainer

    from online_rlhf.completion_logps import row_groups

    if layout is not None:
        row_groups(2, layout)  # ValueError on an unknown layout

    class TimedDPOTrainer(DPOTrainer):
        """DPOTrainer that trains on the stage's token ids and records the seconds spent precomputing
        reference log-probs (for the stats).

        Overrides TRL 1.9's ``_prepare_dataset`` and wraps its ``_precompute_ref_logps`` (private;
        pinned version). A dataset that already holds ``prompt_ids``, ``chosen_ids`` and
        ``rejected_ids`` (:func:`online_rlhf.stages.dpo_data.tokenize_pairs`) is used as it is: TRL would otherwise tokenize
        the text again with ``apply_chat_template(tokenize=True)``, which turns a special-token
        string inside a message into a special token. TRL's drop of prompts that fill
        ``max_length`` is kept (a no-op here: :func:`online_rlhf.stages.dpo_data.check_lengths` dropped them, counted).
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
            reason, kept in ``completion_logps_refused``). Decided once, at the first batch.

            Raises:
                ConfigError: a loss type only :mod:`online_rlhf.dpo_loss` computes, with a setting
                    that needs TRL's code."""
            if not self._completion_layout_resolved:
                from online_rlhf.completion_logps import fast_path_refusal

                if self.completion_logps_request is None:
                    self.completion_logps_refused = "turned off"
                else:
                    self.completion_logps_refused = fast_path_refusal(self)
                only_here = project_only_loss_types(self.loss_types)
                if self.completion_logps_refused and only_here:
                    raise ConfigError(f"training.loss_type {', '.join(only_here)} is computed only by "
                                      f"online_rlhf/dpo_loss.py in the stage's own log-prob layouts, and "
                                      f"{self.completion_logps_refused} needs TRL's own computation; drop one of them")
                self._completion_layout = None if self.completion_logps_refused else self.completion_logps_request
                self._completion_layout_resolved = True
            return self._completion_layout

        def _compute_loss(self, model, inputs, return_outputs):
            layout = self.completion_layout()
            if layout is None or return_outputs:  # return_outputs wants the full logits
                return super()._compute_loss(model, inputs, return_outputs)
            from online_rlhf.completion_logps import compute_loss

            return compute_loss(self, model, inputs, layout)

        def training_step(self, model, *args, **kwargs):
            if self.completion_layout() != "packed":
                return super().training_step(model, *args, **kwargs)
            from online_rlhf.completion_logps import packed_attention

            # the backward too: gradient checkpointing runs the layers' forward again in it, and
            # they must attend per sequence as they did in the forward
            with packed_attention(model):
                return super().training_step(model, *args, **kwargs)

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
