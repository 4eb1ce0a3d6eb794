"""LoRA adapters through the loop: a policy that is a base checkpoint plus a peft adapter folder.

With the loop's ``lora`` key (``online_rlhf.loop_config.LoopLora``) the DPO and GRPO stages train a
LoRA adapter on the unchanged base and save the adapter only (``adapter_config.json`` +
``adapter_model.safetensors`` + the tokenizer, a few MB); the next iteration's generation, held-out
evaluation, IFEval and KL decode the base with that adapter (vLLM: ``enable_lora`` and a
``LoRARequest``; transformers: ``peft.PeftModel``), and the next update continues from it. Nothing is
merged unless asked: ``scripts/merge_lora.py`` writes a full checkpoint for export.

This module is what every stage shares about such a folder: is it an adapter, which base it names,
its rank (vLLM's ``max_lora_rank``), the config a continued adapter trains with, the target modules
a policy has, loading it on a base with transformers + peft, saving one, and merging one.
Importable without torch (peft and transformers are imported inside the functions that need them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# vLLM 0.32's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def is_adapter(path: Optional[str]) -> bool:
    """Whether ``path`` is a local folder holding a peft adapter (``adapter_config.json``)."""
    return bool(path) and (Path(str(path)).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_config(path: str) -> dict:
    """The ``adapter_config.json`` of the adapter folder ``path`` as a dict.

    Raises:
        FileNotFoundError: no such folder, no ``adapter_config.json`` or no ``adapter_model.safetensors``
            (names the folder and the fix).
        ConfigError: the file is not JSON, not a LoRA adapter's config (``peft_type`` other than LORA),
            or has no ``r``.
    """
    from .config import ConfigError

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: no such folder; give the adapter folder a LoRA update stage saved "
                                "(iter_<i>/model of a run with the loop's lora key), or adapter=null.")
    f = folder / ADAPTER_CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG}, so it is not a LoRA adapter folder. Give the folder a "
                                "LoRA update stage saved (iter_<i>/model of a run with the loop's lora key), or "
                                "set adapter=null to use the model alone.")
    try:
        conf = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not JSON ({e}); the adapter folder is damaged. Train it again.") from None
    if not isinstance(conf, dict) or str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{f}: peft_type={conf.get('peft_type') if isinstance(conf, dict) else conf!r}; only LoRA "
                          "adapters are decoded by vLLM and trained by the loop. Give a LoRA adapter, or merge yours "
                          "into a full checkpoint.")
    if "r" not in conf:
        raise ConfigError(f"{f} has no r (the LoRA rank); the adapter folder is damaged. Train it again.")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (a save that was cut short?); "
                                "rerun the stage that wrote it (run_loop.sh resumes it).")
    return conf


def adapter_base(path: str) -> str:
    """The base model an adapter folder names (``base_model_name_or_path``).

    Raises:
        FileNotFoundError, ConfigError: as :func:`adapter_config`; ConfigError also when the config
            names no base model.
    """
    from .config import ConfigError

    base = adapter_config(path).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path}/{ADAPTER_CONFIG} names no base_model_name_or_path; give the base as the "
                         "stage's model/policy and the folder as its adapter.")
    return str(base)


def split_model(model: str, adapter: Optional[str]) -> tuple[str, Optional[str]]:
    """``(resolved base model, adapter folder or None)`` a stage loads for its ``model``/``policy``
    (a folder, Hub id or ``default``) and ``adapter`` keys: an adapter folder given as the model itself
    is taken apart into the base it names and itself (so ``model=runs/x/iter_1/model`` works by hand);
    otherwise the keys as given.

    Raises:
        FileNotFoundError: no such model, or ``adapter`` is not an adapter folder (:func:`adapter_config`).
        ConfigError: both ``model`` and ``adapter`` are adapter folders; a damaged adapter folder.
    """
    from .config import ConfigError
    from .paths import resolve_model

    model = resolve_model(model)
    if adapter:
        named = adapter_config(adapter).get("base_model_name_or_path")  # raises with the fix when it is not one
        if is_adapter(model):
            raise ConfigError(f"model={model} is itself a LoRA adapter folder and adapter={adapter} is another; give "
                              "the base checkpoint as the model (or merge the first adapter: scripts/merge_lora.py).")
        if named and Path(named).exists() and Path(model).exists() and Path(named).resolve() != Path(model).resolve():
            import sys

            print(f"warning: the adapter {adapter} was trained on {named}; it is applied to {model} as given. "
                  "If that is not the same model, give its base as the model/policy.", file=sys.stderr)
        return model, adapter
    if is_adapter(model):
        return resolve_model(adapter_base(model)), model
    return model, None


def adapter_rank(path: str) -> int:
    """The largest LoRA rank of an adapter folder (``r``, and any ``rank_pattern`` value)."""
    conf = adapter_config(path)
    ranks = [int(conf.get("r") or 8), *(int(v) for v in (conf.get("rank_pattern") or {}).values())]
    return max(ranks)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest of vLLM's allowed ``max_lora_rank`` values (:data:`VLLM_LORA_RANKS`) that holds ``rank``.

    Raises:
        ValueError: ``rank`` is above vLLM's largest (512).
    """
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); "
                     "train with a smaller lora.r.")


