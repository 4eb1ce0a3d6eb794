"""The DPO stage's ``trl.DPOConfig``, in one place for the plan and the stage: the keys the stage
owns, the checks of ``training`` against ``DPOConfig`` (:func:`check_dpo_training`), the stage's
defaults under ``training`` (:func:`training_defaults`), the per-device batch from
``train_batch_size`` (:func:`per_device_batch`), and the build (:func:`build_dpo_args`), which the
stage runs before it loads a weight and the plan runs dry for every iteration
(:func:`check_dpo_config`), with the DPO row's other plan checks (:func:`check_dpo_keys`,
:func:`dpo_batch`, :func:`check_dpo_launch`; the row names them in ``online_rlhf.stage_checks``).

``dpo.training.beta`` from ``configs/loop.yaml`` (or the command line) reaches ``DPOConfig`` through
this module twice: dry in the plan, then in the stage (docs/architecture.md, "The life of one
value"). Where TRL is not installed the checks pass the keys unchecked (the stage itself always has
it). Importable without torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from .config import ConfigError, StageConfig, did_you_mean
from .dpo_loss import LOSSES, TRL_LOSS_TYPES, unknown_loss_types
from .hardware import compute_dtype, launch_world_size
from .stage_configs import DPOStageConfig
from .trl_args import check_lora

# ``LoopConfig`` in the annotations below is ``online_rlhf.loop_config.LoopConfig``, which is built
# from the stage table, which imports this module (through the DPO row's checks): the name stays
# text, never imported here.


# DPOConfig fields the stage sets itself; a user value for them is refused with the fix.
STAGE_OWNED = {
    "output_dir": "the stage sets it from its own output_dir (training runs in <output_dir>.work, saves via "
                  "<output_dir>.tmp); in the loop that is the run layout's iter_<i>/model, so leave it out",
    "model_init_kwargs": "the stage loads the models itself; set the stage's torch_dtype / attn_implementation "
                         "instead (in the loop: dpo.torch_dtype / dpo.attn_implementation)",
}


def _dpo_fields() -> dict | None:
    try:  # bitsandbytes' import-time notice on CPU is filtered in online_rlhf/__init__.py
        from trl import DPOConfig
    except ImportError:
        return None
    return {f.name: f for f in dataclasses.fields(DPOConfig) if f.init}


def check_dpo_training(training: dict, where: str = "training") -> dict:
    """Check ``training`` keys and number values against ``trl.DPOConfig``; return a checked copy.

    YAML 1.1 reads ``1e-3`` (no dot) as a string: for a float field such a string becomes the float
    it spells (also inside a list, e.g. ``loss_weights``), so ``training.learning_rate=1e-3`` means
    what it says. Where TRL is not installed (the loop's plan in another env) the keys are returned
    unchecked; the DPO stage itself always has TRL.

    Args:
        training: ``{DPOConfig field: value}`` from the stage config.
        where: prefix naming the section in error messages, e.g. ``"loop.yaml, iteration 2: dpo.training"``.
    Raises:
        ConfigError: a key that is not a DPOConfig field (with the closest field name), a key the
            stage sets itself, a ``loss_type`` name neither TRL nor :mod:`online_rlhf.dpo_loss`
            computes, or a value of the wrong type: text that is not a number for a float
            field, a non-integer for an int field, a non-boolean for a bool field (``None`` is
            accepted where the field is optional); or a value that cannot train: learning_rate,
            beta or num_train_epochs <= 0 (epochs may be 0 when max_steps > 0), a batch size or
            gradient_accumulation_steps < 1.
    """
    out, problems = dpo_training_problems(training, where)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{where}: {len(problems)} problems:\n  - " + "\n  - ".join(problems))
    return out


def dpo_training_problems(training: dict, where: str = "training") -> tuple[dict, list[str]]:
    """Every problem :func:`check_dpo_training` raises for, as a list (empty: fine), and the checked
    copy of ``training`` (the keys that passed).

    Returns:
        ``(checked, problems)``: each problem one ``<where>.<key>: what is wrong, and the fix`` line.
    """
    fields = _dpo_fields()
    if fields is None:
        return dict(training), []
    out, problems = {}, []
    for key, value in training.items():
        if key in STAGE_OWNED:
            problems.append(f"{where}.{key}: {STAGE_OWNED[key]}.")
        elif key not in fields:
            problems.append(f"{where}.{key}: unknown trl.DPOConfig key {key!r}.{did_you_mean(key, fields)} "
                            "See the fields with: .venv-train/bin/python -c 'import trl; help(trl.DPOConfig)'.")
        else:
            try:
                out[key] = _checked_value(f"{where}.{key}", str(fields[key].type), value)
            except ConfigError as e:
                problems.append(str(e))
    unknown = unknown_loss_types(out.get("loss_type", []))
    if unknown:
        problems.append(f"{where}.loss_type: {', '.join(map(repr, unknown))} is neither a loss TRL computes "
                        f"({', '.join(TRL_LOSS_TYPES)}) nor one of online_rlhf/dpo_loss.py ({', '.join(LOSSES)}). "
                        "Fix the name, or add the loss there: one function with @register(name) "
                        "(docs/dpo.md, \"Change the loss\").")
    for key, (low, strict) in _LOWER_BOUNDS.items():
        v = out.get(key)
        if isinstance(v, (int, float)) and (v <= low if strict else v < low):
            if key == "num_train_epochs" and isinstance(out.get("max_steps"), int) and out["max_steps"] > 0:
                continue  # max_steps decides the length then
            problems.append(f"{where}.{key}: must be {'>' if strict else '>='} {low}, got {v!r}.")
    return out, problems


# Values that can only be mistakes: no training, no reference anchor, or nothing per step.
_LOWER_BOUNDS = {"learning_rate": (0, True), "beta": (0, True), "num_train_epochs": (0, True),
                 "per_device_train_batch_size": (1, False), "gradient_accumulation_steps": (1, False)}


def _checked_value(where: str, ftype: str, value):
    """``value`` checked against a DPOConfig field type written as text (``"<class 'int'>"``,
    ``"int | None"``, ``"list[float] | None"``...); numbers spelled as text become floats."""
    if value is None and "None" in ftype:
        return value
    if ftype.startswith("list[") or ftype.startswith("typing.List"):
        if "float" in ftype and isinstance(value, list):
            try:
                return [float(v) if isinstance(v, str) else v for v in value]
            except ValueError:
                raise ConfigError(f"{where}: expected a list of numbers, got {value!r}.") from None
        return value
    if any(t in ftype for t in ("str", "dict", "Any")):  # unions with text or mappings: TRL checks them
        return value
    if "float" in ftype:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}.") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}.")
    elif "int" in ftype and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}.")
    elif "bool" in ftype and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}.")
    return value


def per_device_batch(train_batch_size: int | None, training: dict, num_processes: int, where: str = "",
                     processes_key: str | None = None) -> int | None:
    """Pairs per device and forward pass for ``train_batch_size`` pairs per optimizer step over
    ``num_processes`` processes: ``train_batch_size / (num_processes x gradient_accumulation_steps)``;
    None when ``train_batch_size`` is not set (``training.per_device_train_batch_size`` then rules).

    Args:
        where: prefix of the key names in messages (``"dpo."`` in the loop config).
        processes_key: the config key that set ``num_processes``, for messages (the loop's
            ``num_processes``); None where the launcher set it (the stage counts its ranks).
    Raises:
        ConfigError: ``training.per_device_train_batch_size`` is set too, or ``train_batch_size`` is
            not a multiple of processes x gradient accumulation steps.
    """
    if train_batch_size is None:
        return None
    if "per_device_train_batch_size" in training:
        raise ConfigError(f"{where}train_batch_size={train_batch_size} (pairs per optimizer step over all processes) and "
                          f"{where}training.per_device_train_batch_size={training['per_device_train_batch_size']} are "
                          f"both set; keep one ({where}train_batch_size=null to size batches per device).")
    accum = int(training.get("gradient_accumulation_steps", 1))
    per, rest = divmod(train_batch_size, num_processes * accum)
    if rest:
        procs = f"{processes_key}={num_processes}" if processes_key else f"{num_processes} process(es)"
        raise ConfigError(f"{where}train_batch_size={train_batch_size} is not a multiple of {procs} x "
                          f"{where}training.gradient_accumulation_steps={accum}; change one of them.")
    return per


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


def batch_args(cfg: DPOStageConfig, world_size: int) -> dict:
    """``{"per_device_train_batch_size": n}`` from ``cfg.train_batch_size`` over ``world_size``
    processes (:func:`per_device_batch`, which raises ConfigError on a
    conflicting or indivisible setting); ``{}`` when it is not set."""
    per = per_device_batch(cfg.train_batch_size, cfg.training, world_size)
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
    kw = {**training_defaults(on_gpu, launch_world_size()), **batch_args(cfg, world),
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


def check_dpo_config(d: dict, i: int, prov: list[tuple[str, Any, str]]) -> None:
    """Build iteration ``i``'s ``trl.DPOConfig`` from its resolved DPO stage config ``d`` as the
    stage will (:func:`build_dpo_args`, with the planned process count; nothing is written), so
    that values TRL refuses together (e.g. ``loss_type: sigmoid`` with the recipe's
    ``loss_weights: [1, 1]``) stop the plan instead of the DPO stage after generation, rewards and
    pairs. Skipped where TRL is not installed (the stage itself always has it).

    Raises:
        ConfigError: TRL's message, the iteration, and each ``dpo`` key it names with its value and
            where it was set (the stage YAML's provenance).
    """
    try:
        import torch
    except ImportError:
        return
    cfg = DPOStageConfig.model_validate(d)
    try:
        build_dpo_args(cfg, Path(f"{d['output_dir']}.work"), torch.cuda.is_available(),
                       world_size=d.get("num_processes") or 1)
    except ConfigError as e:
        msg = str(e).removeprefix("training: ")
        named = [(k, v, o) for k, v, o in prov if k.startswith("training.")
                 and re.search(rf"(?<![\w.]){re.escape(k.split('.', 1)[1])}(?!\w)", msg)]
        keys = "; ".join(f"dpo.{k}={json.dumps(v, default=str)} ({o})" for k, v, o in named)
        raise ConfigError(f"iteration {i}, stage dpo: {msg}" + (f" The keys: {keys}." if keys else "")
                          + " Change them so that trl.DPOConfig accepts them (nothing has run yet).") from None


def check_dpo_keys(cfg: LoopConfig, i: int, d: dict, dpo: StageConfig, where: str) -> None:
    """The merged ``dpo`` section, the keys of the ``dpo_config`` file included: ``training``
    against ``trl.DPOConfig``, ``lora`` against ``peft.LoraConfig``.

    Raises:
        ConfigError: an unknown or invalid key, named under ``dpo.training`` / ``dpo.lora``.
    """
    check_dpo_training(d["training"], f"{where}: dpo.training")
    check_lora(d.get("lora"), f"{where}: dpo.lora", required=False)


def dpo_batch(d: dict) -> tuple[int | None, int]:
    """(train_batch_size, gradient_accumulation_steps) of a resolved DPO stage dict."""
    return d.get("train_batch_size"), int(d.get("training", {}).get("gradient_accumulation_steps", 1))


def check_dpo_launch(cfg: LoopConfig, i: int, d: dict, src: str) -> None:
    """Iteration ``i``'s DPO batch split over the resolved ``num_processes``; with ``dry_run=true``,
    iteration 1's ``training.max_length`` (the dry run's dummy pairs are that long).

    Raises:
        ConfigError: a batch the process count does not split (naming the iteration), or a dry run
            without ``dpo.training.max_length``.
    """
    try:
        per_device_batch(d.get("train_batch_size"), d.get("training", {}), cfg.num_processes, where="dpo.",
                         processes_key="num_processes")
    except ConfigError as e:
        raise ConfigError(f"{src}, iteration {i}: {e}") from None
    if cfg.dry_run and i == 1 and d.get("training", {}).get("max_length") is None:
        raise ConfigError(f"{src}: dry_run=true needs dpo.training.max_length (the dummy pairs are that long); "
                          "set it, e.g. dpo.training.max_length=1024.")
