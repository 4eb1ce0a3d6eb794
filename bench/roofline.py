"""Benchmark: each model-running stage of a run against this machine's matrix-product limit.

    .venv-train/bin/python -m bench.roofline RUN_DIR [--gflops-fp32 G] [--gflops-bf16 G] [--json OUT]

For every iteration directory of ``RUN_DIR`` it reads the stages' stats (through their classes in
``online_rlhf.stats``) and ``<stage>.done`` markers (wall seconds, process start-up included) and
estimates the useful floating-point work of each stage that runs a model, with N the policy's
parameter count (counted once when the embedding and LM head are tied; the embedding lookup is
free but the LM head product is not, so 2N per token is the usual estimate, Kaplan et al. 2020,
arXiv 2001.08361, section 2.1):

- generation stages (``generate``, ``eval_generate``, ``kl_generate``, ``ifeval_generate``):
  decode 2N x generated tokens, prefill 2N x prompt tokens (each prompt once: its K samples share
  the prefix), over the stats' ``generation_s`` (engine start-up excluded);
- ``dpo``: optimizer steps 6N x sequence tokens x epochs (forward + backward) over ``train_steps``,
  and the precomputed reference pass 2N x sequence tokens over ``reference_precompute`` (without a
  precomputed reference the reference forward is inside the steps: 8N per token there);
- ``kl``: a forward of the policy and one of the reference, 2 x 2N x (prompt + response) tokens,
  over the stage's ``seconds`` (model loading included);
- rule-based scoring (the verifier), pairs and IFEval scoring run no model: not counted.

Sequence tokens exclude padding, so a stage's share of the limit (limit time / its own time) falls
with padding, small matrices (decode), memory-bound ops (softmax over the vocabulary, norms) and
Python overhead. The limit is the sustained GFLOP/s of 1024x1024 matmuls on every usable core in
the stage's dtype (bf16 for ``bfloat16`` and ``+ bf16 autocast``, else fp32), measured now with
``bench/bench_matmul.py``'s timer unless given; measure on the machine that made the run.

A line then gives the generation stages' summed wall over their summed decode seconds (what
process start, imports, engine start and tokenization add), with the shards' ``phase_s`` summed.
The last lines give the run's compute floor: the sum of every stage's limit time, i.e. the shortest
wall the run could take on this machine if every model-running stage ran at the matmul limit and
nothing else took time; the very last line is ``share of the limit: P% (...)``, the floor over the
stages' summed wall seconds, the one figure to compare a run with another. Stats written before the token counts existed lack them: such stages are
listed as not counted.
"""

from __future__ import annotations

import argparse
import sys
from functools import lru_cache
from pathlib import Path

from online_rlhf.jsonl import DataError, read_json, write_json
from online_rlhf.stats import DPOStats, GenerateStats, KLStats, stats_path

GENERATION_STAGES = {  # stage -> output file (its stats sit beside it)
    "generate": "generated.jsonl",
    "eval_generate": "eval_generated.jsonl",
    "kl_generate": "kl_generated.jsonl",
    "ifeval_generate": "ifeval_generated.jsonl",
}


