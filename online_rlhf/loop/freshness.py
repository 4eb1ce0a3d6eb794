"""Is a stage done and fresh? What a run directory records of each planned stage: its plan entry
(:func:`stage_entry`), the hash of its config and inputs (:func:`stage_hash`), its ``.done`` marker
and what changed since it was written (:func:`changed_parts`), its outputs as they are now, and
:func:`stale_reason`, which ``loop check``, ``exec`` and co-decoding ask; plus the run's own
``config.yaml`` (:func:`run_config`) and the evaluation-cache key of a stage (:func:`eval_cache_key`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError
from ..jsonl import DataError, read_json
from ..rundir import changed_outputs, fingerprint, is_done
from ..stage_table import STAGES
from ..stats import stats_path


def stage_entry(run_dir: Path, i: int, stage: str) -> dict:
    plan_path = run_dir / f"iter_{i}" / "plan.json"
    entries = read_json(plan_path)
    if stage not in entries:
        raise ConfigError(f"{plan_path}: no stage {stage!r}; stages: {', '.join(entries)}.")
    planned_for = Path(entries[stage]["config"]).parents[2]  # <run_dir>/iter_<i>/configs/<stage>.yaml
    if planned_for.resolve() != run_dir.resolve():
        raise ConfigError(f"{plan_path} was planned for the run directory {planned_for}, not {run_dir.resolve()} (a "
                          f"copied or moved run?): its stages would read and write {planned_for}. Plan it here first: "
                          f"bash run_loop.sh {run_dir / 'config.yaml'} output_root={run_dir.resolve().parent} "
                          f"run_name={run_dir.resolve().name} (the stages done keep their results).")
    return entries[stage]


def _masked_config(run_dir: Path, e: dict) -> str:
    """The stage YAML's values (not its comments) as sorted JSON, the run dir's own path masked."""
    values = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
    return json.dumps(values, sort_keys=True, ensure_ascii=False).replace(str(run_dir), "<run_dir>")


def stage_hash(run_dir: Path, i: int, stage: str) -> str:
    """Hash of a stage's config values (with the run dir's own path masked; launch settings
    included, comments not) and its inputs' content: a run directory moved or copied elsewhere
    resumes where it stopped, and a changed setting of any kind reruns the stage."""
    e = stage_entry(run_dir, i, stage)
    return fingerprint({"stage": stage, "config": _masked_config(run_dir, e)}, e["inputs"], root=run_dir)


def hash_parts(run_dir: Path, e: dict) -> dict:
    """What ``.done`` keeps besides the hash, so that a later check can say what changed: the
    config values (masked as in :func:`stage_hash`) and one digest per input."""
    return {"config": json.loads(_masked_config(run_dir, e)),
            "input_digests": {inp: fingerprint({}, [inp], root=run_dir) for inp in e["inputs"]}}


def config_differences(before, now, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, before's value, now's value)`` per differing value of two config mappings,
    nested mappings walked (``training.beta``); a key one side lacks has :data:`UNSET` there. A value
    compares by its JSON text, so ``0.0`` and ``0`` differ (they hash apart)."""
    if isinstance(before, dict) and isinstance(now, dict) and (before or now):
        out = []
        for k in sorted(set(before) | set(now), key=str):
            out += config_differences(before.get(k, UNSET), now.get(k, UNSET), f"{prefix}{k}.")
        return out
    if _text(before) == _text(now):
        return []
    return [(prefix.rstrip("."), before, now)]


def _diff(before, now) -> list[str]:
    """``key: old -> new`` per :func:`config_differences` entry (``(unset)`` for a lacking key)."""
    return [f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in config_differences(before, now)]


UNSET = object()  # a key one side of config_differences lacks


def _text(v) -> str:
    """A config value as written in JSON, ``(unset)`` for a key one side lacks."""
    return "(unset)" if v is UNSET else json.dumps(v, ensure_ascii=False)


def _short(v) -> str:
    text = _text(v)
    return text if len(text) <= 60 else text[:57] + "..."


