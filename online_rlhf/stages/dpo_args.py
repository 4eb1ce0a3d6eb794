"""The DPO stage's TRL and PEFT configs and load dtypes, from its config (``DPOStageConfig``):
the stage's defaults under ``training``, the per-device batch, ``trl.DPOConfig`` (also built dry by the
loop's plan), ``peft.LoraConfig``, and the dtypes policy and reference load in. No weights are loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from online_rlhf.config import ConfigError
from online_rlhf.hardware import compute_dtype, launch_world_size
from online_rlhf.stage_configs import DPOStageConfig
from online_rlhf.trl_args import check_dpo_training, check_lora
from online_rlhf.trl_args import per_device_batch as split_batch


_HALF = {"float16", "bfloat16"}


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

    world = launch_world_size() if world_size is None else world_size
    kw = {**training_defaults(on_gpu, launch_world_size()), **per_device_batch(cfg, world),
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
