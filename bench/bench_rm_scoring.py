"""Reward model scoring throughput: sorted-length batches vs one input at a time (RLHFlow's way).

    .venv-train/bin/python bench/bench_rm_scoring.py [--prompts 32] [--k 4] [--batch-size 16] [--max-length 1024] [--repeats 2]

Same reward model, same (prompt, response) items, one run: scores every item with
``RewardModel.score(batch_size=B)`` and with ``batch_size=1`` (RLHFlow's annotate script runs its
reward pipeline with batch_size 1), prints items ("pairs") per second of each and the ratio, and
the largest difference between the two sets of scores.

Reward model: the default policy's backbone (``.cache/models/SmolLM2-135M-Instruct``, 135M
parameters) with a fresh one-label score head, saved to a temp dir first; a random 2-layer Llama
when the default is not prepared. Data: AlpacaEval instructions (``../shared/data``) with synthetic
responses of 10-200 words (mixed lengths, as sampled responses have); built-in prompts when absent.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALPACA = REPO.parent / "shared" / "data" / "alpaca_eval" / "alpaca_eval_805_prompts.jsonl"


def build_reward_model(out_dir: Path) -> str:
    """Save a one-label reward model to ``out_dir``; return a description of it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from online_rlhf.paths import default_model_dir
    from online_rlhf.testing import make_tiny_reward_model

    policy = default_model_dir()
    if (policy / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(policy)
        model.config.pad_token_id = tok.pad_token_id
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        n = sum(p.numel() for p in model.parameters())
        return f"SmolLM2-135M-Instruct backbone + random score head ({n / 1e6:.1f}M params)"
    make_tiny_reward_model(out_dir)
    return "tiny random 2-layer Llama RM (default policy not prepared)"


def build_items(n_prompts: int, k: int, seed: int = 0) -> tuple[list[list[dict]], list[str]]:
    """``n_prompts * k`` (prompt messages, response) items with responses of 10-200 words."""
    rng = random.Random(seed)
    if ALPACA.is_file():
        instructions = [json.loads(line)["instruction"] for line in ALPACA.read_text().splitlines() if line.strip()]
    else:
        instructions = [f"Explain topic number {i} in a few paragraphs." for i in range(200)]
    words = " ".join(instructions).split()
    prompts, responses = [], []
    for inst in instructions[:n_prompts]:
        for _ in range(k):
            prompts.append([{"role": "user", "content": inst}])
            responses.append(" ".join(rng.choice(words) for _ in range(rng.randint(10, 200))))
    return prompts, responses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each mode; the best time counts")
    args = ap.parse_args()

    import torch

    from online_rlhf.paths import setup_cache_env
    from online_rlhf.reward_model import RewardModel

    setup_cache_env()
    prompts, responses = build_items(args.prompts, args.k)
    with tempfile.TemporaryDirectory() as tmp:
        what = build_reward_model(Path(tmp) / "rm")
        rm = RewardModel(str(Path(tmp) / "rm"), dtype="auto", max_length=args.max_length)
    lengths = [len(rm.encode(p, r)[0]) for p, r in zip(prompts, responses)]
    print(f"reward model: {what}; {rm.device} {str(rm.dtype).replace('torch.', '')}, torch threads {torch.get_num_threads()}")
    print(f"items: {len(responses)} (prompt, response) pairs, {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f})")

    rm.score(prompts[:2], responses[:2], batch_size=2)  # warm-up
    results = {}
    # Alternate the two modes --repeats times and keep each one's best time, so that load from other
    # processes on a shared machine does not favour whichever ran first.
    for rep in range(args.repeats):
        for bs in (args.batch_size, 1):
            t0 = time.perf_counter()
            scores, _ = rm.score(prompts, responses, batch_size=bs)
            dt = time.perf_counter() - t0
            if bs not in results or dt < results[bs][1]:
                results[bs] = (scores, dt)
            print(f"run {rep + 1} batch_size={bs:>3}: {dt:7.2f} s, {len(responses) / dt:7.2f} pairs/s", flush=True)
    results = {bs: (sc, len(responses) / dt) for bs, (sc, dt) in results.items()}
    for bs in (args.batch_size, 1):
        print(f"best batch_size={bs:>3}: {results[bs][1]:7.2f} pairs/s")
    diff = max(abs(a - b) for a, b in zip(results[args.batch_size][0], results[1][0]))
    ratio = results[args.batch_size][1] / results[1][1]
    print(f"speed-up batched/one-at-a-time: {ratio:.2f}x (target >= 4x); max |score difference| {diff:.2e}")


if __name__ == "__main__":
    sys.exit(main())
