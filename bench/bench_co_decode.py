"""Co-decoding: an iteration's three evaluation generations (held-out answers, KL samples, IFEval
answers) as three launches, one engine start each, against one co-decoded launch.

    .venv-train/bin/python -m bench.bench_co_decode [--eval-prompts 16] [--ifeval-prompts 16]
        [--max-tokens 96] [--ifeval-max-tokens 96] [--kl-samples 1] [--runs 1] [--threads N]
        [--smoke] [--output FIGURES.json]

Each run launches ``generation/launch.py`` (the inference env, as ``loop exec`` does) for the three
configs the loop gives ``eval_generate`` (greedy, k=1), ``kl_generate`` (``--kl-samples`` answers
at temperature 1, its own seed, token ids saved) and ``ifeval_generate`` (greedy, the IFEval
prompts) separately, then once with ``--config A --config B --config C`` (co-decoding,
``online_rlhf.co_decode``), the order reversed every other run. Prints the seconds of each launch
(process start, imports, engine start and decoding: the wall a stage costs), the three together
against the co-decoded one as a ratio (< 1: faster), the engine start-up each paid, and whether
the co-decoded outputs equal the separate ones (the engine runs in the launcher's shard process on
one CPU shard, so they should, the sampled KL answers included).

Model and prompts: the embedded SmolLM2-135M-Instruct, the first held-out IFBench prompts
(``.cache/data/ifbench_eval.jsonl``) and the first IFEval prompts (``.cache/data/ifeval.jsonl``).
``--smoke`` (or an unprepared default) uses a random 2-layer Llama and 2 built-in prompts, for the
test suite. Threads: ``--threads`` (default: one per free core when the bench starts, fixed for
every launch, so that all of them sample with the same thread count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from online_rlhf.jsonl import read_jsonl, write_json, write_jsonl
from online_rlhf.paths import default_data_dir, default_model_dir

ROOT = Path(__file__).resolve().parent.parent
INFER_PY = ROOT / ".venv-infer" / "bin" / "python"
STAGES = ("eval_generate", "kl_generate", "ifeval_generate")


def stage_configs(model: str, eval_prompts: str, ifeval_prompts: str, n_eval: int, n_ifeval: int, max_tokens: int,
                  ifeval_max_tokens: int, kl_samples: int, max_model_len: int, out: Path, seed: int = 42) -> dict:
    """The three configs as the loop's plan builds them for iteration 1 (``online_rlhf.stage_table``:
    held-out greedy, KL sampled at temperature 1 with seed + 1500, IFEval greedy), writing under ``out``."""
    base = {"model": model, "prompts": eval_prompts, "limit": n_eval, "k": 1, "temperature": 0.0, "top_p": 1.0,
            "max_tokens": max_tokens, "seed": seed, "max_model_len": max_model_len, "dtype": "auto",
            "kv_cache_gb": 1.0, "num_shards": 1}
    return {
        "eval_generate": {**base, "output": str(out / "eval_generated.jsonl")},
        "kl_generate": {**base, "k": kl_samples, "temperature": 1.0, "seed": seed + 1500, "save_token_ids": True,
                        "output": str(out / "kl_generated.jsonl")},
        "ifeval_generate": {**base, "prompts": ifeval_prompts, "limit": n_ifeval, "max_tokens": ifeval_max_tokens,
                            "output": str(out / "ifeval_generated.jsonl")},
    }


def launch(config_paths: list[Path], env: dict, log: Path) -> float:
    """One ``generation/launch.py --config ...`` run; its wall seconds.

    Raises:
        RuntimeError: the launch failed (naming its log).
    """
    argv = [str(INFER_PY), "generation/launch.py"] + [a for p in config_paths for a in ("--config", str(p))]
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"launch failed (exit {rc}); log {log}")
    return seconds


def one_run(work: Path, configs: dict, env: dict, co_first: bool) -> dict:
    """The three separate launches and the co-decoded one (in the order ``co_first`` says), in fresh
    folders; their seconds, each output's engine start-up, and whether the outputs are equal."""
    from online_rlhf.stats import GenerateStats, stats_path

    for sub in ("apart", "together"):
        if (work / sub).exists():
            import shutil

            shutil.rmtree(work / sub)
    paths = {}
    for sub in ("apart", "together"):
        (work / sub).mkdir(parents=True)
        for stage, d in configs.items():
            p = work / sub / f"{stage}.yaml"
            p.write_text(yaml.safe_dump({**d, "output": str(work / sub / Path(d["output"]).name)}))
            paths[sub, stage] = p
    result: dict = {"apart": {}, "together": None}

    def apart():
        for stage in STAGES:
            result["apart"][stage] = launch([paths["apart", stage]], env, work / "apart" / f"{stage}.log")

    def together():
        result["together"] = launch([paths["together", s] for s in STAGES], env, work / "together" / "launch.log")

    for step in ((together, apart) if co_first else (apart, together)):
        step()
    result["apart_total"] = sum(result["apart"].values())
    result["ratio"] = result["together"] / result["apart_total"]
    outs = {stage: Path(configs[stage]["output"]).name for stage in STAGES}
    result["equal"] = {stage: read_jsonl(work / "apart" / o) == read_jsonl(work / "together" / o)
                       for stage, o in outs.items()}
    result["startup_s"] = {sub: {stage: GenerateStats.read(stats_path(work / sub / o)).engine_startup_s
                                 for stage, o in outs.items()} for sub in ("apart", "together")}
    return result


