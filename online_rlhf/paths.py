"""Where the project keeps its caches and the embedded default, and the cache env vars.

Everything lives under the project's git-ignored ``.cache/`` (or ``$ONLINE_RLHF_CACHE``):
``models/`` (the default policy), ``data/`` (the default prompts), ``hf/`` (HF_HOME),
``torch_extensions/``, ``vllm/``, ``nltk_data/``, ``wandb/``. A variable the user already set
is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("ONLINE_RLHF_CACHE", PROJECT_ROOT / ".cache")).resolve()


def default_model_dir() -> Path:
    """Checkpoint dir of the embedded default policy (built by scripts/prepare_default.py)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_data_dir() -> Path:
    """Folder of the default prompt sets: ``if_train.jsonl`` (train), ``ifbench_eval.jsonl`` (held out), ``ifeval.jsonl``."""
    return cache_dir() / "data"


def setup_cache_env() -> None:
    """Point HF, torch extensions, vLLM, NLTK and wandb caches into the project cache (setdefault),
    and set the OpenMP defaults of :func:`online_rlhf.hardware.setdefault_thread_env`."""
    c = cache_dir()
    for var, sub in (("HF_HOME", "hf"), ("TORCH_EXTENSIONS_DIR", "torch_extensions"),
                     ("VLLM_CACHE_ROOT", "vllm"), ("NLTK_DATA", "nltk_data"), ("WANDB_DIR", "wandb"),
                     ("TRITON_CACHE_DIR", "triton")):
        os.environ.setdefault(var, str(c / sub))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .hardware import setdefault_thread_env

    setdefault_thread_env()


POLICY_HINT = "Give an existing checkpoint directory, an HF Hub id (namespace/name), or 'default'."
REWARD_MODEL_HINT = ("Give an existing reward model directory (a saved one-label *ForSequenceClassification) or an HF "
                     "Hub id (namespace/name).")


def resolve_model(name: str, hint: str = POLICY_HINT) -> str:
    """``"default"`` -> the embedded default checkpoint dir; a path (``~`` expanded) or Hub id as is.
    ``hint``: what the error for a missing local path tells the user to give instead (a reward
    model has no ``default``: :data:`REWARD_MODEL_HINT`).

    A name is taken as a local path when :func:`looks_like_path` says so, or when it has the form
    ``first/rest`` of a Hub id but ``first`` is a folder here (``models/mine`` beside a ``models/``
    folder): then it must exist.

    Raises:
        FileNotFoundError: the default is not prepared, or a local path does not exist (the message
            names the absolute path looked at).
    """
    if name == "default":
        d = default_model_dir()
        if not (d / "config.json").is_file():
            raise FileNotFoundError(
                f"the default policy is not prepared at {d}. Run: .venv-train/bin/python scripts/prepare_default.py"
            )
        return str(d)
    if is_local_model(name):
        p = Path(name).expanduser()
        if not p.exists():
            why = (f" ({local_folder_prefix(name)!r} is a folder here, so it is taken as a local path, not a Hub id)"
                   if not looks_like_path(name) else "")
            raise FileNotFoundError(
                f"model {name!r}: no such directory (looked at {p.absolute()}){why}. {hint}"
            )
        return str(p)
    return name


# --- local path or Hugging Face Hub id: the one place that decides it -------------------------------
# A name that exists here is a local path. For one that does not, the rules below say whether it is
# meant as a local path (then it is missing: an error that names the path) or as a Hub id (left to the
# library that loads it). A Hub id has the shape owner/name (:func:`hub_id_shaped`). Models and data
# files are told apart by different signs, on purpose: a model folder has no suffix, but may sit beside
# ``./``, ``~`` or a local folder of its first part (:func:`is_local_model`); a data file is known by
# its suffix (:func:`is_local_data`). tests/test_records.py pins each rule on the same names.

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")  # the local prompt-file types the loaders read


def hub_id_shaped(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub id: ``owner/name`` (one slash, not starting with ``.``
    or ``/``)."""
    return name.count("/") == 1 and not name.startswith((".", "/"))


def looks_like_path(name: str) -> bool:
    """True for strings that can only be local paths: absolute, ./ or ../, ~, or 2+ slashes."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2 or os.sep + os.sep in name


def is_local_model(name: str) -> bool:
    """Whether a model ``name`` (not ``default``) is meant as a local folder: :func:`looks_like_path`,
    or the shape ``first/rest`` of a Hub id with a folder ``first`` here (:func:`local_folder_prefix`).
    The rule of :func:`resolve_model` and the plan's model checks."""
    return looks_like_path(name) or local_folder_prefix(name) is not None


def is_local_data(source: str, bare_name_is_hub: bool = True) -> bool:
    """Whether a data ``source`` (a prompt set) that does not exist is meant as a local file: it has a
    data file's suffix (:data:`DATA_SUFFIXES`), or a path separator without the shape of a Hub id
    (:func:`hub_id_shaped`). A bare name (no slash) is a Hub id (``gsm8k``) unless
    ``bare_name_is_hub`` is False (``ifeval.prompts``, whose Hub ids are ``owner/name`` only). The rule
    of :func:`online_rlhf.records.load_prompts` and the plan's prompt-file checks."""
    if Path(source).suffix in DATA_SUFFIXES or os.sep in source and not hub_id_shaped(source):
        return True
    return not bare_name_is_hub and "/" not in source


def local_folder_prefix(name: str) -> str | None:
    """For a Hub-id-shaped ``first/rest``: ``first`` when it is a folder in the current directory
    (the name then means a local path), else None."""
    if name.count("/") != 1 or looks_like_path(name):
        return None
    first = name.split("/", 1)[0]
    return first if first and Path(first).is_dir() else None
