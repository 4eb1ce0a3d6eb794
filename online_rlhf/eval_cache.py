"""The evaluation cache: iteration 0's held-out and IFEval generations, reused across runs.

Iteration 0 evaluates the starting policy, so its greedy answers depend only on that model, the
prompts, the decoding settings and the hardware's dtype, not on the run's seed. Every seed of a
recipe and every rerun would decode the same answers again (IFEval's 541 prompts take minutes on a
CPU). A stage row with ``cache_iteration_0=True`` (``online_rlhf.stage_table``) is therefore looked
up here before ``loop exec`` starts it at iteration 0, and stored here when ``loop mark`` marks it
done:

- the key (:func:`cache_key`) is a sha256 over the stage's resolved config values without its
  output paths (and without the engine seed when decoding is greedy, ``temperature: 0``), the content
  of each input (model checkpoint, prompt file: hashed as :func:`online_rlhf.rundir.fingerprint`
  does, whatever their path), the dtype the stage will run in on this hardware
  (:func:`online_rlhf.hardware.compute_dtype`; ``ONLINE_RLHF_CPU_BF16`` and ``ATEN_CPU_CAPABILITY``
  included), the inference env's requirements file (the vLLM build) and the source of the modules
  that turn a prompt into an answer (:data:`DECODE_CODE`: rendering, tokenization, the engine call),
  so that a new version of that code decodes afresh instead of reusing stale answers;
- an entry is a folder ``<cache>/eval/<key>/`` holding ``output.jsonl``, ``stats.json`` and
  ``source.json`` (which run and file it came from), written in a temporary sibling and renamed;
- a hit copies the output and its stats into the run (each atomically), the stats with
  ``reused_from`` naming the file the answers were decoded into, so the run says where they came from.

``eval_cache: false`` in the loop config, or ``ONLINE_RLHF_EVAL_CACHE=0``, turns it off; runs over
several machines never use it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from .jsonl import DataError, read_json, write_json
from .paths import PROJECT_ROOT, cache_dir
from .rundir import fingerprint

# Config keys that name where the stage writes, not what it computes.
_OUTPUT_KEYS = ("output", "shards_dir")

# The package modules whose source decides a cached stage's answers (prompt loading, chat template
# rendering and tokenization, the vLLM call, the shard launcher and merge, the seed restored before a
# co-decoded config), relative to the package.
DECODE_CODE = ("stages/generate.py", "stages/launch.py", "stages/merge_data.py", "chat_tokens.py", "records.py",
               "co_decode.py")


def cache_root() -> Path:
    """``<project cache>/eval`` (``ONLINE_RLHF_CACHE`` moves the project cache)."""
    return cache_dir() / "eval"


def enabled(run_config: dict) -> bool:
    """Whether a run uses the cache: its ``eval_cache`` key (default true), one machine, and
    ``ONLINE_RLHF_EVAL_CACHE`` not ``0``."""
    if os.environ.get("ONLINE_RLHF_EVAL_CACHE", "1") == "0":
        return False
    return bool(run_config.get("eval_cache", True)) and int(run_config.get("num_machines", 1) or 1) == 1


def _hardware_key(d: dict) -> dict:
    from .hardware import compute_dtype

    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    except ImportError:  # pragma: no cover - the train env has torch
        device, gpu = "cpu", None
    req = PROJECT_ROOT / "requirements-infer.txt"
    return {"device": device, "gpu": gpu, "dtype": compute_dtype(device, d.get("dtype", "auto")),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "requirements_infer": fingerprint({}, [req], root=req.parent) if req.is_file() else None}


def code_key() -> str:
    """sha256 over the source of :data:`DECODE_CODE` (a missing module hashes as missing)."""
    pkg = Path(__file__).resolve().parent
    return fingerprint({}, [pkg / m for m in DECODE_CODE], root=pkg)


def cache_key(stage: str, d: dict[str, Any], inputs: list[str]) -> str:
    """The cache key of a stage's resolved config ``d`` with input paths ``inputs``.

    Args:
        stage: the stage's name (part of the key).
        d: the stage's config values, as in its YAML.
        inputs: the files/folders the stage reads (model, prompts); their content enters the key,
            their path does not.
    Returns:
        a sha256 hex digest.
    """
    values = {k: v for k, v in d.items() if k not in _OUTPUT_KEYS}
    if float(values.get("temperature") or 0.0) == 0.0:
        values.pop("seed", None)  # greedy: the engine seed draws nothing
    for k in ("model", "prompts"):  # their content is in `contents`; their path may differ between runs
        if k in values:
            values[k] = "<input>"
    contents = [fingerprint({}, [p], root=p) for p in inputs]  # content only: labelled relative to itself
    return fingerprint({"stage": stage, "config": values, "inputs": contents, "hardware": _hardware_key(d),
                        "code": code_key()})


def lookup(key: str) -> Optional[Path]:
    """The entry folder of ``key``, or None when there is none (or it is incomplete)."""
    entry = cache_root() / key
    if all((entry / n).is_file() for n in ("output.jsonl", "stats.json", "source.json")):
        return entry
    return None


def store(key: str, output: Path, stats_file: Path, run_dir: Path) -> Optional[Path]:
    """Copy a finished stage's output and stats into the entry of ``key`` (no-op when it exists).

    Returns:
        the entry folder, or None when the output or stats are missing.
    """
    if lookup(key) is not None:
        return cache_root() / key
    if not (output.is_file() and stats_file.is_file()):
        return None
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=root))
    try:
        shutil.copyfile(output, tmp / "output.jsonl")
        shutil.copyfile(stats_file, tmp / "stats.json")
        write_json(tmp / "source.json", {"output": str(output), "run_dir": str(run_dir)})
        final = root / key
        if final.exists():  # incomplete earlier entry
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root / key


def restore(entry: Path, output: Path, stats_file: Path, stats_cls, inputs: Optional[dict[str, str]] = None) -> str:
    """Copy a cache entry's output to ``output`` and its stats to ``stats_file`` (each atomically),
    the stats with ``reused_from`` set to the file the answers were decoded into.

    ``inputs`` (e.g. ``{"model": ..., "prompts": ...}``, this run's values) replace the same keys of the
    stored stats: the key holds those inputs' content, not their path, so the entry may name a path
    that no longer exists (a deleted temporary model); a reader of this run's stats (bench.roofline
    loads ``model``) must find this run's.

    Returns:
        the original output path (for the caller's message).
    Raises:
        DataError: the entry's stats do not read back through ``stats_cls`` (the entry is removed,
            so that the next run decodes again).
    """
    from .jsonl import atomic_open

    source = read_json(entry / "source.json")["output"]
    stats = read_json(entry / "stats.json")
    stats["reused_from"] = stats.get("reused_from") or source
    stats.update({k: v for k, v in (inputs or {}).items() if k in stats})
    try:
        stats_cls.model_validate(stats)
    except ValidationError as e:  # a stale entry (written before a stats change): drop it and say so
        shutil.rmtree(entry, ignore_errors=True)
        first = e.errors()[0]
        raise DataError(f"{entry}: a cached evaluation whose stats no longer read as {stats_cls.__name__} "
                        f"({e.error_count()} problem(s), e.g. {'.'.join(map(str, first['loc']))}: {first['msg']}); "
                        "removed it. Rerun the same command to decode afresh.") from None
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(entry / "output.jsonl", "rb") as src, atomic_open(output, "wb", encoding=None) as dst:
        shutil.copyfileobj(src, dst)
    write_json(stats_file, stats)
    return source