def _cpu_line(hw: dict) -> str:
    return (f"{hw.get('cpu_model')}, {hw.get('cpu_capability')}, "
            f"{'native' if hw.get('cpu_native_bf16') else 'no native'} bf16")


def main(argv: list[str] | None = None) -> dict:
    """Run the bench (module docstring); returns the figures (also printed, and written with ``--output``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--ifeval-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96, help="held-out and KL answers")
    ap.add_argument("--ifeval-max-tokens", type=int, default=96)
    ap.add_argument("--kl-samples", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="pairs of (three launches, one co-decoded launch)")
    ap.add_argument("--threads", type=int, help="OpenMP threads of every launch (default: one per free core now)")
    ap.add_argument("--smoke", action="store_true", help="random 2-layer model, 2 prompts, 4 tokens: for the tests")
    ap.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if not INFER_PY.exists():
        raise SystemExit(f"no inference env at {INFER_PY} (bash scripts/setup_envs.sh infer)")
    from online_rlhf.hardware import describe, stage_threads

    threads = args.threads or stage_threads()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="bench_co_decode_") as tmp:
        work = Path(tmp)
        evals, ifevals = default_data_dir() / "ifbench_eval.jsonl", default_data_dir() / "ifeval.jsonl"
        smoke = args.smoke or not (default_model_dir() / "config.json").is_file() or not evals.is_file() \
            or not ifevals.is_file()
        if smoke:
            from online_rlhf.testing import make_tiny_policy

            model = str(make_tiny_policy(work / "tiny", hidden_size=128))
            evals, ifevals = work / "eval.jsonl", work / "ifeval.jsonl"
            write_jsonl(evals, [{"id": f"e{i}", "prompt": f"Say something about {w}."} for i, w in enumerate(["cats", "the sea"])])
            write_jsonl(ifevals, [{"id": f"i{i}", "prompt": f"List {i + 2} colours."} for i in range(2)])
            n_eval = n_ifeval = 2
            max_tokens = ifeval_max_tokens = 4
            max_model_len = 128
        else:
            model, n_eval, n_ifeval = str(default_model_dir()), args.eval_prompts, args.ifeval_prompts
            max_tokens, ifeval_max_tokens, max_model_len = args.max_tokens, args.ifeval_max_tokens, 2048
        configs = stage_configs(model, str(evals), str(ifevals), n_eval, n_ifeval, max_tokens, ifeval_max_tokens,
                                args.kl_samples, max_model_len, work / "out")
        runs = [one_run(work, configs, env, co_first=bool(r % 2)) for r in range(args.runs)]
    apart = sum(r["apart_total"] for r in runs) / len(runs)
    together = sum(r["together"] for r in runs) / len(runs)
    figures = {
        "model": "tiny random Llama (smoke)" if smoke else "SmolLM2-135M-Instruct (embedded)",
        "size": {"eval_prompts": n_eval, "ifeval_prompts": n_ifeval, "max_tokens": max_tokens,
                 "ifeval_max_tokens": ifeval_max_tokens, "kl_samples": args.kl_samples},
        "threads": threads, "cpu": _cpu_line(describe("cpu", "float32")),
        "runs": runs, "apart_s": round(apart, 1), "together_s": round(together, 1),
        "ratio": round(together / apart, 3), "outputs_equal": all(all(r["equal"].values()) for r in runs),
    }
    print(f"co-decoding bench: {figures['model']}, {n_eval} held-out + {n_ifeval} IFEval prompts, "
          f"{max_tokens}/{ifeval_max_tokens} tokens, KL samples {args.kl_samples}, {threads} thread(s), "
          f"{figures['cpu']}")
    for n, r in enumerate(runs):
        print(f"run {n + 1} ({'co-decoded first' if n % 2 else 'separate first'}): separate "
              + ", ".join(f"{s} {v:.1f} s" for s, v in r["apart"].items())
              + f" = {r['apart_total']:.1f} s; co-decoded {r['together']:.1f} s; ratio {r['ratio']:.3f}; "
              f"engine start-up separate {r['startup_s']['apart']}, co-decoded {r['startup_s']['together']}; "
              f"outputs equal {r['equal']}")
    print(f"co-decoded / separate: {figures['ratio']:.3f} ({together:.1f} s vs {apart:.1f} s, mean of {len(runs)} "
          f"run(s)); outputs equal: {figures['outputs_equal']}")
    if args.output:
        write_json(args.output, figures)
    return figures


if __name__ == "__main__":
    main()
