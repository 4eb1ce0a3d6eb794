"""Benchmark: vLLM vs transformers ``generate`` on the same prompts, model and sampling.

    .venv-infer/bin/python -m bench.bench_generation [key=value ...]
    e.g. n_prompts=16 k=2 max_tokens=64 model=/path/to/ckpt

Both engines get the same prompt token ids (``generation/generate.py: prompt_token_ids``, BOS
once), the same K, temperature, top_p, max new tokens and EOS ids. Generated tokens are counted up
to and including each response's EOS. transformers runs first, in this process, batched
``hf_batch_prompts`` prompts x K sequences at a time with left padding; the (dtype, threads)
setting it uses is the fastest of ``hf_dtypes`` x ``hf_threads`` on one calibration batch
(``calib_tokens`` new tokens, after an untimed warm-up).
vLLM then runs like the generation stage (eager, ``kv_cache_gb`` KV cache) and its start-up
is timed separately. Prints tokens/s of each, their ratio and vLLM's start-up seconds; writes
the figures to ``output`` (JSON) when given.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Optional

from pydantic import Field

ROOT = Path(__file__).resolve().parent.parent

from online_rlhf.stages.generate import prompt_token_ids, stop_token_ids
from online_rlhf.stages.vllm_engine import build_engine
from online_rlhf.config import StageConfig, run_main
from online_rlhf.jsonl import write_json
from online_rlhf.paths import default_data_dir, resolve_model, setup_cache_env
from online_rlhf.records import load_prompts
from online_rlhf.stage_configs import GenerateConfig


class BenchConfig(StageConfig):
    """bench/bench_generation.py: vLLM vs transformers generate, tokens/s."""

    model: str = Field("default", description="policy checkpoint dir or 'default'")
    prompts: str = Field(str(default_data_dir() / "ifbench_train.jsonl"), description="prompt set (jsonl)")
    n_prompts: int = Field(64, ge=1, description="first N prompts")
    k: int = Field(4, ge=1, description="responses per prompt")
    max_tokens: int = Field(256, ge=1, description="max new tokens per response")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_model_len: int = Field(2048, ge=16, description="prompts over max_model_len - max_tokens tokens are dropped (both engines)")
    seed: int = Field(42, description="seed of both engines")
    vllm_dtype: str = Field("auto", description="vLLM dtype (auto: the generation stage's choice for this hardware)")
    vllm_enforce_eager: bool = Field(True, description="vLLM eager mode (false: torch.compile, slow first start)")
    kv_cache_gb: float = Field(2.0, gt=0, description="vLLM-CPU KV cache GiB")
    vllm_threads_bind: Optional[str] = Field(None, description="VLLM_CPU_OMP_THREADS_BIND for this run (auto, nobind, 0-1, ...); None = as set")
    hf_dtypes: list[str] = Field(["float32", "bfloat16"], description="transformers dtypes to calibrate")
    hf_threads: list[int] = Field(default_factory=lambda: sorted({1, len(os.sched_getaffinity(0))}), description="torch thread counts to calibrate")
    hf_batch_prompts: int = Field(8, ge=1, description="transformers: prompts per generate() call (x k sequences)")
    calib_tokens: int = Field(32, ge=1, description="max new tokens of the calibration batch")
    skip_hf: bool = Field(False, description="only run vLLM")
    output: Optional[str] = Field(None, description="write the figures to this JSON")


def count_generated(seqs, eos_ids: set[int]) -> int:
    """Tokens per generated row up to and including its first EOS (the rest is padding)."""
    total = 0
    for row in seqs.tolist():
        n = len(row)
        for j, t in enumerate(row):
            if t in eos_ids:
                n = j + 1
                break
        total += n
    return total


def hf_generate(model, batches: list[list[list[int]]], cfg: BenchConfig, max_new: int, pad_id: int,
                eos_ids: list[int]) -> tuple[int, float]:
    """Run transformers generate over ``batches`` of token-id prompts; returns (tokens, seconds)."""
    import torch

    tokens, t0 = 0, time.perf_counter()
    for batch in batches:
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True,
                                 temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=max_new,
                                 num_return_sequences=cfg.k, eos_token_id=eos_ids, pad_token_id=pad_id)
        tokens += count_generated(out[:, width:], set(eos_ids))
    return tokens, time.perf_counter() - t0


def bench_hf(cfg: BenchConfig, model_path: str, prompt_ids: list[list[int]], eos_ids: list[int], pad_id: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    batches = [prompt_ids[i:i + cfg.hf_batch_prompts] for i in range(0, len(prompt_ids), cfg.hf_batch_prompts)]
    calib = []
    for dtype in cfg.hf_dtypes:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        for threads in cfg.hf_threads:
            torch.set_num_threads(threads)
            hf_generate(model, [batches[0][:1]], cfg, 2, pad_id, eos_ids)  # warm-up, untimed
            torch.manual_seed(cfg.seed)
            tok, sec = hf_generate(model, batches[:1], cfg, cfg.calib_tokens, pad_id, eos_ids)
            calib.append({"dtype": dtype, "threads": threads, "tokens_per_s": round(tok / sec, 1)})
            print(f"[bench] transformers calibration {dtype} x {threads} threads: {tok / sec:.1f} tok/s", flush=True)
        del model
        gc.collect()
    best = max(calib, key=lambda c: c["tokens_per_s"])
    torch.set_num_threads(best["threads"])
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, best["dtype"])).eval()
    tokens, sec = hf_generate(model, batches, cfg, cfg.max_tokens, pad_id, eos_ids)
    del model
    gc.collect()
    res = {"dtype": best["dtype"], "threads": best["threads"], "tokens": tokens, "seconds": round(sec, 1),
           "tokens_per_s": round(tokens / sec, 1), "calibration": calib}
    print(f"[bench] transformers {best['dtype']} x {best['threads']} threads: {tokens} tokens in {sec:.1f} s "
          f"= {tokens / sec:.1f} tok/s", flush=True)
    return res


def bench_vllm(cfg: BenchConfig, model_path: str, prompt_ids: list[list[int]], eos_ids: list[int]) -> dict:
    from vllm import SamplingParams

    gcfg = GenerateConfig(model=model_path, prompts=cfg.prompts, output="-", k=cfg.k, max_tokens=cfg.max_tokens,
                          temperature=cfg.temperature, top_p=cfg.top_p, max_model_len=cfg.max_model_len,
                          dtype=cfg.vllm_dtype, kv_cache_gb=cfg.kv_cache_gb, seed=cfg.seed,
                          enforce_eager=cfg.vllm_enforce_eager)
    if cfg.vllm_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.vllm_threads_bind
    import torch

    if not torch.cuda.is_available():
        # as the generation stage runs one CPU shard (generation/launch.py): the engine inside this
        # process, one OpenMP thread per free core; nothing changes when the user set these variables
        from online_rlhf.stages.launch import shard_envs

        env = shard_envs(1, 1)[0]
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        print(f"[bench] vLLM engine environment as the generation stage's: {env or 'set by you'}", flush=True)
    t0 = time.perf_counter()
    llm = build_engine(gcfg, model_path, cfg.seed)
    startup = time.perf_counter() - t0
    params = SamplingParams(n=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                            stop_token_ids=eos_ids)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=True)
    sec = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    finish = sum(c.finish_reason == "length" for o in outs for c in o.outputs)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"[bench] vLLM {cfg.vllm_dtype} (threads bind {bind}): start-up {startup:.1f} s; {tokens} tokens in {sec:.1f} s "
          f"= {tokens / sec:.1f} tok/s ({finish} responses hit max_tokens)", flush=True)
    return {"dtype": cfg.vllm_dtype, "threads_bind": bind, "startup_s": round(startup, 1), "tokens": tokens, "seconds": round(sec, 1),
            "tokens_per_s": round(tokens / sec, 1), "length_finished": finish}


def main(cfg: BenchConfig) -> dict:
    setup_cache_env()
    from transformers import AutoTokenizer

    model_path = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = load_prompts(cfg.prompts, limit=cfg.n_prompts)
    prompt_ids = [ids for ids in (prompt_token_ids(tok, p["prompt"]) for p in prompts)
                  if len(ids) <= cfg.max_model_len - cfg.max_tokens]
    eos_ids = stop_token_ids(tok, model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    print(f"[bench] {model_path}: {len(prompt_ids)} prompts x k={cfg.k}, max_tokens={cfg.max_tokens}, "
          f"temperature={cfg.temperature}; cores: {len(os.sched_getaffinity(0))}", flush=True)
    res = {"config": cfg.model_dump(), "prompts_used": len(prompt_ids)}
    if not cfg.skip_hf:
        res["transformers"] = bench_hf(cfg, model_path, prompt_ids, eos_ids, pad_id)
    res["vllm"] = bench_vllm(cfg, model_path, prompt_ids, eos_ids)
    if "transformers" in res:
        res["ratio_vllm_over_transformers"] = round(res["vllm"]["tokens_per_s"] / res["transformers"]["tokens_per_s"], 2)
        print(f"[bench] vLLM / transformers = {res['ratio_vllm_over_transformers']}x tokens/s "
              f"(vLLM start-up {res['vllm']['startup_s']} s not included)", flush=True)
    if cfg.output:
        write_json(cfg.output, res)
    return res


if __name__ == "__main__":
    run_main(main, BenchConfig)
