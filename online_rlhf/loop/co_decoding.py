"""The loop's side of co-decoding (``online_rlhf.co_decode`` says which generation configs may share
one vLLM engine start): which later generation stages a launching stage takes along
(:func:`co_decode_companions`), running the launcher for all of them as a child of ``loop exec``
(:func:`co_decode`), and the record that marks a companion's output as decoded for its current
hash (:func:`co_decode_record`, :func:`record_valid`), which ``loop check``, ``exec`` and ``mark``
read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

from ..jsonl import DataError, read_json
from ..rundir import changed_outputs, is_done, mark_done
from ..stage_table import STAGES
from ..stats import stats_path
from .freshness import (eval_cache_key, output_present, overrides_record, recorded_outputs, run_config, stage_entry,
                        stage_hash, stale_reason)


def co_decode_enabled(run_config: dict) -> bool:
    """Whether a run co-decodes: its ``co_decode`` key (default true) and ``ONLINE_RLHF_CO_DECODE``
    not ``0``."""
    return os.environ.get("ONLINE_RLHF_CO_DECODE", "1") != "0" and bool(run_config.get("co_decode", True))


def co_decode_record(run_dir: Path, i: int, stage: str) -> Path:
    """``iter_<i>/<stage>.co_decoded``: written when another stage's launch decoded this stage's
    output; the hash of this stage's config and inputs it was decoded for, and its outputs' sizes
    and hashes (the format of a ``.done`` marker)."""
    return run_dir / f"iter_{i}" / f"{stage}.co_decoded"


def record_valid(run_dir: Path, i: int, stage: str, digest: str | None = None) -> bool:
    """Whether the stage's co-decode record holds for the stage as it is now: written for its
    current hash (``digest`` when the caller has it), its outputs present and unchanged since, its
    stats readable."""
    record = co_decode_record(run_dir, i, stage)
    if not record.is_file() or not is_done(record, digest or stage_hash(run_dir, i, stage)):  # no hashing without one
        return False
    e = stage_entry(run_dir, i, stage)
    if not all(output_present(Path(o)) for o in e["outputs"]):
        return False
    try:
        STAGES[stage].stats.read(stats_path(e["outputs"][0]))
        return not changed_outputs(record, recorded_outputs(run_dir, i, stage), root=run_dir)
    except (FileNotFoundError, DataError):
        return False


def _co_decoder(run_dir: Path, i: int, stage: str) -> tuple[str, int] | None:
    """``(stage, iteration)`` whose launch already decoded this stage's output for its current config
    and inputs (:func:`record_valid`), or None."""
    if not record_valid(run_dir, i, stage):
        return None
    record = read_json(co_decode_record(run_dir, i, stage))
    return record.get("co_decoded_by"), int(record.get("co_decoded_iteration", i))


def co_decoded_note(run_dir: Path, i: int, stage: str) -> str | None:
    """For ``loop check``: a line saying that another stage's launch already decoded this stage's
    output for its current config and inputs (``loop exec`` will only mark it done), or None."""
    by = _co_decoder(run_dir, i, stage)
    return None if by is None else (f"its output is already decoded (co-decoded in the engine start of stage "
                                    f"{by[0]} of iteration {by[1]}): `loop exec` only marks it done")


def co_decoded_before(run_dir: Path, i: int, stage: str) -> bool:
    """True (and says so) when an earlier stage's launch already decoded this stage's output for its
    current config and inputs (:func:`record_valid`): nothing to run; ``loop mark`` then marks it."""
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
    if row.entry != "generation/launch.py" or not co_decode_enabled(run_config(run_dir)):
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
    own = stage_entry(run_dir, i, stage)
    d = yaml.safe_load(Path(own["config"]).read_text(encoding="utf-8"))
    key = eval_cache_key(run_dir, i, stage, own, d)
    if key and eval_cache.lookup(key) is not None:
        return []  # its turn copies it from the evaluation cache: no engine starts
    from ..stages.launch import gpu_ids

    in_process = engine_in_process(int(d.get("num_shards") or 1), int(d.get("tensor_parallel_size") or 1), gpu_ids())
    out = []
    for ci, name in later:
        e = stage_entry(run_dir, ci, name)
        dn = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
        if ci != i and dn.get("model") != d.get("model"):
            continue  # the next iteration samples from another policy
        if stale_reason(run_dir, ci, name) is None or record_valid(run_dir, ci, name):
            continue  # done, or decoded by an earlier launch
        key = eval_cache_key(run_dir, ci, name, e, dn)
        if key and eval_cache.lookup(key) is not None:
            continue  # its turn copies it from the evaluation cache
        missing = [p for p in e["inputs"] if not output_present(Path(p))]
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


def co_decode(run_dir: Path, i: int, stage: str, companions: list[tuple[int, str]], argv: list[str],
               env: dict) -> None:
    """Run the launcher for ``stage`` and its ``companions`` (``(iteration, stage)`` pairs) as a child
    (killed with this process; ``argv[0]`` the launcher's executable path), then record each companion whose output it wrote
    (:func:`co_decode_record`, with the hash of the companion's config and inputs taken before the
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
        co_decode_record(run_dir, ci, c).unlink(missing_ok=True)
        overrides_record(run_dir, ci, c).unlink(missing_ok=True)  # rewritten from its own config now
        for o in recorded_outputs(run_dir, ci, c):
            Path(o).unlink(missing_ok=True)
        hashes[ci, c] = stage_hash(run_dir, ci, c)
    t0 = time.monotonic()
    rc = start_guarded(argv, env={**os.environ, **env}).wait()
    seconds = round(time.monotonic() - t0, 2)
    for ci, c in companions:
        outs = stage_entry(run_dir, ci, c)["outputs"]
        try:
            STAGES[c].stats.read(stats_path(outs[0]))
        except (FileNotFoundError, DataError):
            print(f"co-decoding: stage {c} of iteration {ci} was not written by this launch; it runs alone at its "
                  "turn.", flush=True)
            continue
        if all(output_present(Path(o)) for o in outs):
            mark_done(co_decode_record(run_dir, ci, c), hashes[ci, c], outputs=recorded_outputs(run_dir, ci, c),
                      root=run_dir, co_decoded_by=stage, co_decoded_iteration=i, launch_seconds=seconds)
    if rc not in (0, LATER_CONFIG_FAILED):
        raise SystemExit(rc)
