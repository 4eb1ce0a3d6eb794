"""Saving a trained policy as the next iteration's checkpoint, shared by the DPO and GRPO stages.

The checkpoint is written into ``<output_dir>.tmp`` and renamed into place (:func:`publish`), so a
crash never leaves a folder at ``output_dir`` that looks whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

# config.json keys copied back from the input policy (a trainer may have changed them, e.g. the pad id).
RESTORE_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache")


def rmtree(path: Path) -> None:
    """Remove a file, symlink or folder at ``path``; nothing when it does not exist."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def restore_input_config(model: Any, policy_path: str, orig_config: dict) -> None:
    """Give ``model`` the input policy's bos/eos/pad ids and use_cache (``orig_config``: the input's
    config.json as a dict) and its generation_config.json (kept as is when the input has none)."""
    from transformers import GenerationConfig

    for key in RESTORE_CONFIG_KEYS:
        if key in orig_config:
            setattr(model.config, key, orig_config[key])
    try:
        model.generation_config = GenerationConfig.from_pretrained(policy_path)
    except OSError:
        pass  # the input had no generation_config.json; keep the model's own


def finish_checkpoint(tmp_dir: Path, policy_path: str, trust_remote_code: bool) -> None:
    """Rank 0, after the weights are in ``tmp_dir``: save the input policy's tokenizer (untouched,
    chat template included) beside them.

    Raises:
        RuntimeError: ``tmp_dir`` holds no ``*.safetensors`` file.
    """
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(policy_path, trust_remote_code=trust_remote_code).save_pretrained(tmp_dir)
    if not any(tmp_dir.glob("*.safetensors")):
        raise RuntimeError(f"{tmp_dir}: no safetensors weights were written; the checkpoint is incomplete.")


def folder_mb(path: Path) -> float:
    """Megabytes (10^6 bytes) of the files under ``path`` (a file: its size; missing: 0.0)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size / 1e6
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e6 if p.is_dir() else 0.0


def publish(tmp_dir: Path, out_dir: Path) -> None:
    """Rename a finished ``tmp_dir`` to ``out_dir``; an existing ``out_dir`` is moved aside to
    ``<out_dir>.old`` first and removed after, so ``out_dir`` is never a half-written folder."""
    old = Path(f"{out_dir}.old")
    rmtree(old)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp_dir, out_dir)
    rmtree(old)
