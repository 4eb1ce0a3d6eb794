"""Running the planned stages: ``loop check``, ``exec``, ``mark``, ``stages``, ``after`` and
``output-hint`` (``dry-run``: :mod:`.memory_check`).

A stage is done and fresh when its ``.done`` records the hash of its config and inputs as they are
now and its outputs are the ones it wrote (:func:`stale_reason`); ``exec`` starts it from its YAML
(on machine k > 0 after the stage before it in machine 0's run), ``mark`` records it done.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError
from ..jsonl import DataError, read_json, write_json
from ..paths import PROJECT_ROOT
from ..rundir import changed_outputs, fingerprint, is_done, mark_done
from ..stage_table import STAGES, launch_command, stage_machines
from ..stats import stats_path


def _stage_entry(run_dir: Path, i: int, stage: str) -> dict:
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
    e = _stage_entry(run_dir, i, stage)
    return fingerprint({"stage": stage, "config": _masked_config(run_dir, e)}, e["inputs"], root=run_dir)


def _hash_parts(run_dir: Path, e: dict) -> dict:
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
        done = read_json(_marker(run_dir, i, stage))
    except (FileNotFoundError, DataError):
        return []
    if not isinstance(done, dict) or "config" not in done or "input_digests" not in done:
        return []
    now = _hash_parts(run_dir, _stage_entry(run_dir, i, stage))
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


def exec_stage(run_dir: Path, i: int, stage: str, overrides: list[str] = (), machine_rank: int = 0,
               wait_poll_s: float = 10.0) -> None:
    """Replace this process by the command that runs ``stage`` of iteration ``i``, built from the
    stage's config file by :func:`online_rlhf.stage_table.launch_command` (the command written on
    top of that file; the run's ``launcher`` from ``<run>/config.yaml``), from the project root.
    Prints the command first (it heads the stage's log).

    On machine ``machine_rank`` k > 0 (``num_machines`` > 1, ``launcher: local``): a stage that runs
    on machine 0 only returns at once (nothing to run here); a stage that is already done and fresh
    returns too; otherwise it first waits until the stage before it in machine 0's run is done and
    fresh (its inputs are then written), so that machine k can run every stage of the run in order
    (docs/multi-node.md) and meet machine 0 at each distributed one.

    Co-decoding (machine 0, no overrides; :func:`co_decode_companions`): a generation stage whose
    output an earlier stage's launch already wrote for its current hash runs nothing
    (:func:`_co_decoded_before`); one that launches takes the later generation stages of the
    iteration (and the next iteration's rollouts) that can share its engine along, runs the launcher
    as a child instead of replacing this process, and records their outputs (:func:`_co_decode`).

    Args:
        overrides: ``key=value`` arguments appended to the stage's command (e.g. ``dry_run=true``);
            they change this run only, not the stage's config file or its freshness hash, so
            :func:`mark` refuses the stage until it runs again without them.
    Raises:
        ConfigError: no such stage in the iteration's plan.json; ``machine_rank`` outside the stage's
            machines; a rank > 0 under ``launcher: slurm`` (srun starts every node's part).
    """
    e = _stage_entry(run_dir, i, stage)
    d = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
    launcher = _run_launcher(run_dir)
    if machine_rank != 0:
        m = stage_machines(STAGES[stage], d)
        if m > 1 and not 0 <= machine_rank < m:  # before any wait
            raise ConfigError(f"machine_rank={machine_rank} must be in 0..{m - 1} (num_machines={m}).")
        if launcher == "slurm":
            raise ConfigError(f"machine_rank={machine_rank}: this run uses launcher=slurm, where srun starts every "
                              "node's part from machine 0; nothing to start by hand.")
        if stage_machines(STAGES[stage], d) == 1:
            print(f"stage {stage} of iteration {i} runs on machine 0 only; nothing to run on machine {machine_rank}.")
            return
        _wait_for_previous_stage(run_dir, i, stage, wait_poll_s)
        if check(run_dir, i, stage):
            print(f"stage {stage} of iteration {i} is done and fresh; nothing to run on machine {machine_rank}.")
            return
    if machine_rank == 0:
        _record_overrides(run_dir, i, stage, overrides)
    if machine_rank == 0 and not overrides and _reuse_cached(run_dir, i, stage, e, d):
        return
    if machine_rank == 0 and not overrides and _co_decoded_before(run_dir, i, stage):
        return
    companions = co_decode_companions(run_dir, i, stage) if machine_rank == 0 and not overrides else []
    argv, env = launch_command(STAGES[stage], e["config"], d, machine_rank=machine_rank, launcher=launcher,
                               extra=list(overrides))
    if companions:
        argv = [*argv, *(a for ci, c in companions for a in ("--config", _stage_entry(run_dir, ci, c)["config"]))]
    print("+ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, argv)]), flush=True)
    os.chdir(PROJECT_ROOT)
    if companions:
        _co_decode(run_dir, i, stage, companions, argv, env)
        return
    os.execve(argv[0] if os.sep in argv[0] else _which(argv[0]), argv, {**os.environ, **env})


def _overrides_record(run_dir: Path, i: int, stage: str) -> Path:
    """``iter_<i>/<stage>.exec_overrides.json``: the ``key=value`` overrides of the stage's last
    ``loop exec`` on machine 0, when it had any that change outputs (:func:`_record_overrides`)."""
    return run_dir / f"iter_{i}" / f"{stage}.exec_overrides.json"


def _record_overrides(run_dir: Path, i: int, stage: str, overrides) -> None:
    """Before a launch on machine 0: record the overrides that are not in the stage's config file nor
    its freshness hash (``dry_run=`` aside: a dry run writes no output), or remove the record when
    there are none, so that :func:`mark` can refuse outputs made with unrecorded settings."""
    kept = [o for o in overrides if o.split("=", 1)[0].strip() != "dry_run"]
    path = _overrides_record(run_dir, i, stage)
    if kept:
        write_json(path, {"overrides": kept})
    else:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------ co-decoding (online_rlhf/co_decode.py)

def co_decode_enabled(run_config: dict) -> bool:
    """Whether a run co-decodes: its ``co_decode`` key (default true) and ``ONLINE_RLHF_CO_DECODE``
    not ``0``."""
    return os.environ.get("ONLINE_RLHF_CO_DECODE", "1") != "0" and bool(run_config.get("co_decode", True))


def _co_decode_record(run_dir: Path, i: int, stage: str) -> Path:
    """``iter_<i>/<stage>.co_decoded``: written when another stage's launch decoded this stage's
    output; the hash of this stage's config and inputs it was decoded for, and its outputs' sizes
    and hashes (the format of a ``.done`` marker)."""
    return run_dir / f"iter_{i}" / f"{stage}.co_decoded"


def _record_valid(run_dir: Path, i: int, stage: str, digest: str | None = None) -> bool:
    """Whether the stage's co-decode record holds for the stage as it is now: written for its
    current hash (``digest`` when the caller has it), its outputs present and unchanged since, its
    stats readable."""
    record = _co_decode_record(run_dir, i, stage)
    if not record.is_file() or not is_done(record, digest or stage_hash(run_dir, i, stage)):  # no hashing without one
        return False
    e = _stage_entry(run_dir, i, stage)
    if not all(_output_present(Path(o)) for o in e["outputs"]):
        return False
    try:
        STAGES[stage].stats.read(stats_path(e["outputs"][0]))
        return not changed_outputs(record, _recorded_outputs(run_dir, i, stage), root=run_dir)
    except (FileNotFoundError, DataError):
        return False


def _co_decoder(run_dir: Path, i: int, stage: str) -> tuple[str, int] | None:
    """``(stage, iteration)`` whose launch already decoded this stage's output for its current config
    and inputs (:func:`_record_valid`), or None."""
    if not _record_valid(run_dir, i, stage):
        return None
    record = read_json(_co_decode_record(run_dir, i, stage))
    return record.get("co_decoded_by"), int(record.get("co_decoded_iteration", i))


def co_decoded_note(run_dir: Path, i: int, stage: str) -> str | None:
    """For ``loop check``: a line saying that another stage's launch already decoded this stage's
    output for its current config and inputs (``loop exec`` will only mark it done), or None."""
    by = _co_decoder(run_dir, i, stage)
    return None if by is None else (f"its output is already decoded (co-decoded in the engine start of stage "
                                    f"{by[0]} of iteration {by[1]}): `loop exec` only marks it done")


def _co_decoded_before(run_dir: Path, i: int, stage: str) -> bool:
    """True (and says so) when an earlier stage's launch already decoded this stage's output for its
    current config and inputs (:func:`_record_valid`): nothing to run; ``loop mark`` then marks it."""
    found = _co_decoder(run_dir, i, stage)
    if found is None:
        return False
    by, at = found
    where = "this iteration" if at == i else f"iteration {at}"
    print(f"stage {stage} of iteration {i}: decoded in the engine start of stage {by} of {where} for its "
          f"current config and inputs (log {run_dir / f'iter_{at}' / 'logs' / f'{by}.log'}); nothing to run "
          "(co_decode=false runs each generation stage with its own engine start)", flush=True)
    return True


def co_decode_companions(run_dir: Path, i: int, stage: str) -> list[tuple[int, str]]:
    """The stages whose outputs ``stage``'s launch also decodes, with one engine start
    (``online_rlhf.co_decode``), as ``(iteration, stage)`` in run order. Candidates: the later stages
    of iteration ``i`` that run the same entry script (the generation launcher), then the generation
    stages that open iteration ``i + 1`` (its rollouts, ``generate``: they sample from the policy
    iteration ``i`` evaluates, so they join when the model is the same). A candidate joins when it is
    stale, holds no valid co-decode record, is not served by the evaluation cache, its inputs exist
    already, and its engine settings equal ``stage``'s (:func:`online_rlhf.co_decode.refusal`). Empty
    when the row is not the generation launcher's, when the run turned co-decoding off
    (:func:`co_decode_enabled`), or when ``stage`` itself is served by the cache. Prints why each
    candidate of iteration ``i`` that cannot join runs with its own engine start (a next-iteration
    one with another model is left out without a word: it samples from the policy trained next).
    """
    from .. import eval_cache
    from ..co_decode import engine_in_process, refusal

    row = STAGES[stage]
    if row.entry != "generation/launch.py" or not co_decode_enabled(_run_config(run_dir)):
        return []
    names = list(read_json(run_dir / f"iter_{i}" / "plan.json"))
    later = [(i, n) for n in names[names.index(stage) + 1:] if STAGES[n].entry == row.entry]
    nxt = run_dir / f"iter_{i + 1}" / "plan.json"
    for n in (list(read_json(nxt)) if nxt.is_file() else []):
        if STAGES[n].entry != row.entry:
            break  # only the stages that open the next iteration: the rest need its trained model
        later.append((i + 1, n))
    if not later:
        return []
    own = _stage_entry(run_dir, i, stage)
    d = yaml.safe_load(Path(own["config"]).read_text(encoding="utf-8"))
    key = _eval_cache_key(run_dir, i, stage, own, d)
    if key and eval_cache.lookup(key) is not None:
        return []  # its turn copies it from the evaluation cache: no engine starts
    from ..stages.launch import gpu_ids

    in_process = engine_in_process(int(d.get("num_shards") or 1), int(d.get("tensor_parallel_size") or 1), gpu_ids())
    out = []
    for ci, name in later:
        e = _stage_entry(run_dir, ci, name)
        dn = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
        if ci != i and dn.get("model") != d.get("model"):
            continue  # the next iteration samples from another policy
        if stale_reason(run_dir, ci, name) is None or _record_valid(run_dir, ci, name):
            continue  # done, or decoded by an earlier launch
        key = _eval_cache_key(run_dir, ci, name, e, dn)
        if key and eval_cache.lookup(key) is not None:
            continue  # its turn copies it from the evaluation cache
        missing = [p for p in e["inputs"] if not _output_present(Path(p))]
        why = (f"its input {missing[0]} does not exist yet" if missing
               else refusal(d, dn, in_process))
        if why:
            print(f"co-decoding: stage {name} of iteration {ci} runs with its own engine start: {why}.", flush=True)
            continue
        out.append((ci, name))
    if out:
        said = [", ".join(n for ci, n in out if ci == it) + f" of iteration {it}"
                for it in sorted({ci for ci, _ in out})]
        print(f"co-decoding: stage {stage} also decodes {' and '.join(said)} with the same engine start (each keeps "
              "its own output, stats and .done)", flush=True)
    return out


def _co_decode(run_dir: Path, i: int, stage: str, companions: list[tuple[int, str]], argv: list[str],
               env: dict) -> None:
    """Run the launcher for ``stage`` and its ``companions`` (``(iteration, stage)`` pairs) as a child
    (killed with this process), then record each companion whose output it wrote
    (:func:`_co_decode_record`, with the hash of the companion's config and inputs taken before the
    launch). Each companion's record, output and
    stats are removed first (the companion is stale: they are rewritten or it runs alone), so a
    record only ever names an output this launch wrote; an interrupted launch leaves none.

    Raises:
        SystemExit: the launcher's exit status when ``stage``'s own output was not written.
    """
    from ..procs import start_guarded
    from ..stages.launch import LATER_CONFIG_FAILED

    hashes = {}
    for ci, c in companions:
        _co_decode_record(run_dir, ci, c).unlink(missing_ok=True)
        _overrides_record(run_dir, ci, c).unlink(missing_ok=True)  # rewritten from its own config now
        for o in _recorded_outputs(run_dir, ci, c):
            Path(o).unlink(missing_ok=True)
        hashes[ci, c] = stage_hash(run_dir, ci, c)
    t0 = time.monotonic()
    exe = argv[0] if os.sep in argv[0] else _which(argv[0])
    rc = start_guarded([exe, *argv[1:]], env={**os.environ, **env}).wait()
    seconds = round(time.monotonic() - t0, 2)
    for ci, c in companions:
        outs = _stage_entry(run_dir, ci, c)["outputs"]
        try:
            STAGES[c].stats.read(stats_path(outs[0]))
        except (FileNotFoundError, DataError):
            print(f"co-decoding: stage {c} of iteration {ci} was not written by this launch; it runs alone at its "
                  "turn.", flush=True)
            continue
        if all(_output_present(Path(o)) for o in outs):
            mark_done(_co_decode_record(run_dir, ci, c), hashes[ci, c], outputs=_recorded_outputs(run_dir, ci, c),
                      root=run_dir, co_decoded_by=stage, co_decoded_iteration=i, launch_seconds=seconds)
    if rc not in (0, LATER_CONFIG_FAILED):
        raise SystemExit(rc)


def _eval_cache_key(run_dir: Path, i: int, stage: str, e: dict, d: dict) -> str | None:
    """The evaluation-cache key of a stage (``online_rlhf.eval_cache``), or None when the stage is
    not cached here (not a ``cache_iteration_0`` row, not iteration 0, or the run turned it off)."""
    from .. import eval_cache

    if i != 0 or not STAGES[stage].cache_iteration_0 or not eval_cache.enabled(_run_config(run_dir)):
        return None
    return eval_cache.cache_key(stage, d, e["inputs"])


def _reuse_cached(run_dir: Path, i: int, stage: str, e: dict, d: dict) -> bool:
    """Copy the stage's output from the evaluation cache when it holds it; True when it did."""
    from .. import eval_cache

    key = _eval_cache_key(run_dir, i, stage, e, d)
    entry = eval_cache.lookup(key) if key else None
    if entry is None:
        return False
    out = Path(e["outputs"][0])
    source = eval_cache.restore(entry, out, stats_path(out), STAGES[stage].stats,
                                inputs={k: d[k] for k in ("model", "prompts") if isinstance(d.get(k), str)})
    print(f"stage {stage} of iteration {i}: the same starting policy, prompts and settings were evaluated before; "
          f"reused {source} (evaluation cache {entry}; eval_cache=false decodes afresh)", flush=True)
    return True


def _which(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if not found:
        raise ConfigError(f"{name}: not found on PATH (launcher=slurm needs SLURM's srun: run inside an allocation).")
    return found


def _run_launcher(run_dir: Path) -> str:
    """The run's ``launcher`` key (``<run>/config.yaml``); ``local`` for a run planned before the key."""
    try:
        return (yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}).get("launcher", "local")
    except FileNotFoundError:
        return "local"


def _run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def previous_stage(run_dir: Path, i: int, stage: str) -> tuple[int, str] | None:
    """The stage that machine 0 runs just before ``stage`` of iteration ``i`` (run_loop.sh's order:
    the plan.json order within an iteration, iterations in turn); None for the run's first stage."""
    names = list(read_json(run_dir / f"iter_{i}" / "plan.json"))
    at = names.index(stage)
    if at > 0:
        return i, names[at - 1]
    for j in range(i - 1, -1, -1):
        earlier = list(read_json(run_dir / f"iter_{j}" / "plan.json"))
        if earlier:
            return j, earlier[-1]
    return None


def _last_activity(run_dir: Path) -> float:
    """Newest modification time of what machine 0's loop writes as it goes: the stages' logs and
    ``.done`` markers (0.0 when there is none yet)."""
    times = [p.stat().st_mtime for pat in ("iter_*/logs/*.log", "iter_*/*.done") for p in run_dir.glob(pat)]
    return max(times, default=0.0)


def _wait_for_previous_stage(run_dir: Path, i: int, stage: str, poll_s: float) -> None:
    """Wait until machine 0 has finished the stage before ``stage`` (:func:`previous_stage`).

    Gives up when machine 0 has written nothing in the run directory (no stage log grew, no stage
    was marked done) for ``$ONLINE_RLHF_WAIT_TIMEOUT_S`` seconds (default 3600; 0 = wait for ever):
    its loop has failed or was stopped, and this machine would poll for ever.

    Raises:
        TimeoutError: naming the stage waited for, the silence and how to go on.
    """
    prev = previous_stage(run_dir, i, stage)
    if prev is None:
        return
    timeout_s = float(os.environ.get("ONLINE_RLHF_WAIT_TIMEOUT_S", "3600"))
    t0, said = time.monotonic(), -1.0
    while not check(run_dir, *prev):
        waited = time.monotonic() - t0
        silent = time.time() - max(_last_activity(run_dir), time.time() - waited)
        if timeout_s > 0 and silent > timeout_s:
            raise TimeoutError(
                f"waited {waited:.0f} s for machine 0 to finish stage {prev[1]} of iteration {prev[0]}, and machine 0 "
                f"has written nothing in {run_dir} (no stage log, no .done) for {silent:.0f} s: its run_loop.sh has "
                "failed or was stopped (see its console and iter_*/logs/). Rerun it on machine 0, then this "
                "machine's command again (ONLINE_RLHF_WAIT_TIMEOUT_S sets this limit; 0 waits for ever).")
        if said < 0 or waited - said >= 60:
            print(f"waiting for machine 0 to finish stage {prev[1]} of iteration {prev[0]} "
                  f"({waited:.0f} s so far)", flush=True)
            said = waited
        time.sleep(poll_s)


def _marker(run_dir: Path, i: int, stage: str) -> Path:
    return run_dir / f"iter_{i}" / f"{stage}.done"


def check(run_dir: Path, i: int, stage: str) -> bool:
    """True when the stage is done and fresh (:func:`stale_reason` gives None)."""
    return stale_reason(run_dir, i, stage) is None


def _recorded_outputs(run_dir: Path, i: int, stage: str) -> list[str]:
    """The files and folders whose size and hash ``<stage>.done`` records: the stage's outputs and
    its stats file."""
    outs = _stage_entry(run_dir, i, stage)["outputs"]
    return [*outs, str(stats_path(outs[0]))] if outs else []


def stale_reason(run_dir: Path, i: int, stage: str) -> str | None:
    """Why the stage must run (one line), or None when it is done and fresh: its ``.done`` exists,
    its hash matches (config and inputs unchanged), its outputs exist (a checkpoint folder only
    counts with its weights: ``*.safetensors`` or ``pytorch_model*.bin``) and are the ones it wrote
    (size and hash as recorded in ``.done``: an output cut or edited after the stage finished makes
    it run again, instead of later stages using it silently), and its stats file reads back through
    the stage's stats class (a stage whose stats are missing or broken runs again, rather than
    stopping ``metrics`` later)."""
    e = _stage_entry(run_dir, i, stage)
    marker = _marker(run_dir, i, stage)
    if not marker.is_file():
        return "not run yet"
    if not is_done(marker, stage_hash(run_dir, i, stage)):
        parts = changed_parts(run_dir, i, stage)
        shown = "; ".join(parts[:4])
        if len(parts) > 4:  # the rest by name only
            shown += f"; and {len(parts) - 4} more: " + ", ".join(q.split(":")[0] for q in parts[4:])
        return "its config or inputs changed since it finished" + (f" ({shown})" if parts else "")
    missing = [o for o in e["outputs"] if not _output_present(Path(o))]
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
        changed = changed_outputs(marker, _recorded_outputs(run_dir, i, stage), root=run_dir)
    except (FileNotFoundError, DataError):
        return f"its marker {marker} is not readable"
    if changed:
        return f"its output changed after the stage finished ({'; '.join(changed)})"
    return None


def output_hint(run_dir: Path, message: str) -> str | None:
    """For a stage's error ``message`` that names a line of a file another stage of the run wrote
    (``<file>:<line>``: its content is bad): which stage wrote it and how to regenerate it (the first
    such file named). None when it names none.

    A stage output that is not what its stage left (:func:`stale_reason`) is rewritten by rerunning
    the same command, since that stage then runs again; otherwise removing the file does it.
    """
    for plan_path in sorted(run_dir.glob("iter_*/plan.json"), key=lambda p: int(p.parent.name.split("_")[1])):
        i = int(plan_path.parent.name.split("_")[1])
        try:
            entries = read_json(plan_path)
        except (FileNotFoundError, DataError):
            continue
        for stage, e in entries.items():
            for o in e.get("outputs", []):
                if o and re.search(re.escape(o) + r":\d+", message):  # names a line of it: its content is bad
                    why = stale_reason(run_dir, i, stage)
                    how = (f"rerun the same command: stage {stage} runs again first ({why}) and rewrites it"
                           if why is not None else f"remove it (rm -r {shlex.quote(o)}) and rerun the same command: "
                           f"stage {stage} runs again and rewrites it")
                    return f"{o} is the output of stage {stage} of iteration {i}; do not edit it by hand: {how}."
    return None


def _output_present(path: Path) -> bool:
    if not path.exists():
        return False
    if path.is_dir() and (path / "config.json").is_file():
        return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return True


def mark(run_dir: Path, i: int, stage: str, seconds: float) -> None:
    """Write the stage's ``.done``: its config-and-inputs hash (with the config values and one digest
    per input, so that :func:`changed_parts` can name what changed), the size and hash of its outputs
    and stats file as they are now (:func:`stale_reason` compares them on the next run), the seconds
    (and ``co_decoded_by`` when another stage's launch decoded its output: its co-decode record,
    removed now). A stage of the evaluation cache (``online_rlhf.eval_cache``) also stores its
    output there.

    Raises:
        ConfigError: an output or the stats file is missing (the stage has not run, or failed), the
            stage's last ``loop exec`` had overrides (:func:`_record_overrides`), or the stats file does not read as the stage's stats class (a file from another stage or an
            older version, or edited by hand): nothing is marked.
    """
    missing = [p for p in _recorded_outputs(run_dir, i, stage) if not _output_present(Path(p))]
    if missing:
        raise ConfigError(f"mark: {stage} of iteration {i} has no {missing[0]}; run it first (`python -m "
                          f"online_rlhf.loop exec {run_dir} {i} {stage}`). Nothing was marked.")
    rec = _overrides_record(run_dir, i, stage)
    if rec.is_file():
        kept = " ".join(read_json(rec).get("overrides") or [])
        raise ConfigError(f"mark: {stage} of iteration {i} last ran as `loop exec {run_dir} {i} {stage} {kept}`; "
                          "those overrides are in neither its config file nor its freshness hash, so a marker would "
                          "record outputs made with other settings as fresh. Put the settings in the loop config "
                          f"(e.g. `bash run_loop.sh CONFIG key=value`), or rerun `loop exec {run_dir} {i} {stage}` "
                          f"without them (the record {rec.name} goes then). Nothing was marked.")
    e = _stage_entry(run_dir, i, stage)
    try:  # a marker over stats that the next check refuses would only make that check rerun the stage
        STAGES[stage].stats.read(stats_path(e["outputs"][0]))
    except DataError as err:
        raise ConfigError(f"mark: {stage} of iteration {i}: {err} Rerun the stage (`python -m online_rlhf.loop exec "
                          f"{run_dir} {i} {stage}`), which writes it anew. Nothing was marked.") from None
    record, info, digest = _co_decode_record(run_dir, i, stage), {}, stage_hash(run_dir, i, stage)
    if _record_valid(run_dir, i, stage, digest):  # decoded in another stage's launch (co-decoding)
        rec = read_json(record)
        info["co_decoded_by"] = rec.get("co_decoded_by")
        info["co_decoded_iteration"] = rec.get("co_decoded_iteration", i)
    mark_done(_marker(run_dir, i, stage), digest, outputs=_recorded_outputs(run_dir, i, stage),
              root=run_dir, seconds=round(seconds, 2), **info, **_hash_parts(run_dir, e))
    record.unlink(missing_ok=True)
    key = _eval_cache_key(run_dir, i, stage, e, yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8")))
    if key:
        from .. import eval_cache

        out = Path(e["outputs"][0])
        eval_cache.store(key, out, stats_path(out), run_dir)


def stage_lines(run_dir: Path, i: int) -> list[str]:
    """``loop stages``: iteration ``i``'s planned stages in the stage table's order (``plan.json``),
    one line each, ``"<name> after"`` for a row with an ``after`` hook (``run_loop.sh`` and
    ``scripts/other_machine.sh`` go through them in this order).

    Raises:
        FileNotFoundError, DataError: the iteration's ``plan.json`` is missing or not valid.
    """
    return [name + (" after" if STAGES[name].after is not None else "")
            for name in read_json(run_dir / f"iter_{i}" / "plan.json")]


def after_line(run_dir: Path, i: int, stage: str) -> str | None:
    """``loop after``: the line that stops the loop after ``stage`` of iteration ``i``, from the
    row's ``after`` hook (e.g. pairs: 0 pairs made); None to go on (or the row has no hook)."""
    hook = STAGES[stage].after
    return hook(run_dir, i) if hook is not None else None
