"""Where the time of one loop iteration goes, from a run directory's markers, stats and logs.

    .venv-train/bin/python -m bench.iteration_breakdown RUN_DIR [--iteration I] [--json]

Reads ``RUN_DIR/iter_<I>/`` (default: the last iteration with a ``dpo.done``):
- ``<stage>.done``: each stage's wall seconds as run_loop.sh measured them (whole seconds, process
  start-up and model loading included) and ``finished_at``;
Stats files are read through their classes in ``online_rlhf.stats`` (a missing or renamed key is an
error naming the file):
- ``generated.jsonl.stats.json`` / ``eval_generated.jsonl.stats.json``: ``engine_startup_s`` (vLLM
  engine start-up, model load into vLLM included) and ``generation_s`` (generation/generate.py);
- ``rewards.jsonl.stats.json`` / ``eval.jsonl.stats.json``: ``seconds`` of scoring
  (annotate_data/get_rewards.py: reading the records, importing the reward source, scoring, writing);
- ``pairs.jsonl.stats.json``: ``seconds`` of pair building (annotate_data/make_pairs.py);
- ``model.stats.json``: ``seconds.{total, model_loading, trainer_init, reference_precompute,
  train_steps, save}`` (dpo_iteration/run_dpo.py; the reference pass runs inside trainer_init);
- ``generated/shard_00.log``: vLLM's own log, to split the engine start-up into its phases.

and splits the iteration into: process start-up and model loading (each stage's wall time not
accounted for by its own timers: interpreter start, imports, ``accelerate launch``, tokenizer and
model loading, TRL trainer set-up, writing outputs), vLLM start-up, generation, scoring, pair
building, the DPO reference pass, DPO optimizer steps, checkpoint save, the loop's bookkeeping
between stages (``python -m online_rlhf.loop check/mark/metrics``: the gap between consecutive
markers' ``finished_at`` not covered by stage seconds; left out when the run was resumed or paused)
and held-out evaluation (``eval_generate`` + ``eval_rewards``, shown whole).

Work = generation + scoring + the DPO reference pass + optimizer steps (what grows with the data;
the reference pass is the reference model's half of the DPO loss, computed once before the
steps). Fixed overhead = everything else. Two figures are printed: over the training part of the
iteration (generate -> dpo, the part the iteration-vs-TRL benchmark times) and over the whole
iteration with evaluation counted as overhead. Shares add up to 100% of the iteration.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path


from online_rlhf.jsonl import DataError, read_json
from online_rlhf.stats import DPOStats, GenerateStats, PairsStats, RewardStats, StageStats, stats_path

CATEGORIES = {  # key -> label, in print order
    "startup_loading": "process start-up and model loading",
    "vllm_startup": "vLLM engine start-up",
    "generation": "generation",
    "scoring": "scoring (rewards)",
    "pair_building": "pair building",
    "reference_pass": "DPO reference pass",
    "dpo_steps": "DPO optimizer steps",
    "checkpoint_save": "checkpoint save",
    "loop_bookkeeping": "loop bookkeeping between stages",
    "evaluation": "held-out evaluation",
}
WORK = ("generation", "scoring", "reference_pass", "dpo_steps")
TRAIN_STAGES = ("generate", "rewards", "pairs", "dpo")
EVAL_STAGES = ("eval_generate", "eval_rewards")


class BreakdownError(ValueError):
    """A file the breakdown needs is missing or unreadable (the message names it)."""


def _read_json(path: Path) -> dict:
    try:
        return read_json(path)
    except FileNotFoundError:
        raise BreakdownError(f"{path}: missing. Is this a finished iteration of a run_loop.sh run directory?") from None
    except DataError as e:
        raise BreakdownError(str(e)) from None


def _stage_stats(cls: type[StageStats], it: Path, output: str):
    """The stats of the stage whose output is ``it/output``, read through its class."""
    try:
        return cls.read(stats_path(it / output))
    except FileNotFoundError:
        raise BreakdownError(f"{stats_path(it / output)}: missing. Is this a finished iteration of a run_loop.sh "
                             "run directory?") from None
    except DataError as e:
        raise BreakdownError(str(e)) from None


def _s(v: float | None) -> float:
    """Seconds, 0 for None (e.g. engine_startup_s of a shard that had no prompt and started no engine)."""
    return 0.0 if v is None else float(v)


def _num(d: dict, key: str, where: Path) -> float:
    v = d.get(key)
    if v is None:
        return 0.0  # e.g. engine_startup_s is null when a shard had no prompt and started no engine
    if not isinstance(v, (int, float)):
        raise BreakdownError(f"{where}: {key!r} is {v!r}, expected seconds.")
    return float(v)


def _finished_at(marker: Path) -> datetime | None:
    try:
        return datetime.strptime(_read_json(marker)["finished_at"], "%Y-%m-%dT%H:%M:%S")
    except (BreakdownError, KeyError, ValueError):
        return None


_LOG_TIME = re.compile(r"^\((\w+)(?:-\d+)? pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")
_LOG_START = re.compile(r"^=== (\d{4})-(\d\d-\d\d \d\d:\d\d:\d\d) ===$")


def vllm_startup_detail(log_path: Path) -> dict | None:
    """Phases of the vLLM start-up from a shard log (the last attempt in it), whole seconds.

    Returns ``{"imports_s", "engine_core_spawn_s", "worker_spawn_s", "load_and_kv_cache_s"}``: shard
    process start (the launcher's ``=== time ===`` line) -> first log line of the main process
    (Python, torch, vLLM, transformers imported) -> first line of the EngineCore process ->
    first line of the Worker process -> vLLM's "init engine ... took" line (weights loaded, KV cache
    allocated, warm-up done). None when the log is missing or lacks a phase.
    """
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    lines = text.replace("\r", "\n").splitlines()
    starts = [i for i, x in enumerate(lines) if _LOG_START.match(x)]
    if not starts:
        return None
    m = _LOG_START.match(lines[starts[-1]])
    year = m.group(1)
    t0 = datetime.strptime(f"{year}-{m.group(2)}", "%Y-%m-%d %H:%M:%S")
    first: dict[str, datetime] = {}
    init_done = None
    for x in lines[starts[-1] + 1:]:
        m = _LOG_TIME.match(x)
        if not m:
            continue
        who = {"VllmWorker": "Worker"}.get(m.group(1), m.group(1))
        t = datetime.strptime(f"{year}-{m.group(2)}", "%Y-%m-%d %H:%M:%S")
        first.setdefault(who, t)
        if init_done is None and "init engine" in x and "took" in x:
            init_done = t
    if not all(k in first for k in ("MainProcess", "EngineCore", "Worker")) or init_done is None:
        return None
    marks = [t0, first["MainProcess"], first["EngineCore"], first["Worker"], init_done]
    keys = ("imports_s", "engine_core_spawn_s", "worker_spawn_s", "load_and_kv_cache_s")
    return {k: (b - a).total_seconds() for k, a, b in zip(keys, marks, marks[1:])}


def breakdown(run_dir: str | Path, iteration: int | None = None) -> dict:
    """Seconds and shares of iteration ``iteration`` of a run directory (see the module docstring).

    Returns:
        dict with ``iteration``; ``seconds`` and ``shares`` (category -> seconds / fraction of
        ``total_s``, adding up to ``total_s`` / 1.0); ``total_s``; ``training_s`` (generate -> dpo
        and its share of the bookkeeping); ``work_s``; ``training_overhead_s`` /
        ``training_overhead_share`` (fixed overhead of the training part); ``overhead_s`` /
        ``overhead_share`` (whole iteration, evaluation counted as overhead); ``stage_seconds``
        (the markers); ``eval_detail``; ``vllm_startup_detail`` (or None); ``notes``.
    Raises:
        BreakdownError: the run directory lacks a marker or stats file of a training stage.
    """
    run_dir = Path(run_dir)
    if iteration is None:
        done = sorted(int(p.parent.name.split("_")[1]) for p in run_dir.glob("iter_*/dpo.done"))
        if not done:
            raise BreakdownError(f"{run_dir}: no iter_*/dpo.done; no finished iteration to break down.")
        iteration = done[-1]
    it = run_dir / f"iter_{iteration}"
    notes: list[str] = []
    sec = {k: 0.0 for k in CATEGORIES}
    markers = {s: _read_json(it / f"{s}.done") for s in TRAIN_STAGES}
    stage_s = {s: _num(markers[s], "seconds", it / f"{s}.done") for s in TRAIN_STAGES}

    def rest(stage: str, accounted: float) -> float:
        r = stage_s[stage] - accounted
        if r < -1.0:  # markers hold whole seconds; more than rounding means the files disagree
            notes.append(f"{stage}: its own timers ({accounted:.1f} s) exceed its marker ({stage_s[stage]:.0f} s).")
        return max(0.0, r)

    g = _stage_stats(GenerateStats, it, "generated.jsonl")
    sec["vllm_startup"] += _s(g.engine_startup_s)
    sec["generation"] += _s(g.generation_s)
    by = markers["generate"].get("co_decoded_by")
    if by:  # decoded in an earlier stage's launch: its marker holds only the turn that found the record
        at = markers["generate"].get("co_decoded_iteration", iteration)
        notes.append(f"generate: decoded in the engine start of {by} of iteration {at} (co-decoding); its decode "
                     "seconds are its stats', its process and engine start are counted in that stage.")
    else:
        sec["startup_loading"] += rest("generate", _s(g.engine_startup_s) + _s(g.generation_s))

    r = _stage_stats(RewardStats, it, "rewards.jsonl").seconds
    sec["scoring"] += r
    sec["startup_loading"] += rest("rewards", r)

    r = _stage_stats(PairsStats, it, "pairs.jsonl").seconds
    sec["pair_building"] += r
    sec["startup_loading"] += rest("pairs", r)

    d = _stage_stats(DPOStats, it, "model").seconds
    ref, steps, save = d.reference_precompute, d.train_steps, d.save
    sec["reference_pass"] += ref
    sec["dpo_steps"] += steps
    sec["checkpoint_save"] += save
    sec["startup_loading"] += rest("dpo", ref + steps + save)

    eval_detail: dict = {}
    have_eval = [s for s in EVAL_STAGES if (it / f"{s}.done").exists()]
    for s in have_eval:
        stage_s[s] = _num(_read_json(it / f"{s}.done"), "seconds", it / f"{s}.done")
        sec["evaluation"] += stage_s[s]
    if len(have_eval) < len(EVAL_STAGES):
        notes.append(f"evaluation markers missing ({', '.join(s for s in EVAL_STAGES if s not in have_eval)}); "
                     "evaluation counted as far as it ran.")
    # evaluation may not have run yet (the breakdown of an iteration stopped after its DPO)
    if stats_path(it / "eval_generated.jsonl").exists():
        e = _stage_stats(GenerateStats, it, "eval_generated.jsonl")
        eval_detail["vllm_startup_s"] = _s(e.engine_startup_s)
        eval_detail["generation_s"] = _s(e.generation_s)
    if stats_path(it / "eval.jsonl").exists():
        eval_detail["scoring_s"] = _stage_stats(RewardStats, it, "eval.jsonl").seconds
    if eval_detail and "eval_generate" in stage_s:
        work = eval_detail.get("generation_s", 0.0) + eval_detail.get("scoring_s", 0.0)
        eval_detail["overhead_s"] = max(0.0, sec["evaluation"] - work)

    # Bookkeeping: time between the previous iteration's last marker and this one's, minus the stages.
    stages_here = [s for s in (*TRAIN_STAGES, *EVAL_STAGES) if s in stage_s]
    prev_it = run_dir / f"iter_{iteration - 1}"
    prev = [prev_it / f"{s}.done" for s in (*EVAL_STAGES[::-1], "dpo") if (prev_it / f"{s}.done").exists()]
    t_prev = _finished_at(prev[0]) if prev else None
    t_last = _finished_at(it / f"{stages_here[-1]}.done")
    gap = None
    if t_prev and t_last:
        gap = (t_last - t_prev).total_seconds() - sum(stage_s[s] for s in stages_here)
    if gap is not None and -2.0 * len(stages_here) <= gap <= max(120.0, 0.5 * sum(stage_s.values())):
        sec["loop_bookkeeping"] = max(0.0, gap)
    else:
        notes.append("loop bookkeeping not measurable from the markers (first iteration without a previous marker, "
                     "or the run was resumed/paused between stages); left out.")

    total = sum(sec.values())
    book_train = sec["loop_bookkeeping"] * len(TRAIN_STAGES) / len(stages_here)  # its stages' share of it
    training = sum(v for k, v in sec.items() if k not in ("evaluation", "loop_bookkeeping")) + book_train
    work = sum(sec[k] for k in WORK)
    detail = vllm_startup_detail(it / "generated" / "shard_00.log")
    return {
        "run_dir": str(run_dir), "iteration": iteration,
        "seconds": sec, "total_s": total,
        "shares": {k: (v / total if total else 0.0) for k, v in sec.items()},
        "training_s": training, "work_s": work,
        "training_overhead_s": training - work,
        "training_overhead_share": (training - work) / training if training else 0.0,
        "overhead_s": total - work,
        "overhead_share": (total - work) / total if total else 0.0,
        "stage_seconds": stage_s, "eval_detail": eval_detail, "vllm_startup_detail": detail, "notes": notes,
    }


def render(b: dict) -> str:
    """The breakdown as a text table."""
    out = [f"iteration {b['iteration']} of {b['run_dir']}: {b['total_s']:.0f} s "
           f"(training part generate->dpo {b['training_s']:.0f} s, evaluation {b['seconds']['evaluation']:.0f} s)",
           "  stage markers: " + ", ".join(f"{k} {v:.0f}" for k, v in b["stage_seconds"].items()), "",
           f"  {'':40s}{'seconds':>9s}{'share':>8s}"]
    for k, label in CATEGORIES.items():
        tag = "  work" if k in WORK else ""
        out.append(f"  {label:40s}{b['seconds'][k]:9.1f}{100 * b['shares'][k]:7.1f}%{tag}")
    out.append(f"  {'total':40s}{b['total_s']:9.1f}{100.0:7.1f}%")
    ok = "met" if b["training_overhead_share"] <= 0.15 else "NOT met"
    out += ["",
            f"  fixed overhead, training part (generate->dpo): {b['training_overhead_s']:.0f} s of {b['training_s']:.0f} s "
            f"= {100 * b['training_overhead_share']:.1f}%  (target <= 15%: {ok})",
            f"  fixed overhead, whole iteration with evaluation as overhead: {b['overhead_s']:.0f} s of "
            f"{b['total_s']:.0f} s = {100 * b['overhead_share']:.1f}%"]
    e = b["eval_detail"]
    if e:
        out.append("  evaluation: " + ", ".join(f"{k} {v:.1f}" for k, v in e.items()))
    vllm = b["seconds"]["vllm_startup"] + e.get("vllm_startup_s", 0.0)
    out.append(f"  vLLM engine start-ups this iteration (generation + evaluation): {vllm:.0f} s "
               f"= {100 * vllm / b['total_s'] if b['total_s'] else 0:.1f}% of the iteration")
    if b["vllm_startup_detail"]:
        out.append("  generation's vLLM start-up by phase (from its log, whole seconds): "
                   + ", ".join(f"{k} {v:.0f}" for k, v in b["vllm_startup_detail"].items()))
    out += [f"  note: {n}" for n in b["notes"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory written by run_loop.sh (runs/<name>)")
    ap.add_argument("--iteration", type=int, default=None, help="iteration (default: the last with dpo.done)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    try:
        b = breakdown(args.run_dir, args.iteration)
    except BreakdownError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(b, indent=1) if args.json else render(b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
