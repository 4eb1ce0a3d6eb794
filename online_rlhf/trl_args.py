"""Checks of the config sections handed to libraries: the DPO stage's ``training`` against
``trl.DPOConfig``, its ``lora`` against ``peft.LoraConfig``, the SFT stage's Axolotl keys against
Axolotl's schema.

Used by the stages (``dpo_iteration/run_dpo.py``, ``sft/run_sft.py``) before they load a model, and
by the loop's plan (``online_rlhf/loop/resolve.py``) before any stage runs, so a typo in ``dpo.training``,
``dpo.lora`` or ``sft`` fails at start-up instead of after an iteration of generation. Where the
library is not installed the keys pass unchecked (the stage itself always has it).
:func:`per_device_batch` splits the DPO stage's ``train_batch_size`` over the processes, for the
stage and for the loop's plan alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

from .config import ConfigError, did_you_mean
from .dpo_loss import LOSSES, TRL_LOSS_TYPES, unknown_loss_types

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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# LoraConfig fields whose values peft accepts unchecked and only fail (or silently misbehave) once the
# adapter is built: key -> (test, what is expected, an example fix).
_LORA_VALUE_CHECKS = {
    "r": (lambda v: _is_int(v) and v > 0, "a positive integer (the adapter rank)", "r=16"),
    "lora_alpha": (lambda v: _is_number(v) and v > 0, "a positive number (the scaling numerator)", "lora_alpha=32"),
    "lora_dropout": (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)", "lora_dropout=0.05"),
    "bias": (lambda v: v in ("none", "all", "lora_only"), "one of none, all, lora_only", "bias=none"),
    "target_modules": (lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(
        isinstance(m, str) for m in v)), "a module name, a list of names, 'all-linear' or null",
        "target_modules=[q_proj, v_proj]"),
    **{k: (lambda v: isinstance(v, bool), "true or false", f"{k}=false")
       for k in ("use_rslora", "use_dora", "fan_in_fan_out", "inference_mode")},
}


def _check_lora_values(lora: dict, where: str) -> None:
    """Raise ConfigError for a value of :data:`_LORA_VALUE_CHECKS` of the wrong type or range (peft's
    LoraConfig takes e.g. ``r='abc'`` or ``r=-4`` and fails only when the model is wrapped)."""
    for key, (ok, expected, example) in _LORA_VALUE_CHECKS.items():
        if key in lora and not ok(lora[key]):
            raise ConfigError(f"{where}.{key}={lora[key]!r}: expected {expected}; set e.g. {where.rsplit(': ', 1)[-1]}."
                              f"{example}.")


def check_lora(lora: dict | None, where: str = "lora", required: bool = True):
    """``peft.LoraConfig`` built from ``lora`` (``task_type`` CAUSAL_LM unless given), or None for None.

    Args:
        where: the section's path in error messages, e.g. ``"per_iteration.2.dpo.lora"``.
        required: peft must be installed (the DPO stage); else (the loop's plan) without peft
            nothing is checked and None is returned.
    Returns:
        the LoraConfig; None when ``lora`` is None (or peft is missing and not required).
    Raises:
        ConfigError: a key that is not a LoraConfig field (with the closest one), a value of the
            wrong type or range (``r`` must be a positive int; checked even without peft), values
            peft refuses, or peft missing when required.
    """
    if lora is None:
        return None
    if isinstance(lora, dict):
        _check_lora_values(lora, where)
    try:
        from peft import LoraConfig
    except ImportError:
        if required:
            raise ConfigError(f"{where}: LoRA needs the peft package (pip install peft), or set lora: null.") from None
        return None
    if not isinstance(lora, dict):
        raise ConfigError(f"{where}: expected a mapping of peft.LoraConfig fields or null, got {lora!r:.80}.")
    known = sorted(f.name for f in dataclasses.fields(LoraConfig) if f.init)
    for key in lora:
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown peft.LoraConfig key {key!r}.{did_you_mean(key, known)} "
                              "See the fields with: python -c 'import peft; help(peft.LoraConfig)'.")
    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **lora})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}={lora!r:.160}: peft.LoraConfig refused the values: {e}. Change or drop the key "
                          "it names (fields: python -c 'import peft; help(peft.LoraConfig)').") from None


def check_axolotl_keys(keys: dict, prefix: str = "", also_known: set[str] = frozenset(), section: str = "") -> None:
    """Raise ConfigError for keys Axolotl does not know (it would ignore them silently).

    Skipped when the config loads plugins of its own (plugins add keys to Axolotl's schema) or when
    Axolotl is not installed.

    Args:
        keys: the Axolotl part of an SFT config.
        prefix: put before each key in the message, e.g. ``"sft."`` (the loop section).
        also_known: keys that are not Axolotl's but are allowed (the stage's own).
        section: where the keys were read, when that is not a plain Axolotl config, e.g. ``"the loop's
            sft section (enabled, config and Axolotl config keys)"``; the message then names it.
    Raises:
        ConfigError: naming every unknown key with the closest known one.
    """
    if keys.get("plugins"):
        return
    import os

    os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # importing Axolotl must not start its telemetry
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from axolotl.utils.schemas.config import AxolotlInputConfig
    except ImportError:
        return
    known = set(AxolotlInputConfig.model_fields) | set(also_known)
    known |= {f.alias for f in AxolotlInputConfig.model_fields.values() if f.alias}
    bad = [k for k in keys if k not in known]
    if bad:
        hints = []
        for k in bad:
            hint = did_you_mean(k, known).strip()
            hints.append(f"'{prefix}{k}'" + (f" ({hint})" if hint else ""))
        what = f"unknown key(s) in {section}" if section else "unknown Axolotl config key(s)"
        raise ConfigError(f"{what}: {', '.join(hints)}. Axolotl would ignore them; "
                          "see https://docs.axolotl.ai/docs/config-reference.html")
