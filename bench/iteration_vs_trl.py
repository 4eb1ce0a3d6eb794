"""Benchmark: one iteration of this pipeline vs TRL's OnlineDPOTrainer, same work, same machine.

    .venv-train/bin/python -m bench.iteration_vs_trl [--prompts 64] [--max-tokens 256] [--runs 1]
        [--wait-quiet] [--trl-threads 1] [--output FIGURES.json]

Both sides get the same policy (the embedded SmolLM2-135M-Instruct unless ``--policy``), the same
first N train prompts (``.cache/data/ifbench_train.jsonl``), K = 2 samples per prompt (TRL's online
DPO always compares two), the same max new tokens, temperature 1.0 / top_p 1.0, the same reward
(the default verifier, ``online_rlhf.verifiers.score``: IFEval/IFBench checkers, loose, partial
credit; a response cut at the token limit loses 0.5 on both sides: ``pairs.truncated_penalty`` here,
``missing_eos_penalty`` in TRL) and the same DPO hyper-parameters (sigmoid loss, beta 0.1, lr 5e-6
cosine with 10% warm-up, batch 4 x 2 accumulation, one epoch, max length 640, fp32, reference =
the starting policy).

(a) **ours**: ``bash run_loop.sh configs/loop.yaml iterations=1 generation.k=2 ...`` in a fresh run
    directory. Timed: the wall time from the start of the ``generate`` stage to the end of the
    ``dpo`` stage, stamped on run_loop.sh's own status lines as they arrive (every process start,
    model load, vLLM start-up and the loop's bookkeeping between stages included). The held-out
    evaluation of iteration 0 and 1 still runs (run_loop.sh has no switch to skip it) but is not
    counted; it is kept tiny (``--eval-prompts``, 16 tokens); IFEval and the KL stages are off
    (``ifeval.when=never kl_samples=0``), and so is co-decoding (``co_decode=false``: else the
    rollouts would decode in iteration 0's evaluation launch, outside the timed window). The sum of the four stages' ``.done`` marker seconds is
    printed too. The DPO batch is the stage's ``train_batch_size`` (:func:`ours_dpo_overrides`).
(b) **TRL**: ``trl.experimental.online_dpo.OnlineDPOTrainer`` over the same prompts for one epoch,
    in a fresh process of the training env (``use_vllm=False``: transformers ``generate``;
    ``bf16=False``; one process), the verifier wrapped as a TRL reward function; the trained
    policy is saved at the end like the DPO stage does. Timed: the process's wall time.

Prints both wall times, prompts/s, the 1-minute load average at the start and end of each side,
and the ratio TRL / ours (> 1: ours is faster); TRL's in-process split (imports, model loading,
seconds in ``generate``, in the reward function, in forward/backward, save) goes to the JSON.
With ``--runs R`` the two alternate R times (the order swaps every run) and medians are printed.
``--wait-quiet`` waits (polling every 30 s, at most 25 min) until the 1-minute load average is
below 1.0 before starting. Not a test: timings vary with the machine's load.

Differences that remain, by design of each side: TRL trains on every prompt (a tie is still a
"pair"), the pipeline only on prompts whose two responses got different rewards (ties are skipped
and counted by make_pairs), so its DPO stage may take fewer steps (both counts are printed); the
pipeline's vLLM samples in bf16 (its ``dtype: auto`` on a float32 checkpoint), TRL's ``generate``
in float32; TRL keeps a second copy of the policy as its reference model in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from online_rlhf.jsonl import read_json, read_jsonl
from online_rlhf.stats import DPOStats, GenerateStats, stats_path

TRAIN_PY = ROOT / ".venv-train" / "bin" / "python"
TARGET_RATIO = 4.0  # TRL's wall over this pipeline's for one iteration: issue 27's target (2.5x before it)
TRUNCATION_PENALTY = 0.5  # a cut response loses this on both sides: pairs.truncated_penalty (truncated: penalize) here, missing_eos_penalty in TRL

# The DPO hyper-parameters both sides use (configs/dpo.yaml values, one epoch).
DPO = {"beta": 0.1, "learning_rate": 5.0e-6, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
       "num_train_epochs": 1, "lr_scheduler_type": "cosine", "warmup_steps": 0.1, "max_length": 640,
       "max_grad_norm": 1.0, "seed": 42}


# --------------------------------------------------------------------------------------------
# (b) TRL worker: runs in its own process (`--trl-worker`), so its start-up is in the wall time.
# --------------------------------------------------------------------------------------------
def make_verifier_reward(records_by_id: dict[str, dict]):
    """The default verifier as a TRL reward function.

    TRL's OnlineDPOTrainer calls ``f(prompts=..., completions=..., completion_ids=..., **columns)``
    with 2 x batch completions (conversational: ``[{"role": "assistant", "content": text}]``) and
    every other dataset column repeated twice; here the ``id`` column finds the prompt's task
    fields (``instruction_id_list``, ``kwargs``). Returns one float in [0, 1] per completion, or
    None for an unscorable prompt (TRL turns it into NaN and its sum into 0).
    """
    from online_rlhf import verifiers
    from online_rlhf.stage_configs import RewardConfig

    cfg = RewardConfig(input="-", output="-", source="verifier", verifier="auto", ifeval_mode="loose",
                       ifeval_score="partial")

    def verifier_reward(prompts, completions, id, **_):  # noqa: A002 (TRL passes the column by name)
        recs = []
        for rid, comp in zip(id, completions):
            text = comp[-1]["content"] if isinstance(comp, list) else comp
            recs.append({**records_by_id[rid], "responses": [text], "finish_reasons": ["stop"]})
        return [None if r is None else float(r[0]) for r in verifiers.score(recs, cfg).rewards]

    return verifier_reward


def trl_worker(args: argparse.Namespace) -> None:
    """Load the policy, run OnlineDPOTrainer for one epoch over the prompts, save; print a JSON line."""
    t_start = time.perf_counter()
    from online_rlhf.paths import resolve_model, setup_cache_env

    setup_cache_env()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from online_rlhf.records import load_prompts

    t_imports = time.perf_counter() - t_start
    policy = resolve_model(args.policy)
    prompts = load_prompts(args.prompts_file, limit=args.prompts)
    by_id = {p["id"]: p for p in prompts}
    ds = datasets.Dataset.from_list([{"id": p["id"], "prompt": p["prompt"]} for p in prompts])

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="sdpa")
    load_s = time.perf_counter() - t0

    out_dir = Path(args.out_dir)
    config = OnlineDPOConfig(
        output_dir=str(out_dir / "work"), **DPO, loss_type="sigmoid", max_new_tokens=args.max_tokens,
        temperature=1.0, top_p=1.0, top_k=0, missing_eos_penalty=TRUNCATION_PENALTY, use_vllm=False,
        bf16=False, fp16=False, gradient_checkpointing=False, logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=False)
    timers = {"generate": 0.0, "rewards": 0.0}

    def timed(key: str, method):
        """``method`` wrapped to add its seconds to ``timers[key]``."""
        def wrapper(self, *a, **kw):
            t = time.perf_counter()
            try:
                return method(self, *a, **kw)
            finally:
                timers[key] += time.perf_counter() - t
        return wrapper

    class TimedOnlineDPOTrainer(OnlineDPOTrainer):
        """Records the seconds TRL spends in transformers generate and in the reward function."""

        _generate = timed("generate", OnlineDPOTrainer._generate)
        _calculate_rewards_from_functions = timed("rewards", OnlineDPOTrainer._calculate_rewards_from_functions)

    t0 = time.perf_counter()
    trainer = TimedOnlineDPOTrainer(model=model, reward_funcs=make_verifier_reward(by_id), args=config,
                                    train_dataset=ds, processing_class=tokenizer)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.save_model(str(out_dir / "model"))
    save_s = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print("TRL_RESULT " + json.dumps({
        "prompts": len(prompts), "ids": [p["id"] for p in prompts], "steps": trainer.state.global_step,
        "threads": torch.get_num_threads(),
        "scores_mean": [h.get("objective/scores") for h in logs],
        "contain_eos": [h.get("val/contain_eos_token") for h in logs],
        "seconds": {"imports": t_imports, "model_loading": load_s, "trainer_init": init_s, "train": train_s,
                    "train_generate": timers["generate"], "train_rewards": timers["rewards"],
                    "train_forward_backward_other": train_s - timers["generate"] - timers["rewards"], "save": save_s, "in_process_total": time.perf_counter() - t_start}}), flush=True)


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    """Run the TRL worker in a fresh training-env process; return its figures + wall seconds."""
    out_dir = work / "trl"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = [str(TRAIN_PY), "-m", "bench.iteration_vs_trl", "--trl-worker", "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens), "--policy", args.policy, "--prompts-file", args.prompts_file,
           "--out-dir", str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.trl_threads), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    log_path = work / "trl.log"
    load0 = _load1()
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        raise SystemExit(f"TRL run failed (exit {rc}); log {log_path}:\n" + "\n".join(text.splitlines()[-30:]))
    line = [x for x in text.splitlines() if x.startswith("TRL_RESULT ")][-1]
    res = json.loads(line[len("TRL_RESULT "):])
    res.update({"wall_s": wall, "load_start": load0, "load_end": _load1(), "log": str(log_path)})
    return res


# --------------------------------------------------------------------------------------------
# (a) ours: run_loop.sh, one iteration, K=2; the status lines are time-stamped as they arrive.
# --------------------------------------------------------------------------------------------
_STAGE_START = re.compile(r"iteration 1/1 · (\w+) \((?:infer|train) env\)")
_STAGE_END = re.compile(r"iteration 1/1 · (\w+): finished in (\d+)s")


def run_ours(args: argparse.Namespace, work: Path) -> dict:
    """Run one iteration with run_loop.sh (fresh run dir); return wall seconds of generate..dpo."""
    out_root = work / "runs"
    name = "bench_vs_trl"
    cmd = ["bash", "run_loop.sh", "configs/loop.yaml", f"run_name={name}", f"output_root={out_root}",
           f"policy={args.policy}", f"train_prompts={args.prompts_file}", "iterations=1",
           f"prompts_per_iteration={args.prompts}", "generation.k=2", f"generation.max_tokens={args.max_tokens}",
           "generation.temperature=1.0", "generation.top_p=1.0",
           f"eval_limit={args.eval_prompts}", "evaluation.max_tokens=16",
           "reward.source=verifier", "reward.verifier=auto", "reward.ifeval_mode=loose", "reward.ifeval_score=partial",
           "pairs.strategy=max_min", "pairs.truncated=penalize", f"pairs.truncated_penalty={TRUNCATION_PENALTY}",
           "ref_model=initial", "ifeval.when=never", "kl_samples=0", *ours_dpo_overrides(),
           # the timed generate..dpo window must hold the rollouts' own launch (TRL's side pays its
           # generation): with co-decoding they would decode in iteration 0's evaluation launch
           "co_decode=false", "--fresh"]
    log_path = work / "ours.log"
    stamps: dict[str, tuple[str, float]] = {}
    load0 = _load1()
    t_launch = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert p.stdout is not None
        for line in p.stdout:
            now = time.perf_counter()
            log.write(f"[{now - t_launch:8.2f}] {line}")
            log.flush()
            m = _STAGE_START.search(line)
            if m:
                stamps[f"{m.group(1)}_start"] = (line, now)
            m = _STAGE_END.search(line)
            if m:
                stamps[f"{m.group(1)}_end"] = (line, now)
        rc = p.wait()
    total = time.perf_counter() - t_launch
    if rc != 0:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        raise SystemExit(f"run_loop.sh failed (exit {rc}); log {log_path}:\n" + "\n".join(text.splitlines()[-30:]))
    missing = [k for k in ("generate_start", "dpo_end") if k not in stamps]
    if missing:
        raise SystemExit(f"run_loop.sh output lacks the status lines {missing}; see {log_path}")
    it = out_root / name / "iter_1"
    markers = {s: read_json(it / f"{s}.done")["seconds"] for s in ("generate", "rewards", "pairs", "dpo")}
    ids = [r["id"] for r in read_jsonl(it / "prompts.jsonl")]
    pairs = len(read_jsonl(it / "pairs.jsonl"))
    dpo_stats = DPOStats.read(stats_path(it / "model"))
    gen_stats = GenerateStats.read(stats_path(it / "generated.jsonl"))
    return {
        "wall_s": stamps["dpo_end"][1] - stamps["generate_start"][1],
        "marker_sum_s": sum(markers.values()), "markers": markers, "run_loop_total_s": total,
        "ids": ids, "pairs": pairs, "dpo_steps": dpo_stats.steps,
        "generated_tokens": gen_stats.generated_tokens,
        "truncated": gen_stats.finish_reasons.get("length", 0),
        "load_start": load0, "load_end": _load1(), "log": str(log_path), "run_dir": str(out_root / name),
    }


def ours_dpo_overrides() -> list[str]:
    """The loop's ``dpo`` overrides giving its DPO stage the recipe :data:`DPO` and TRL's plain sigmoid
    loss. The batch is given as the stage's ``train_batch_size`` (pairs per optimizer step over all
    its processes: TRL's per-device batch x accumulation on its one process), which the stage splits
    over its ranks; configs/dpo.yaml's ``train_batch_size`` and a ``per_device_train_batch_size``
    together are refused. The recipe's ``[sigmoid, sft]`` weights give way to one weight for one loss."""
    per_step = DPO["per_device_train_batch_size"] * DPO["gradient_accumulation_steps"]
    keys = {k: v for k, v in DPO.items() if k != "per_device_train_batch_size"}
    return [f"dpo.train_batch_size={per_step}", "dpo.training.loss_type=sigmoid", "dpo.training.loss_weights=[1.0]",
            "dpo.training.precompute_ref_log_probs=true", *[f"dpo.training.{k}={_yaml(v)}" for k, v in keys.items()]]


