"""DPO stage: completion-only log-probs on unpadded sequences vs TRL's own computation, same pairs.

    .venv-train/bin/python -m bench.bench_dpo_step [--pairs 16] [--batch 4] [--max-length 512] [--runs 2]
        [--layouts sequence,side,packed] [--smoke] [--output FIGURES.json]

Runs the DPO stage (``online_rlhf.stages.run_dpo.main``, in this process, the stage's threads and
precision: bf16 autocast on a CPU with native bf16, else fp32) on the same pairs once per
``log_probs`` setting: ``trl`` (TRL 1.9's ``_compute_loss``: chosen and rejected padded to the
longest of the batch, LM head and vocabulary log-softmax at every position) and each of
``--layouts`` (online_rlhf/completion_logps.py). One epoch of ``--pairs`` pairs, ``--batch`` pairs
per optimizer step. With ``--runs R`` the settings run R times, the order reversed every other run
(so warm caches favour none); the mean of each is reported.

Prints, per setting: the optimizer steps' seconds and seconds per trained sequence token (prompt +
response tokens, padding not counted: the stats' ``sequence_tokens``), the reference pass's
seconds, the first step's loss; then the ratio of each layout to ``trl`` (steps and reference
pass, in wall seconds; and the same plus the whole stage in CPU seconds of this process, which
waiting for a core another job holds does not inflate -- the figure to trust on a shared machine
when the stage runs one thread; < 1 is faster) and the largest first-loss difference (the
same loss, up to the precision's rounding). Timings vary with the machine's load: the ratio is what
carries over.

Pairs: the first ``--pairs`` IFBench train prompts (``.cache/data/ifbench_train.jsonl``, built by
``scripts/prepare_default.py``) under the policy's chat template, each with two responses of
random lengths (10-160 words drawn from the prompt's words, seeded), shaped like the default
iteration's pairs. Policy: the embedded SmolLM2-135M-Instruct; ``--smoke`` (or an unprepared
default) uses a random 2-layer Llama, two pairs and built-in prompts, for the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from online_rlhf.completion_logps import LAYOUTS
from online_rlhf.jsonl import iter_jsonl, write_json
from online_rlhf.paths import default_model_dir

ROOT = Path(__file__).resolve().parent.parent

BUILT_IN_PROMPTS = ["Write two sentences about the sea, all in lowercase.",
                    "List three colours and end your answer with the word done.",
                    "Explain what a prime number is in fewer than forty words.",
                    "Describe a cat without using the letter e more than five times."]


def make_pairs(prompts: list[str], n: int, seed: int, max_words: int = 160) -> list[dict]:
    """``n`` pairs ``{id, prompt, chosen, rejected}`` (chat messages): prompt i (cycled), two responses
    of 10..``max_words`` words drawn from the prompt's words (seeded, independent lengths)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = prompts[i % len(prompts)]
        words = text.split() or ["word"]
        resp = [" ".join(rng.choice(words) for _ in range(rng.randint(10, max_words))) for _ in range(2)]
        out.append({"id": str(i), "prompt": [{"role": "user", "content": text}],
                    "chosen": [{"role": "assistant", "content": resp[0]}],
                    "rejected": [{"role": "assistant", "content": resp[1]}]})
    return out