def unknown_target_modules(model: str, names: list[str]) -> tuple[list[str], list[str]]:
    """``(names of ``names`` that match no linear layer of the local checkpoint ``model``, the short
    names of its linear layers)``: peft matches a target module by the end of a module's dotted name.
    The model is built from its config on the meta device (no weights are read)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    linear = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    missing = [t for t in names if not any(n == t or n.endswith("." + t) for n in linear)]
    return missing, sorted({n.rsplit(".", 1)[-1] for n in linear})


def continued_lora_config(adapter: str, lora: Optional[dict]):
    """The ``peft.LoraConfig`` an adapter folder was saved with, made trainable, to continue it; the
    stage's ``lora`` keys must be given and agree with it on ``r``, ``lora_alpha``, ``lora_dropout``
    and a list of ``target_modules`` (an ``all-linear`` that peft saved as module names is the
    adapter's own).

    Raises:
        ConfigError: no ``lora``; a key of ``lora`` differs from the adapter's (names both and the
            fix); the folder is damaged (:func:`adapter_config`).
    """
    from peft import LoraConfig

    from .config import ConfigError

    if not lora:
        raise ConfigError(f"policy {adapter} is a LoRA adapter folder; continuing it needs lora (the same r and "
                          "lora_alpha), or merge it first (scripts/merge_lora.py) and give the merged checkpoint.")
    adapter_config(adapter)  # a damaged folder is named here, not by peft
    conf = LoraConfig.from_pretrained(adapter)
    for key in ("r", "lora_alpha", "lora_dropout"):
        given = (lora or {}).get(key)
        if given is not None and float(given) != float(getattr(conf, key)):
            raise ConfigError(f"lora.{key}={given}, but the adapter {adapter} being continued was trained with "
                              f"{key}={getattr(conf, key)}; keep the run's lora settings (or start a new run).")
    wanted = (lora or {}).get("target_modules")
    saved = conf.target_modules
    if isinstance(wanted, (list, tuple, set)) and not isinstance(saved, str) and set(wanted) != set(saved or ()):
        raise ConfigError(f"lora.target_modules={sorted(wanted)}, but the adapter {adapter} being continued adapts "
                          f"{sorted(saved or ())}; keep the run's lora settings (or start a new run).")
    conf.inference_mode = False
    return conf


def load_with_adapter(model: Any, adapter: str, trainable: bool = False) -> Any:
    """``peft.PeftModel`` of the loaded base ``model`` with the adapter folder ``adapter`` as its
    ``default`` adapter (trainable or frozen)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter, is_trainable=trainable)


def load_adapter_weights(peft_model: Any, adapter: str) -> None:
    """Copy the weights of the adapter folder ``adapter`` into ``peft_model``'s ``default`` adapter
    (same rank and target modules), in place.

    Raises:
        ValueError: a weight of the folder has no place in the model, or the model's adapter keeps
            weights the folder lacks (another rank or other target modules).
    """
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, load_peft_weights(adapter))
    missing = [k for k in result.missing_keys if "lora_" in k and ".default." in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{adapter}: its weights do not fit the adapter being trained (unexpected: "
                         f"{list(result.unexpected_keys)[:3]}, missing: {missing[:3]}); the loop's lora settings "
                         "(r, target_modules) changed since it was saved. Keep them, or start a new run.")


def save_adapter(peft_model: Any, out_dir: Path, base: str) -> None:
    """Save ``peft_model``'s ``default`` adapter (only) to ``out_dir``, naming ``base`` (as given,
    resolved to an absolute path when it is a local folder) as its ``base_model_name_or_path``."""
    peft_model.save_pretrained(str(out_dir), selected_adapters=["default"], safe_serialization=True)
    f = out_dir / ADAPTER_CONFIG
    conf = json.loads(f.read_text(encoding="utf-8"))
    conf["base_model_name_or_path"] = str(Path(base).resolve()) if Path(base).exists() else base
    if isinstance(conf.get("target_modules"), list):  # peft writes a set in hash order: sorted, the same
        conf["target_modules"] = sorted(conf["target_modules"])  # adapter hashes the same in every run (resume)
    f.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's model card template


def merge_adapter(adapter: str, out_dir: Path, base: Optional[str] = None, dtype: str = "auto") -> Path:
    """Merge the adapter folder ``adapter`` into its base (``base``, default the one it names) and
    save a full checkpoint at ``out_dir`` (written into ``<out_dir>.tmp``, then renamed): safetensors,
    the base's config and generation_config, the adapter folder's tokenizer (the base's when it has none).

    Returns:
        ``out_dir``.
    Raises:
        FileNotFoundError, ValueError: as :func:`adapter_config`; FileExistsError: ``out_dir`` exists.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .checkpoint import publish, rmtree

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; give a new folder for the merged checkpoint (or remove it).")
    base = base or adapter_base(adapter)
    kwargs = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    merged = load_with_adapter(model, adapter).merge_and_unload()
    tmp = Path(f"{out_dir}.tmp")
    rmtree(tmp)
    try:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tok_src = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base
        AutoTokenizer.from_pretrained(tok_src).save_pretrained(str(tmp))
        publish(tmp, out_dir)
    except BaseException:
        rmtree(tmp)
        raise
    return out_dir