@lru_cache(maxsize=None)
def parameter_count(model_path: str) -> int:
    """Parameters of the causal LM at ``model_path`` (a local dir or hub id), tied weights once.

    Built on the meta device from its config: no weights are read.
    Raises:
        FileNotFoundError: a local path (absolute, or starting with ``.``) that does not exist, e.g.
            a stage's stats naming a model folder of a run directory that was moved since.
        OSError: no config there.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_path.startswith(("/", ".")) and not Path(model_path).exists():
        raise FileNotFoundError(f"{model_path}: no such model folder. A stage's stats name it as it was when the "
                                "stage ran; if the run directory was moved or copied since, give the roofline the "
                                "run where it ran (re-planning a copy does not rewrite finished stages' stats).")
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def limit_dtype(hardware: dict | None) -> str:
    """``"bfloat16"`` when the stage computed in bf16 (weights or autocast), else ``"float32"``."""
    dtype = str((hardware or {}).get("dtype", ""))
    return "bfloat16" if "bfloat16" in dtype or "bf16" in dtype else "float32"


def _wall(it: Path, stage: str) -> float | None:
    try:
        return float(read_json(it / f"{stage}.done")["seconds"])
    except (FileNotFoundError, DataError, KeyError, TypeError, ValueError):
        return None


def _row(iteration: int, stage: str, part: str, tflop: float | None, seconds: float | None,
         dtype: str, wall: float | None, tokens: int | None, note: str = "") -> dict:
    return {"iteration": iteration, "stage": stage, "part": part, "tokens": tokens, "tflop": tflop,
            "seconds": seconds, "dtype": dtype, "wall_s": wall, "note": note}


def stage_rows(it: Path, iteration: int) -> list[dict]:
    """The FLOP estimates of one iteration directory's model-running stages (see the module docstring)."""
    rows = []
    for stage, output in GENERATION_STAGES.items():
        if not stats_path(it / output).exists():
            continue
        st = GenerateStats.read(stats_path(it / output))
        dtype, wall = limit_dtype(st.hardware), _wall(it, stage)
        if st.reused_from:  # copied from the evaluation cache: decoded by another run
            rows.append(_row(iteration, stage, "decode", None, None, dtype, wall, None,
                             f"from the evaluation cache ({st.reused_from}): not work of this run"))
            continue
        n = parameter_count(st.model) if st.model else 0
        rows.append(_row(iteration, stage, "decode", 2 * n * st.generated_tokens / 1e12, st.generation_s, dtype,
                         wall, st.generated_tokens))
        rows[-1]["phase_s"] = st.phase_s  # where the shards' seconds went (None in stats older than the key)
        if st.prompt_tokens is None:
            rows.append(_row(iteration, stage, "prefill", None, None, dtype, None, None,
                             "prompt_tokens missing (stats older than the key)"))
        else:
            rows.append(_row(iteration, stage, "prefill", 2 * n * st.prompt_tokens / 1e12, None, dtype, None,
                             st.prompt_tokens, "inside the decode seconds"))
    if stats_path(it / "model").exists():
        st = DPOStats.read(stats_path(it / "model"))
        n, dtype, wall = parameter_count(st.policy), limit_dtype(st.hardware), _wall(it, "dpo")
        if st.sequence_tokens is None or st.epochs is None:
            rows.append(_row(iteration, "dpo", "steps", None, st.seconds.train_steps, dtype, wall, None,
                             "sequence_tokens missing (stats older than the key)"))
        else:
            pre = st.reference.precomputed_log_probs
            per_token = 6 if pre else 8
            rows.append(_row(iteration, "dpo", "steps", per_token * n * st.sequence_tokens * st.epochs / 1e12,
                             st.seconds.train_steps, dtype, wall, round(st.sequence_tokens * st.epochs),
                             "" if pre else "reference forward inside the steps"))
            if pre:
                rows.append(_row(iteration, "dpo", "reference pass", 2 * n * st.sequence_tokens / 1e12,
                                 st.seconds.reference_precompute, limit_dtype(st.hardware), None, st.sequence_tokens))
    if stats_path(it / "kl.jsonl").exists():
        st = KLStats.read(stats_path(it / "kl.jsonl"))
        n, dtype, wall = parameter_count(st.policy), limit_dtype(st.hardware), _wall(it, "kl")
        tflop = None if st.tokens is None else 2 * 2 * n * st.tokens / 1e12
        rows.append(_row(iteration, "kl", "policy + reference", tflop, st.seconds, dtype, wall, st.tokens,
                         "" if st.tokens is not None else "tokens missing (stats older than the key)"))
    return rows


def generation_overhead(rows: list[dict]) -> dict:
    """The generation stages' wall seconds against their decode seconds, summed over the ``decode``
    rows of :func:`stage_rows`.

    Returns ``{"wall_s", "decode_s", "wall_over_decode", "phase_s"}``: the ``<stage>.done`` seconds
    of every generation stage that has stats (a co-decoded stage's own marker is ~1 s, its decode is
    in the engine's first stage, so only the sums mean something), the stats' ``generation_s``, their
    ratio (None without decode seconds), and each ``phase_s`` key summed (stats older than the key add
    nothing there).
    """
    wall = decode = 0.0
    phases: dict[str, float] = {}
    for r in rows:
        if r["part"] != "decode":
            continue
        wall += r["wall_s"] or 0.0
        decode += r["seconds"] or 0.0
        for k, v in (r.get("phase_s") or {}).items():
            phases[k] = phases.get(k, 0.0) + v
    return {"wall_s": wall, "decode_s": decode, "wall_over_decode": wall / decode if decode else None,
            "phase_s": phases}