# --------------------------------------------------------------------------------------------
def _yaml(v: object) -> str:
    """A key=value override value; small floats written with a dot (YAML 1.1 reads 5e-06 as text)."""
    return f"{v:.1e}" if isinstance(v, float) and 0 < abs(v) < 1e-3 else str(v)


def _load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_quiet(limit_s: float = 25 * 60, poll_s: float = 30, threshold: float = 1.0) -> bool:
    """Wait until the 1-minute load average is below ``threshold``; False when ``limit_s`` ran out."""
    t0 = time.monotonic()
    while True:
        load = _load1()
        if load < threshold:
            print(f"[bench] load {load:.2f} < {threshold}: starting", flush=True)
            return True
        if time.monotonic() - t0 > limit_s:
            print(f"[bench] load still {load:.2f} after {limit_s / 60:.0f} min: measuring anyway", flush=True)
            return False
        print(f"[bench] load {load:.2f}: waiting", flush=True)
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="first N train prompts (default 64)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max new tokens per response (default 256)")
    ap.add_argument("--runs", type=int, default=1, help="alternate ours/TRL this many times; medians printed")
    ap.add_argument("--policy", default="default", help="policy dir or 'default' (embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts-file", default=None, help="prompt set (default .cache/data/ifbench_train.jsonl)")
    ap.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts of run_loop.sh's (uncounted) evaluation")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the TRL process (default 1, like the pipeline's DPO stage)")
    ap.add_argument("--wait-quiet", action="store_true", help="wait until the 1-min load average is < 1.0 (max 25 min)")
    ap.add_argument("--trl-first", type=int, choices=(0, 1), default=0,
                    help="1: TRL runs first in run 1 (the order alternates between runs either way)")
    ap.add_argument("--only", choices=("ours", "trl"), default=None, help="run one side only")
    ap.add_argument("--work-dir", default=None, help="where runs and logs go (default: a temp dir, kept)")
    ap.add_argument("--output", default=None, help="write all figures to this JSON")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prompts_file is None:
        from online_rlhf.paths import default_data_dir

        args.prompts_file = str(default_data_dir() / "ifbench_train.jsonl")
    if args.trl_worker:
        trl_worker(args)
        return 0

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="iteration_vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    quiet = wait_quiet() if args.wait_quiet else None
    print(f"[bench] {args.prompts} prompts, K=2, max {args.max_tokens} new tokens, {args.runs} run(s); "
          f"work dir {work}; load {_load1():.2f}", flush=True)
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for r in range(args.runs):
        for side in (("trl", "ours") if (r + args.trl_first) % 2 else ("ours", "trl")):
            if args.only and side != args.only:
                continue
            print(f"[bench] run {r + 1}/{args.runs}: {side} ...", flush=True)
            (work / f"run_{r}").mkdir(parents=True, exist_ok=True)
            res = (run_ours if side == "ours" else run_trl)(args, work / f"run_{r}")
            results[side].append(res)
            print(f"[bench]   {side}: {res['wall_s']:.1f} s (load {res['load_start']:.2f} -> {res['load_end']:.2f})"
                  + (f", markers {res['markers']}, {res['pairs']} pairs, {res['dpo_steps']} DPO steps"
                     if side == "ours" else f", {res['steps']} optimizer steps, in-process {res['seconds']}"), flush=True)
    if results["ours"] and results["trl"] and results["ours"][0]["ids"] != results["trl"][0]["ids"]:
        raise SystemExit("the two sides saw different prompts; the comparison is void.")

    def med(side: str, key: str = "wall_s") -> float:
        return statistics.median(x[key] for x in results[side])

    print(f"\n{'':12s}{'wall s':>10s}{'prompts/s':>12s}   ({args.prompts} prompts, K=2, {args.max_tokens} max new tokens"
          f"{', median of ' + str(args.runs) if args.runs > 1 else ', one run'})")
    for side, label in (("ours", "pipeline"), ("trl", "TRL online")):
        if results[side]:
            loads = ", ".join(f"{x['load_start']:.2f}->{x['load_end']:.2f}" for x in results[side])
            print(f"{label:12s}{med(side):10.1f}{args.prompts / med(side):12.3f}   1-min load avg start->end: {loads}")
    if results["ours"]:
        print(f"  pipeline: sum of the 4 stages' .done seconds {med('ours', 'marker_sum_s'):.0f} s; "
              f"{results['ours'][-1]['pairs']} pairs -> {results['ours'][-1]['dpo_steps']} DPO steps")
    if results["trl"]:
        print(f"  TRL: {results['trl'][-1]['steps']} optimizer steps over all {args.prompts} prompts "
              f"(torch threads {results['trl'][-1]['threads']})")
    summary = {"args": {k: v for k, v in vars(args).items() if k not in ("trl_worker", "out_dir")},
               "waited_for_quiet": quiet, "results": results}
    if results["ours"] and results["trl"]:
        ratio = med("trl") / med("ours")
        summary["ratio_trl_over_ours"] = ratio
        print(f"ratio TRL / pipeline: {ratio:.2f}x  (target >= {TARGET_RATIO:g}x: "
              f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        print(f"figures: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