def _cpu_s() -> float:
    """CPU seconds this process has used (all its threads): unlike the wall, not inflated by waiting
    for a core that another job holds."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_setting(policy: str, pairs_file: Path, out_dir: Path, log_probs: str, batch: int, max_length: int) -> dict:
    """One DPO stage run; returns its seconds, tokens and first loss."""
    from online_rlhf.stage_configs import DPOStageConfig
    from online_rlhf.stages import run_dpo

    cfg = DPOStageConfig(policy=policy, pairs=str(pairs_file), output_dir=str(out_dir), log_probs=log_probs,
                         training={"per_device_train_batch_size": batch, "max_length": max_length,
                                   "learning_rate": 1e-6, "num_train_epochs": 1, "loss_type": ["sigmoid", "sft"],
                                   "loss_weights": [1.0, 1.0], "gradient_checkpointing": False})
    from trl import DPOTrainer

    cpu = {"train_steps": 0.0, "reference": 0.0}

    def counted(key, method):
        def wrapper(self, *args, **kwargs):
            c0 = _cpu_s()
            try:
                return method(self, *args, **kwargs)
            finally:
                cpu[key] += _cpu_s() - c0
        return wrapper

    orig_train, orig_ref = DPOTrainer.train, DPOTrainer._precompute_ref_logps
    DPOTrainer.train = counted("train_steps", orig_train)  # the stage's subclass reaches these through super()
    DPOTrainer._precompute_ref_logps = counted("reference", orig_ref)
    cpu0 = _cpu_s()
    try:
        st = run_dpo.main(cfg)
    finally:
        DPOTrainer.train, DPOTrainer._precompute_ref_logps = orig_train, orig_ref
    return {"cpu_s": _cpu_s() - cpu0, "steps_cpu_s": cpu["train_steps"], "reference_cpu_s": cpu["reference"],"log_probs": log_probs, "layout": st.log_probs["layout"], "trl_because": st.log_probs["trl_because"],
            "steps": st.steps, "train_steps_s": st.seconds.train_steps,
            "reference_s": st.seconds.reference_precompute, "sequence_tokens": st.sequence_tokens,
            "s_per_token": st.seconds.train_steps / (st.sequence_tokens * st.epochs),
            "loss_first": st.train_loss_first, "dtype": st.hardware.get("dtype"), "threads": st.hardware.get("threads")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=16, help="pairs (one epoch)")
    ap.add_argument("--batch", type=int, default=4, help="pairs per optimizer step")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="completion_logps layouts to compare with trl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="random 2-layer model, 2 pairs: seconds, for the tests")
    ap.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or a.pairs < 1 or a.batch < 1 or a.runs < 1:
        ap.error(f"--layouts takes some of {', '.join(LAYOUTS)} (got {bad}); --pairs, --batch, --runs must be >= 1"
                 if bad else "--pairs, --batch and --runs must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="bench_dpo_step_"))
    prompts_file = ROOT / ".cache" / "data" / "ifbench_train.jsonl"
    if not a.smoke and (default_model_dir() / "config.json").is_file() and prompts_file.is_file():
        policy, model_desc = str(default_model_dir()), "SmolLM2-135M-Instruct"
        prompts = [rec["messages"][0]["content"] for _, rec in iter_jsonl(prompts_file)][:a.pairs]
        max_words = 160
    else:
        from online_rlhf.testing import make_tiny_policy

        policy, model_desc = str(make_tiny_policy(work / "policy")), "random 2-layer Llama"
        prompts, max_words = BUILT_IN_PROMPTS, 30
        if a.smoke:
            a.pairs, a.batch, a.runs = 2, 2, 1
    pairs_file = work / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in make_pairs(prompts, a.pairs, a.seed, max_words)))

    settings = ["trl", *layouts]
    results: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(a.runs):
        for s in (settings if r % 2 == 0 else settings[::-1]):
            results[s].append(run_setting(policy, pairs_file, work / f"model_{s}_{r}", s, a.batch, a.max_length))

    from online_rlhf.hardware import cpu_capability, cpu_has_native_bf16, cpu_model

    first = results["trl"][0]
    print(f"\nCPU: {cpu_model()} (torch capability {cpu_capability()}, native bf16: {cpu_has_native_bf16()}); "
          f"{first['dtype']}, {first['threads']} threads; model: {model_desc}; {a.pairs} pairs, batch {a.batch}, "
          f"max_length {a.max_length}, {first['sequence_tokens']} sequence tokens, {first['steps']} steps, "
          f"{a.runs} run(s) each")
    mean = {s: {k: statistics.mean(x[k] for x in results[s])
                for k in ("train_steps_s", "reference_s", "s_per_token", "loss_first", "cpu_s", "steps_cpu_s",
                          "reference_cpu_s")} for s in settings}
    for s in settings:
        m = mean[s]
        print(f"  {s:9s} steps {m['train_steps_s']:7.2f} s = {1e3 * m['s_per_token']:.3f} ms per sequence token; "
              f"reference pass {m['reference_s']:6.2f} s; CPU seconds: steps {m['steps_cpu_s']:6.1f}, reference pass "
              f"{m['reference_cpu_s']:5.1f}, whole stage {m['cpu_s']:6.1f}; first loss {m['loss_first']:.5f}")
    ratios = {}
    for s in layouts:
        ratios[s] = {"steps": mean[s]["train_steps_s"] / mean["trl"]["train_steps_s"],
                     "reference_pass": mean[s]["reference_s"] / mean["trl"]["reference_s"],
                     "steps_cpu": mean[s]["steps_cpu_s"] / mean["trl"]["steps_cpu_s"],
                     "reference_pass_cpu": mean[s]["reference_cpu_s"] / mean["trl"]["reference_cpu_s"],
                     "stage_cpu": mean[s]["cpu_s"] / mean["trl"]["cpu_s"]}
        r = ratios[s]
        print(f"  {s} / trl: wall seconds: steps {r['steps']:.2f}x, reference pass {r['reference_pass']:.2f}x; CPU "
              f"seconds: steps {r['steps_cpu']:.2f}x, reference pass {r['reference_pass_cpu']:.2f}x, whole stage "
              f"{r['stage_cpu']:.2f}x (< 1: faster)")
    loss_diff = max(abs(x["loss_first"] - y["loss_first"]) for s in layouts for x in results[s]
                    for y in results["trl"])
    print(f"  largest first-step loss difference to trl: {loss_diff:.2e}")
    out = {"cpu_model": cpu_model(), "cpu_capability": cpu_capability(), "model": model_desc, "pairs": a.pairs,
           "batch": a.batch, "max_length": a.max_length, "runs": results, "mean": mean, "ratios": ratios,
           "loss_first_max_diff": loss_diff}
    if a.output:
        write_json(a.output, out)
    return out


if __name__ == "__main__":
    main()
