"""Checks of the ``training`` section of the DPO stage against ``trl.DPOConfig``.

Used by ``dpo_iteration/run_dpo.py`` before it loads a model, and by the loop's plan
(``online_rlhf/loop.py``) before any stage runs, so a typo in ``dpo.training`` fails at start-up
instead of after an iteration of generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

from .config import ConfigError, did_you_mean

# DPOConfig fields the stage sets itself; a user value for them is refused with the fix.
STAGE_OWNED = {
    "output_dir": "set the stage's output_dir instead (training runs in <output_dir>.work, saves via <output_dir>.tmp)",
    "model_init_kwargs": "the stage loads the models itself; use torch_dtype / attn_implementation",
}


def _dpo_fields() -> dict | None:
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # bitsandbytes' import-time notice on CPU
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
            stage sets itself, or a value of the wrong type: text that is not a number for a float
            field, a non-integer for an int field, a non-boolean for a bool field (``None`` is
            accepted where the field is optional); or a value that cannot train: learning_rate,
            beta or num_train_epochs <= 0 (epochs may be 0 when max_steps > 0), a batch size or
            gradient_accumulation_steps < 1.
    """
    fields = _dpo_fields()
    if fields is None:
        return dict(training)
    out = {}
    for key, value in training.items():
        if key in STAGE_OWNED:
            raise ConfigError(f"{where}.{key}: {STAGE_OWNED[key]}.")
        if key not in fields:
            raise ConfigError(f"{where}: unknown trl.DPOConfig key {key!r}.{did_you_mean(key, fields)} "
                              "See the fields with: python -c 'import trl; help(trl.DPOConfig)'.")
        out[key] = _checked_value(f"{where}.{key}", str(fields[key].type), value)
    for key, (low, strict) in _LOWER_BOUNDS.items():
        v = out.get(key)
        if isinstance(v, (int, float)) and (v <= low if strict else v < low):
            if key == "num_train_epochs" and isinstance(out.get("max_steps"), int) and out["max_steps"] > 0:
                continue  # max_steps decides the length then
            raise ConfigError(f"{where}.{key}: must be {'>' if strict else '>='} {low}, got {v!r}.")
    return out


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
