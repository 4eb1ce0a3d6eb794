"""Benchmark: one GRPO iteration of this pipeline vs TRL's GRPOTrainer, same work, same machine.

    .venv-train/bin/python -m bench.grpo_vs_trl [--prompts 8] [--k 4] [--max-tokens 64] [--output FIGURES.json]

Both sides get the same policy (the embedded SmolLM2-135M-Instruct unless ``--policy``), the same
first N train prompts (``.cache/data/ifbench_train.jsonl``), K samples per prompt, the same max
new tokens, temperature 1.0 / top_p 1.0, the same reward (the default verifier: IFEval/IFBench
checkers, loose, partial credit, no truncation penalty on either side) and the same GRPO
hyper-parameters (:data:`GRPO`: Dr. GRPO aggregation, group std scaling, beta 0, epsilon 0.2,
8 completions per optimizer step, one pass, fp32, one process), so the same number of updates
(N x K / 8), less the groups the pipeline skips because all their rewards are equal (counted).

(a) **ours**: ``bash run_loop.sh configs/loop.yaml algorithm=grpo iterations=1 ...`` in a fresh run
    directory. Timed: from the start of the ``generate`` stage to the end of the ``grpo`` stage, on
    run_loop.sh's own status lines (process starts, model loads, vLLM start-up included). The
    held-out evaluation still runs but is not counted (2 prompts, 16 tokens); IFEval and the KL
    stages are off.
(b) **TRL**: ``trl.GRPOTrainer`` over the same prompts for one epoch, in a fresh process of the
    training env (``use_vllm=False``: transformers ``generate``), the verifier as a TRL reward
    function (``bench/iteration_vs_trl.py``'s), the policy saved at the end. Timed: the process's
    wall time.

Prints both wall times, the ratio TRL / ours (> 1: ours is faster), the mean reward of the samples
each side trained on (ours: the iteration's rollouts; TRL: its logged ``reward`` per step), and the
CPU model, capability, dtype and threads. Not a test: timings vary with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

try:
    from bench.iteration_vs_trl import TRAIN_PY, _load1, _yaml, make_verifier_reward
except ModuleNotFoundError:  # run as a file (python bench/grpo_vs_trl.py): bench/ is on sys.path
    from iteration_vs_trl import TRAIN_PY, _load1, _yaml, make_verifier_reward
from online_rlhf.jsonl import read_json, read_jsonl
from online_rlhf.stats import GRPOStats, RewardStats, stats_path

ROOT = Path(__file__).resolve().parent.parent

# The GRPO hyper-parameters both sides use (TRL's names).
GRPO = {"loss_type": "dr_grpo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "learning_rate": 1.0e-5,
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_iterations": 1,
        "max_grad_norm": 1.0, "seed": 42}


def trl_worker(args: argparse.Namespace) -> None:
    """Load the policy, run GRPOTrainer for one epoch over the prompts, save; print a JSON line."""
    t_start = time.perf_counter()
    from online_rlhf.paths import resolve_model, setup_cache_env

    setup_cache_env()
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from online_rlhf.hardware import describe
    from online_rlhf.records import load_prompts

    policy = resolve_model(args.policy)
    prompts = load_prompts(args.prompts_file, limit=args.prompts)
    ds = datasets.Dataset.from_list([{"id": p["id"], "prompt": p["prompt"]} for p in prompts])
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="sdpa")
    config = GRPOConfig(output_dir=str(Path(args.out_dir) / "work"), **GRPO, num_generations=args.k,
                        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
                        bf16=False, fp16=False, gradient_checkpointing=False, lr_scheduler_type="constant",
                        num_train_epochs=1, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True)
    trainer = GRPOTrainer(model=model, reward_funcs=make_verifier_reward({p["id"]: p for p in prompts}), args=config,
                          train_dataset=ds, processing_class=tokenizer)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trainer.save_model(str(Path(args.out_dir) / "model"))
    logs = [h for h in trainer.state.log_history if "reward" in h]
    print("TRL_RESULT " + json.dumps({
        "ids": [p["id"] for p in prompts], "steps": trainer.state.global_step,
        "reward_mean": sum(h["reward"] for h in logs) / len(logs) if logs else None,
        "hardware": describe("cpu", "float32"), "train_s": train_s,
        "in_process_s": time.perf_counter() - t_start}), flush=True)


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    out_dir = work / "trl"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = [str(TRAIN_PY), "-m", "bench.grpo_vs_trl", "--trl-worker", "--prompts", str(args.prompts), "--k",
           str(args.k), "--max-tokens", str(args.max_tokens), "--policy", args.policy, "--prompts-file",
           args.prompts_file, "--out-dir", str(out_dir)]
    log_path = work / "trl.log"
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        raise SystemExit(f"TRL run failed (exit {rc}); log {log_path}:\n" + "\n".join(text.splitlines()[-30:]))
    res = json.loads([x for x in text.splitlines() if x.startswith("TRL_RESULT ")][-1][len("TRL_RESULT "):])
    return {**res, "wall_s": wall, "log": str(log_path)}


_START = re.compile(r"iteration 1/1 · generate \((?:infer|train) env\)")
_END = re.compile(r"iteration 1/1 · grpo: finished in")


def run_ours(args: argparse.Namespace, work: Path) -> dict:
    out_root, name = work / "runs", "grpo_vs_trl"
    cmd = ["bash", "run_loop.sh", "configs/loop.yaml", "algorithm=grpo", f"run_name={name}", f"output_root={out_root}",
           f"policy={args.policy}", f"train_prompts={args.prompts_file}", "iterations=1",
           f"prompts_per_iteration={args.prompts}", f"generation.k={args.k}", f"generation.max_tokens={args.max_tokens}",
           "generation.temperature=1.0", "generation.top_p=1.0", "eval_limit=2", "evaluation.max_tokens=16",
           "reward.source=verifier", "reward.ifeval_mode=loose", "reward.ifeval_score=partial", "ref_model=initial",
           "ifeval.when=never", "kl_samples=0",
           "co_decode=false",  # the rollouts' own launch stays inside the timed window (not in iteration 0's eval)
           "num_processes=1", "grpo.truncated_penalty=0.0", "grpo.max_length=null",
           *[f"grpo.{k}={_yaml(v)}" for k, v in GRPO.items()], "--fresh"]
    log_path, stamps = work / "ours.log", {}
    t_launch = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)})
        for line in p.stdout:
            now = time.perf_counter()
            log.write(f"[{now - t_launch:8.2f}] {line}")
            for key, pat in (("start", _START), ("end", _END)):
                if pat.search(line):
                    stamps[key] = now
        rc = p.wait()
    if rc != 0 or len(stamps) != 2:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        raise SystemExit(f"run_loop.sh failed (exit {rc}); log {log_path}:\n" + "\n".join(text.splitlines()[-30:]))
    it = out_root / name / "iter_1"
    grpo = GRPOStats.read(stats_path(it / "model"))
    return {"wall_s": stamps["end"] - stamps["start"], "ids": [r["id"] for r in read_jsonl(it / "prompts.jsonl")],
            "markers": {s: read_json(it / f"{s}.done")["seconds"] for s in ("generate", "rewards", "grpo")},
            "steps": grpo.steps, "groups_used": grpo.groups_used, "groups_skipped": grpo.groups_skipped,
            "reward_mean": RewardStats.read(stats_path(it / "rewards.jsonl")).reward.mean, "hardware": grpo.hardware,
            "log": str(log_path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both sides (default 1)")
    ap.add_argument("--policy", default="default")
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--output", default=None, help="write the figures to this JSON")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prompts_file is None:
        from online_rlhf.paths import default_data_dir

        args.prompts_file = str(default_data_dir() / "ifbench_train.jsonl")
    if args.trl_worker:
        trl_worker(args)
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo_vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {args.prompts} prompts, K={args.k}, max {args.max_tokens} new tokens; work dir {work}; "
          f"load {_load1():.2f}", flush=True)
    ours = run_ours(args, work)
    trl = run_trl(args, work)
    if ours["ids"] != trl["ids"]:
        raise SystemExit("the two sides saw different prompts; the comparison is void.")
    hw = ours["hardware"]
    print(f"\n{'':10s}{'wall s':>9s}{'steps':>7s}{'rollout reward':>16s}")
    print(f"{'pipeline':10s}{ours['wall_s']:9.1f}{ours['steps']:7d}{ours['reward_mean']:16.4f}   "
          f"groups used {ours['groups_used']}, skipped {ours['groups_skipped']}; stage seconds {ours['markers']}")
    print(f"{'TRL GRPO':10s}{trl['wall_s']:9.1f}{trl['steps']:7d}{trl['reward_mean']:16.4f}")
    ratio = trl["wall_s"] / ours["wall_s"]
    print(f"ratio TRL / pipeline: {ratio:.2f}x (one run; > 1: the pipeline is faster)")
    print(f"hardware: {hw['cpu_model']} ({hw['cpu_capability']}, native bf16: {hw['cpu_native_bf16']}); "
          f"training dtype {hw['dtype']}, {args.threads} thread(s) per process; load at the end {_load1():.2f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "ours": ours, "trl": trl, "ratio": ratio},
                                                indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