def measure_limits(given: dict[str, float | None]) -> dict[str, float]:
    """GFLOP/s per dtype on every usable core: ``given`` values, else measured now."""
    out = {}
    for name in ("float32", "bfloat16"):
        if given.get(name):
            out[name] = float(given[name])
        else:
            import torch

            try:
                from bench.bench_matmul import gflops
            except ModuleNotFoundError:  # run as a file (python bench/roofline.py): bench/ is on sys.path
                from bench_matmul import gflops
            from online_rlhf.hardware import cpu_has_native_bf16, usable_cores

            dtype = getattr(torch, name)
            size = 1024 if (name == "float32" or cpu_has_native_bf16()) else 256
            out[name] = gflops(size, dtype, usable_cores(), 2.0)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--gflops-fp32", type=float, help="fp32 limit (GFLOP/s, all cores); default: measure now")
    ap.add_argument("--gflops-bf16", type=float, help="bf16 limit (GFLOP/s, all cores); default: measure now")
    ap.add_argument("--json", type=Path, help="also write the rows and totals to this JSON file")
    args = ap.parse_args(argv)
    for flag, v in (("--gflops-fp32", args.gflops_fp32), ("--gflops-bf16", args.gflops_bf16)):
        if v is not None and v <= 0:
            ap.error(f"{flag} {v}: give the limit in GFLOP/s, > 0")
    iters = sorted((p for p in args.run_dir.glob("iter_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    if not iters:
        sys.exit(f"{args.run_dir}: no iter_<i> directory; give a run_loop.sh run directory.")
    try:
        rows = [r for it in iters for r in stage_rows(it, int(it.name[5:]))]
    except (DataError, FileNotFoundError) as e:
        sys.exit(f"roofline: {e}")
    if not rows:
        sys.exit(f"roofline: {args.run_dir}: no stats of a model-running stage yet (generation, dpo, kl); "
                 "run the loop first.")
    from online_rlhf.hardware import cpu_capability, cpu_model, idle_cores, usable_cores

    if not (args.gflops_fp32 and args.gflops_bf16) and idle_cores() < usable_cores() - 0.5:
        print("warning: another job keeps a core busy: the limit measured now is too low and every share too "
              "high; measure on an idle machine or give --gflops-fp32/--gflops-bf16.", file=sys.stderr)
    limits = measure_limits({"float32": args.gflops_fp32, "bfloat16": args.gflops_bf16})
    print(f"CPU: {cpu_model()} (torch capability {cpu_capability()}), {usable_cores()} cores; limit fp32 "
          f"{limits['float32']:.1f} GFLOP/s, bf16 {limits['bfloat16']:.1f} GFLOP/s")
    print(f"{'iter':>4} {'stage':16} {'part':19} {'dtype':9} {'tokens':>8} {'TFLOP':>7} {'limit s':>8} "
          f"{'own s':>7} {'share':>6} {'wall s':>7}  note")
    floor = 0.0
    for r in rows:
        r["limit_s"] = None if r["tflop"] is None else r["tflop"] * 1e3 / limits[r["dtype"]]
        r["share"] = (r["limit_s"] / r["seconds"]) if r["limit_s"] is not None and r["seconds"] else None
        floor += r["limit_s"] or 0.0
        fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
        print(f"{r['iteration']:>4} {r['stage']:16} {r['part']:19} {r['dtype']:9} {fmt(r['tokens'], 'd'):>8} "
              f"{fmt(r['tflop'], '.2f'):>7} {fmt(r['limit_s'], '.1f'):>8} {fmt(r['seconds'], '.1f'):>7} "
              f"{fmt(None if r['share'] is None else 100 * r['share'], '.0f'):>5}% {fmt(r['wall_s'], '.0f'):>7}  "
              f"{r['note']}")
    if any(r["share"] is not None and r["share"] > 1.0 for r in rows):
        print("warning: a share above 100%: the limit is lower than the machine reached during the run (measured "
              "under load, or on another machine); give the limit measured where the run ran, idle.", file=sys.stderr)
    gen = generation_overhead(rows)
    if gen["decode_s"]:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in gen["phase_s"].items() if k != "decode")
        print(f"generation stages: wall {gen['wall_s']:.0f} s over decode {gen['decode_s']:.0f} s = "
              f"{gen['wall_over_decode']:.2f}x" + (f" (the shards' other phases, summed: {parts})" if parts else ""))
    walls = [_wall(it, p.name[:-5]) for it in iters for p in it.glob("*.done")]
    run_wall = sum(w for w in walls if w is not None)
    share = floor / run_wall if run_wall else None
    print(f"compute floor (every counted stage at the limit): {floor:.0f} s = {floor / 60:.1f} min; "
          f"the stages' wall: {run_wall:.0f} s = {run_wall / 60:.1f} min" if run_wall else
          f"compute floor: {floor:.0f} s; no stage wall seconds (no <stage>.done marker)")
    # the last line: the one figure to compare this run with another (grep-able, the same words always)
    print(f"share of the limit: {100 * share:.1f}% (compute floor {floor:.0f} s / stages' wall {run_wall:.0f} s; "
          f"limits fp32 {limits['float32']:.1f}, bf16 {limits['bfloat16']:.1f} GFLOP/s)" if share is not None else
          "share of the limit: unknown (no stage wall seconds)")
    out = {"cpu_model": cpu_model(), "cpu_capability": cpu_capability(), "cores": usable_cores(),
           "limits_gflops": limits, "rows": rows, "compute_floor_s": floor, "stages_wall_s": run_wall,
           "share_of_limit": share, "generation": gen}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