def changed_parts(run_dir: Path, i: int, stage: str) -> list[str]:
    """What differs between the stage's config and inputs now and when its ``.done`` was written:
    one phrase per changed config key (``key: old -> new``, dotted for nested keys, ``(unset)`` for
    an added or removed key) and per changed, missing, added or removed input. Empty when the marker
    predates this record (then only the hash says that something changed) or nothing differs."""
    try:
        done = read_json(done_marker(run_dir, i, stage))
    except (FileNotFoundError, DataError):
        return []
    if not isinstance(done, dict) or "config" not in done or "input_digests" not in done:
        return []
    now = hash_parts(run_dir, stage_entry(run_dir, i, stage))
    out = _diff(done["config"], now["config"])
    before_i, now_i = done["input_digests"], now["input_digests"]
    for inp in sorted(set(before_i) | set(now_i)):
        if inp not in before_i:
            out.append(f"new input {inp}")
        elif inp not in now_i:
            out.append(f"input {inp} no longer used")
        elif not Path(inp).exists():
            out.append(f"input {inp} is missing")
        elif before_i[inp] != now_i[inp]:
            out.append(f"input {inp} changed")
    return out


def overrides_record(run_dir: Path, i: int, stage: str) -> Path:
    """``iter_<i>/<stage>.exec_overrides.json``: the ``key=value`` overrides of the stage's last
    ``loop exec`` on machine 0, when it had any that change outputs (:func:`_record_overrides`)."""
    return run_dir / f"iter_{i}" / f"{stage}.exec_overrides.json"


def done_marker(run_dir: Path, i: int, stage: str) -> Path:
    return run_dir / f"iter_{i}" / f"{stage}.done"


def check(run_dir: Path, i: int, stage: str) -> bool:
    """True when the stage is done and fresh (:func:`stale_reason` gives None)."""
    return stale_reason(run_dir, i, stage) is None


def recorded_outputs(run_dir: Path, i: int, stage: str) -> list[str]:
    """The files and folders whose size and hash ``<stage>.done`` records: the stage's outputs and
    its stats file."""
    outs = stage_entry(run_dir, i, stage)["outputs"]
    return [*outs, str(stats_path(outs[0]))] if outs else []


def stale_reason(run_dir: Path, i: int, stage: str) -> str | None:
    """Why the stage must run (one line), or None when it is done and fresh: its ``.done`` exists,
    its hash matches (config and inputs unchanged), its outputs exist (a checkpoint folder only
    counts with its weights: ``*.safetensors`` or ``pytorch_model*.bin``) and are the ones it wrote
    (size and hash as recorded in ``.done``: an output cut or edited after the stage finished makes
    it run again, instead of later stages using it silently), and its stats file reads back through
    the stage's stats class (a stage whose stats are missing or broken runs again, rather than
    stopping ``metrics`` later)."""
    e = stage_entry(run_dir, i, stage)
    marker = done_marker(run_dir, i, stage)
    if not marker.is_file():
        return "not run yet"
    if not is_done(marker, stage_hash(run_dir, i, stage)):
        parts = changed_parts(run_dir, i, stage)
        shown = "; ".join(parts[:4])
        if len(parts) > 4:  # the rest by name only
            shown += f"; and {len(parts) - 4} more: " + ", ".join(q.split(":")[0] for q in parts[4:])
        return "its config or inputs changed since it finished" + (f" ({shown})" if parts else "")
    missing = [o for o in e["outputs"] if not output_present(Path(o))]
    if missing:
        return f"its output {missing[0]} is missing"
    try:
        STAGES[stage].stats.read(stats_path(e["outputs"][0]))
    except FileNotFoundError:
        return f"its stats file {stats_path(e['outputs'][0])} is missing"
    except DataError as err:
        path = stats_path(e["outputs"][0])
        first = str(err).splitlines()[0].removeprefix(f"{path}: ")[:300]
        return f"its stats file {path} is not valid ({first})"
    try:
        changed = changed_outputs(marker, recorded_outputs(run_dir, i, stage), root=run_dir)
    except (FileNotFoundError, DataError):
        return f"its marker {marker} is not readable"
    if changed:
        return f"its output changed after the stage finished ({'; '.join(changed)})"
    return None


def output_present(path: Path) -> bool:
    if not path.exists():
        return False
    if path.is_dir() and (path / "config.json").is_file():
        return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return True


def run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def eval_cache_key(run_dir: Path, i: int, stage: str, e: dict, d: dict) -> str | None:
    """The evaluation-cache key of a stage (``online_rlhf.eval_cache``), or None when the stage is
    not cached here (not a ``cache_iteration_0`` row, not iteration 0, or the run turned it off)."""
    from .. import eval_cache

    if i != 0 or not STAGES[stage].cache_iteration_0 or not eval_cache.enabled(run_config(run_dir)):
        return None
    return eval_cache.cache_key(stage, d, e["inputs"])
