"""Benchmark: vLLM decoding a base + LoRA adapter (the loop's ``lora`` key) vs the merged checkpoint.

    .venv-infer/bin/python -m bench.bench_lora_decode adapter=runs/x/iter_1/model [key=value ...]
    e.g. n_prompts=32 k=8 max_tokens=128

The same prompts (the generation stage's token ids), K and sampling settings are decoded twice,
each in a fresh process with the generation stage's engine (:func:`online_rlhf.stages.vllm_engine.build_engine`):
the base with ``enable_lora`` and a ``LoRARequest`` for ``adapter`` (what the loop's generation,
evaluation, IFEval and KL decoding do under ``lora``), and the merged checkpoint (``merged``; when
not given, ``scripts/merge_lora.py`` writes one with the training env first). Every response
generates exactly ``max_tokens`` tokens (``ignore_eos``), so both decode the same token count.
Prints each engine's start-up and decode seconds, tokens/s and the ratio lora / merged of the
decode seconds, measured in this one run; writes them to ``output`` (JSON) when given.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from online_rlhf.config import StageConfig, run_main
from online_rlhf.jsonl import write_json
from online_rlhf.paths import default_data_dir

ROOT = Path(__file__).resolve().parent.parent


class BenchConfig(StageConfig):
    """bench/bench_lora_decode.py: vLLM decode seconds, base + LoRA adapter vs the merged checkpoint."""

    adapter: str = Field(..., description="the LoRA adapter folder (iter_<i>/model of a run with the loop's lora key)")
    merged: Optional[str] = Field(None, description="the merged checkpoint of the same adapter; None: scripts/merge_lora.py writes one into a temporary folder")
    prompts: str = Field(str(default_data_dir() / "ifbench_train.jsonl"), description="prompt set (jsonl)")
    n_prompts: int = Field(32, ge=1, description="first N prompts")
    k: int = Field(8, ge=1, description="responses per prompt")
    max_tokens: int = Field(128, ge=1, description="new tokens per response (every response generates exactly this many)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature")
    max_model_len: int = Field(1536, ge=16, description="the engines' context")
    kv_cache_gb: float = Field(2.0, gt=0, description="vLLM-CPU KV cache GiB")
    seed: int = Field(42, description="engine seed")
    worker: Optional[Literal["lora", "merged"]] = Field(None, description="internal: decode with one engine and print its figures as JSON")
    output: Optional[str] = Field(None, description="write the figures to this JSON")


def _decode(cfg: BenchConfig) -> dict:
    """One engine (``cfg.worker``): start, decode the prompts, return seconds and token counts."""
    import time

    from transformers import AutoTokenizer

    from online_rlhf.adapters import adapter_base
    from online_rlhf.records import load_prompts
    from online_rlhf.stage_configs import GenerateConfig
    from online_rlhf.stages.generate import prompt_token_ids
    from online_rlhf.stages.vllm_engine import build_engine, lora_request

    from vllm import SamplingParams

    lora = cfg.worker == "lora"
    model = adapter_base(cfg.adapter) if lora else cfg.merged
    gen = GenerateConfig(model=model, adapter=cfg.adapter if lora else None, prompts=cfg.prompts, output="/dev/null",
                         k=cfg.k, max_tokens=cfg.max_tokens, max_model_len=cfg.max_model_len,
                         kv_cache_gb=cfg.kv_cache_gb, temperature=cfg.temperature)
    tok = AutoTokenizer.from_pretrained(model)
    ids = [prompt_token_ids(tok, r["prompt"]) for r in load_prompts(cfg.prompts, limit=cfg.n_prompts)]
    t0 = time.perf_counter()
    llm = build_engine(gen, model, cfg.seed)
    start_s = time.perf_counter() - t0
    params = SamplingParams(n=cfg.k, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                            min_tokens=cfg.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False, lora_request=lora_request(gen.adapter))
    decode_s = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"engine": cfg.worker, "start_s": round(start_s, 2), "decode_s": round(decode_s, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / decode_s, 1)}


def _run_worker(cfg: BenchConfig, which: str, merged: str) -> dict:
    args = [f"{k}={v}" for k, v in cfg.model_dump(exclude={"worker", "output", "merged"}).items()]
    r = subprocess.run([sys.executable, "-m", "bench.bench_lora_decode", *args, f"merged={merged}", f"worker={which}"],
                       cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ,
                                                                      "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if r.returncode != 0:
        raise RuntimeError(f"the {which} engine failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(cfg: BenchConfig) -> dict:
    if cfg.worker:
        out = _decode(cfg)
        print(json.dumps(out))
        return out
    with tempfile.TemporaryDirectory() as tmp:
        merged = cfg.merged
        if merged is None:
            merged = str(Path(tmp) / "merged")
            train_python = ROOT / ".venv-train" / "bin" / "python"
            subprocess.run([str(train_python), str(ROOT / "scripts" / "merge_lora.py"), cfg.adapter, merged], check=True,
                           cwd=ROOT, capture_output=True)
        figures = {w: _run_worker(cfg, w, merged) for w in ("merged", "lora")}
    ratio = figures["lora"]["decode_s"] / figures["merged"]["decode_s"]
    result = {"settings": cfg.model_dump(exclude={"worker", "output"}), **figures, "decode_s_ratio_lora_over_merged": round(ratio, 3)}
    for w in ("merged", "lora"):
        f = figures[w]
        print(f"{w:>6}: start {f['start_s']} s, decode {f['decode_s']} s, {f['tokens']} tokens, {f['tokens_per_s']} tok/s")
    print(f"decode seconds, lora / merged: {ratio:.2f}x ({cfg.n_prompts} prompts x k={cfg.k} x {cfg.max_tokens} tokens)")
    if cfg.output:
        write_json(cfg.output, result)
    return result


if __name__ == "__main__":
    run_main(main, BenchConfig)
