"""Checks of the config sections handed to libraries other than TRL's ``DPOConfig``
(``online_rlhf.dpo_config`` checks the DPO stage's ``training``): its ``lora`` against
``peft.LoraConfig``, the SFT stage's Axolotl keys against Axolotl's schema.

Used by the stages (``dpo_iteration/run_dpo.py``, ``sft/run_sft.py``) before they load a model, and
by the loop's plan before any stage runs, so a typo in ``dpo.lora`` or ``sft`` fails at start-up
instead of after an iteration of generation. Where the library is not installed the keys pass
unchecked (the stage itself always has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

from .config import ConfigError, did_you_mean


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
