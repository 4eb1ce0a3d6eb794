"""Running the planned stages: ``loop exec``, ``mark``, ``stages``, ``after`` and ``output-hint``
(``check``: :mod:`.freshness`; ``dry-run``: :mod:`.memory_check`).

``exec`` starts a stage from its YAML (on machine k > 0 after the stage before it in machine 0's
run; a generation stage with the later ones that share its engine: :mod:`.co_decoding`), ``mark``
records it done once :func:`online_rlhf.loop.freshness.stale_reason` would call it fresh.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from pathlib import Path

import yaml

from ..config import ConfigError
from ..jsonl import DataError, read_json, write_json
from ..paths import PROJECT_ROOT
from ..rundir import mark_done
from ..stage_launch import launch_command, stage_machines
from ..stage_table import STAGES
from ..stats import stats_path
from .co_decoding import co_decode, co_decode_companions, co_decode_record, co_decoded_before, record_valid
from .freshness import (check, done_marker, eval_cache_key, hash_parts, output_present, overrides_record,
                        recorded_outputs, stage_entry, stage_hash, stale_reason)


def exec_stage(run_dir: Path, i: int, stage: str, overrides: list[str] = (), machine_rank: int = 0,
               wait_poll_s: float = 10.0) -> None:
    """Replace this process by the command that runs ``stage`` of iteration ``i``, built from the
    stage's config file by :func:`online_rlhf.stage_launch.launch_command` (the command written on
    top of that file; the run's ``launcher`` from ``<run>/config.yaml``), from the project root.
    Prints the command first (it heads the stage's log).

    On machine ``machine_rank`` k > 0 (``num_machines`` > 1, ``launcher: local``): a stage that runs
    on machine 0 only returns at once (nothing to run here); a stage that is already done and fresh
    returns too; otherwise it first waits until the stage before it in machine 0's run is done and
    fresh (its inputs are then written), so that machine k can run every stage of the run in order
    (docs/multi-node.md) and meet machine 0 at each distributed one.

    Co-decoding (machine 0, no overrides; :func:`co_decode_companions`): a generation stage whose
    output an earlier stage's launch already wrote for its current hash runs nothing
    (:func:`co_decoded_before`); one that launches takes the later generation stages of the
    iteration (and the next iteration's rollouts) that can share its engine along, runs the launcher
    as a child instead of replacing this process, and records their outputs (:func:`co_decode`).

    Args:
        overrides: ``key=value`` arguments appended to the stage's command (e.g. ``dry_run=true``);
            they change this run only, not the stage's config file or its freshness hash, so
            :func:`mark` refuses the stage until it runs again without them.
    Raises:
        ConfigError: no such stage in the iteration's plan.json; ``machine_rank`` outside the stage's
            machines; a rank > 0 under ``launcher: slurm`` (srun starts every node's part).
    """
    e = stage_entry(run_dir, i, stage)
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
        wait_for_previous_stage(run_dir, i, stage, wait_poll_s)
        if check(run_dir, i, stage):
            print(f"stage {stage} of iteration {i} is done and fresh; nothing to run on machine {machine_rank}.")
            return
    if machine_rank == 0:
        _record_overrides(run_dir, i, stage, overrides)
    if machine_rank == 0 and not overrides and reuse_cached(run_dir, i, stage, e, d):
        return
    if machine_rank == 0 and not overrides and co_decoded_before(run_dir, i, stage):
        return
    companions = co_decode_companions(run_dir, i, stage) if machine_rank == 0 and not overrides else []
    argv, env = launch_command(STAGES[stage], e["config"], d, machine_rank=machine_rank, launcher=launcher,
                               extra=list(overrides))
    if companions:
        argv = [*argv, *(a for ci, c in companions for a in ("--config", stage_entry(run_dir, ci, c)["config"]))]
    print("+ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, argv)]), flush=True)
    os.chdir(PROJECT_ROOT)
    exe = argv[0] if os.sep in argv[0] else _which(argv[0])
    if companions:
        co_decode(run_dir, i, stage, companions, [exe, *argv[1:]], env)
        return
    os.execve(exe, argv, {**os.environ, **env})


def _record_overrides(run_dir: Path, i: int, stage: str, overrides) -> None:
    """Before a launch on machine 0: record the overrides that are not in the stage's config file nor
    its freshness hash (``dry_run=`` aside: a dry run writes no output), or remove the record when
    there are none, so that :func:`mark` can refuse outputs made with unrecorded settings."""
    kept = [o for o in overrides if o.split("=", 1)[0].strip() != "dry_run"]
    path = overrides_record(run_dir, i, stage)
    if kept:
        write_json(path, {"overrides": kept})
    else:
        path.unlink(missing_ok=True)


def reuse_cached(run_dir: Path, i: int, stage: str, e: dict, d: dict) -> bool:
    """Copy the stage's output from the evaluation cache when it holds it; True when it did."""
    from .. import eval_cache

    key = eval_cache_key(run_dir, i, stage, e, d)
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


def wait_for_previous_stage(run_dir: Path, i: int, stage: str, poll_s: float) -> None:
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
    missing = [p for p in recorded_outputs(run_dir, i, stage) if not output_present(Path(p))]
    if missing:
        raise ConfigError(f"mark: {stage} of iteration {i} has no {missing[0]}; run it first (`python -m "
                          f"online_rlhf.loop exec {run_dir} {i} {stage}`). Nothing was marked.")
    rec = overrides_record(run_dir, i, stage)
    if rec.is_file():
        kept = " ".join(read_json(rec).get("overrides") or [])
        raise ConfigError(f"mark: {stage} of iteration {i} last ran as `loop exec {run_dir} {i} {stage} {kept}`; "
                          "those overrides are in neither its config file nor its freshness hash, so a marker would "
                          "record outputs made with other settings as fresh. Put the settings in the loop config "
                          f"(e.g. `bash run_loop.sh CONFIG key=value`), or rerun `loop exec {run_dir} {i} {stage}` "
                          f"without them (the record {rec.name} goes then). Nothing was marked.")
    e = stage_entry(run_dir, i, stage)
    try:  # a marker over stats that the next check refuses would only make that check rerun the stage
        STAGES[stage].stats.read(stats_path(e["outputs"][0]))
    except DataError as err:
        raise ConfigError(f"mark: {stage} of iteration {i}: {err} Rerun the stage (`python -m online_rlhf.loop exec "
                          f"{run_dir} {i} {stage}`), which writes it anew. Nothing was marked.") from None
    record, info, digest = co_decode_record(run_dir, i, stage), {}, stage_hash(run_dir, i, stage)
    if record_valid(run_dir, i, stage, digest):  # decoded in another stage's launch (co-decoding)
        rec = read_json(record)
        info["co_decoded_by"] = rec.get("co_decoded_by")
        info["co_decoded_iteration"] = rec.get("co_decoded_iteration", i)
    mark_done(done_marker(run_dir, i, stage), digest, outputs=recorded_outputs(run_dir, i, stage),
              root=run_dir, seconds=round(seconds, 2), **info, **hash_parts(run_dir, e))
    record.unlink(missing_ok=True)
    key = eval_cache_key(run_dir, i, stage, e, yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8")))
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
