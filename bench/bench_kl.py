"""KL stage: dtype auto (bf16 autocast where the hardware has native bf16) vs float32, same records.

    .venv-train/bin/python -m bench.bench_kl [--prompts 64] [--k 1] [--runs 2] [--smoke] [--output FIGURES.json]

Runs the KL stage (``online_rlhf.stages.kl_estimate.main``, in this process, its threads) on the
same records with ``dtype: float32`` (the stage's setting before ``auto``) and ``dtype: auto``,
``--runs`` times each, the order reversed every other run; prints each setting's mean seconds (model
loads included, as the stage's stats count them), the ratio auto / float32 (< 1: faster), the KL
estimates with their standard errors and the largest per-response log-prob difference.

Records: the first ``--prompts`` held-out IFBench prompts (``.cache/data/ifbench_eval.jsonl``) with
``--k`` responses each of 10-160 words drawn from the prompt's words (seeded), with their token ids
as the loop's ``kl_generate`` saves them; policy: the embedded SmolLM2-135M-Instruct; reference:
the same model with Gaussian noise (std 0.1 x each weight tensor's std) added to every weight, so
the KL is far from 0 (a trained policy's is 1-2 nats per response). ``--smoke`` (or an unprepared
default) uses random 2-layer Llamas and 4 built-in prompts, for the test suite.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from online_rlhf.jsonl import iter_jsonl, read_jsonl, write_json, write_jsonl
from online_rlhf.paths import default_model_dir

ROOT = Path(__file__).resolve().parent.parent

BUILT_IN_PROMPTS = ["Write two sentences about the sea.", "List three colours.", "Explain a prime number.",
                    "Describe a cat in five words."]


def noisy_copy(src: str, dst: Path, scale: float = 0.1, seed: int = 0) -> str:
    """Save ``src`` with N(0, (scale x std of the tensor)^2) noise added to every weight to ``dst``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn_like(p) * p.std() * scale)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return str(dst)


def make_records(policy: str, prompts: list[str], k: int, seed: int, max_words: int) -> list[dict]:
    """Generated-records shape (``prompt``, ``responses``, ``finish_reasons``, ``response_tokens``,
    ``prompt_token_ids``, ``response_token_ids``) with word-salad responses, as kl_generate writes them."""
    from transformers import AutoTokenizer

    from online_rlhf.stages.kl_estimate import response_token_ids

    tok = AutoTokenizer.from_pretrained(policy)
    rng = random.Random(seed)
    out = []
    for i, text in enumerate(prompts):
        words = text.split() or ["word"]
        prompt = [{"role": "user", "content": text}]
        resp = [" ".join(rng.choice(words) for _ in range(rng.randint(10, max_words))) for _ in range(k)]
        ids = [response_token_ids(tok, prompt, r, "stop") for r in resp]
        out.append({"id": str(i), "prompt": prompt, "responses": resp, "finish_reasons": ["stop"] * k,
                    "response_tokens": [len(r) for _, r in ids], "prompt_token_ids": ids[0][0],
                    "response_token_ids": [r for _, r in ids]})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts (the default run's eval_limit)")
    ap.add_argument("--k", type=int, default=1, help="responses per prompt (the default run's kl_samples)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="random 2-layer models, 4 prompts: seconds, for the tests")
    ap.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.k < 1 or a.runs < 1:
        ap.error("--prompts, --k and --runs must be >= 1")
    from online_rlhf.stage_configs import KLConfig
    from online_rlhf.stages import kl_estimate

    work = Path(tempfile.mkdtemp(prefix="bench_kl_"))
    prompts_file = ROOT / ".cache" / "data" / "ifbench_eval.jsonl"
    if not a.smoke and (default_model_dir() / "config.json").is_file() and prompts_file.is_file():
        policy, model_desc = str(default_model_dir()), "SmolLM2-135M-Instruct"
        prompts = [rec["messages"][0]["content"] for _, rec in iter_jsonl(prompts_file)][:a.prompts]
        max_words = 160
    else:
        from online_rlhf.testing import make_tiny_policy

        policy, model_desc = str(make_tiny_policy(work / "policy")), "random 2-layer Llama"
        prompts, max_words, a.runs = BUILT_IN_PROMPTS, 30, 1
    reference = noisy_copy(policy, work / "reference")
    write_jsonl(work / "kl_generated.jsonl", make_records(policy, prompts, a.k, a.seed, max_words))

    settings = ("float32", "auto")
    results: dict[str, list] = {s: [] for s in settings}
    for r in range(a.runs):
        for s in (settings if r % 2 == 0 else settings[::-1]):
            out = work / f"kl_{s}_{r}.jsonl"
            st = kl_estimate.main(KLConfig(input=str(work / "kl_generated.jsonl"), policy=policy, reference=reference,
                                           output=str(out), dtype=s))
            results[s].append({"seconds": st.seconds, "kl_mean": st.kl_mean, "kl_se": st.kl_se, "dtype": st.dtype,
                               "tokens": st.tokens, "threads": st.hardware.get("threads"),
                               "logp": [x for row in read_jsonl(out) for x in row["logp_policy"] + row["logp_reference"]]})
    from online_rlhf.hardware import cpu_capability, cpu_has_native_bf16, cpu_model

    mean_s = {s: statistics.mean(x["seconds"] for x in results[s]) for s in settings}
    f32, auto = results["float32"][0], results["auto"][0]
    ratio = mean_s["auto"] / mean_s["float32"]
    logp_diff = max(abs(x - y) for x, y in zip(f32["logp"], auto["logp"]))
    print(f"\nCPU: {cpu_model()} (torch capability {cpu_capability()}, native bf16: {cpu_has_native_bf16()}); "
          f"{f32['threads']} threads; model: {model_desc}; {len(prompts)} prompts x {a.k}, {f32['tokens']} tokens "
          f"per model; {a.runs} run(s) each")
    for s in settings:
        x = results[s][0]
        print(f"  dtype {s:8s} ({x['dtype']}): {mean_s[s]:6.2f} s; KL {x['kl_mean']:.4f} (se {x['kl_se']:.4f}) nats")
    print(f"  auto / float32: {ratio:.2f}x seconds (< 1: faster); KL difference {auto['kl_mean'] - f32['kl_mean']:+.4f} "
          f"nats = {abs(auto['kl_mean'] - f32['kl_mean']) / f32['kl_se']:.3f} standard errors; largest per-response "
          f"log-prob difference {logp_diff:.4f} nats")
    out = {"cpu_model": cpu_model(), "cpu_capability": cpu_capability(), "model": model_desc,
           "prompts": len(prompts), "k": a.k, "seconds": mean_s, "ratio_auto_over_float32": ratio,
           "kl": {s: results[s][0]["kl_mean"] for s in settings}, "kl_se": f32["kl_se"],
           "logp_max_diff": logp_diff, "dtypes": {s: results[s][0]["dtype"] for s in settings}}
    if a.output:
        write_json(a.output, out)
    return out


if __name__ == "__main__":
    main()
