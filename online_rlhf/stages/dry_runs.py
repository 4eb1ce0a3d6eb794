"""The stages' dry runs (``dry_run=true``): one step at the largest shapes, peak memory and seconds.

Each function is called by its stage's ``main`` once the stage's config checks have passed, runs
the stage's own model set-up, and writes :class:`~online_rlhf.stats.DryRunStats` to
``online_rlhf.dry_run.dry_run_path(<the stage's output>)`` and one summary line to stdout. None
of them reads the stage's input file (pairs, generated records, SFT rows: dummy token ids stand in)
or writes its output, stats or checkpoint. Memory: ``online_rlhf.memory.PeakMemory``.

- :func:`dpo`: TRL's own path: the stage's ``DPOTrainer`` (same model loading, dtype, precision,
  LoRA, DeepSpeed profile, reference log-prob precompute) trains ``max_steps=1`` on
  ``per_device_train_batch_size x gradient_accumulation_steps x processes`` dummy pairs whose
  prompt + response fills ``training.max_length`` for chosen and rejected alike: one optimizer step
  (forward + backward of every micro-batch, then the optimizer step). The trainer works in
  ``<output_dir>.dry_run.work``, removed at the end.
- :func:`grpo`: the stage's own path: its model loading (dtype, gradient checkpointing, the
  reference when ``beta > 0``), ``accelerate`` set-up (DDP / DeepSpeed profile), old (and reference)
  log-prob passes and :func:`online_rlhf.stages.run_grpo.train` for one optimizer step on
  ``per_device_train_batch_size x gradient_accumulation_steps x processes`` dummy completions whose
  prompt + completion is exactly ``max_length`` tokens (``max_completion_length`` of completion):
  forward + backward of every micro-batch, then the AdamW step. Nothing is saved.
- :func:`sft`: not through Axolotl: the base model loaded with transformers in Axolotl's dtype
  (bf16 when ``bf16`` is on, fp16 with ``fp16``, else fp32) and attention, ``micro_batch_size``
  dummy rows of ``sequence_len`` tokens, forward + backward + one ``torch.optim.AdamW`` step, in one
  process (under DeepSpeed ZeRO the real per-GPU share of optimizer state is smaller).
- :func:`generate`: the stage's vLLM engine; one batch (as many prompts as the engine runs at once,
  at most the shard's prompt count) of dummy prompts of ``max_model_len - max_tokens`` tokens, ``k``
  samples each, every one generating exactly ``max_tokens`` tokens (``ignore_eos``, ``min_tokens``).
- :func:`rewards`: the reward model scores one batch of ``batch_size`` dummy inputs of
  ``max_length`` tokens (``source=reward_model``; other sources load no model: nothing to check).

With several processes (DPO, reward model) every rank measures itself; on CPU the ranks share the
machine, so their peaks are summed; on GPUs each has its own device, so the largest is reported.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from online_rlhf.config import ConfigError
from online_rlhf.checkpoint import rmtree
from online_rlhf.dry_run import GIB, dry_run_path
from online_rlhf.memory import PeakMemory
from online_rlhf.stats import DryRunStats

DPO_ARGS = {"max_steps": 1, "report_to": "none", "save_strategy": "no", "logging_steps": 1}


def dpo_work_dir(output_dir: str | os.PathLike) -> Path:
    """The DPO trainer's working folder in a dry run: ``<output_dir>.dry_run.work`` (removed at the end)."""
    return Path(f"{Path(output_dir).resolve()}.dry_run.work")


def dummy_ids(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` sequences of ``length`` random token ids, none of them a special token (a different
    sequence each, so vLLM's prefix cache cannot share their KV blocks)."""
    import random

    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def _oom_errors() -> tuple[type, ...]:
    import torch

    return (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (RuntimeError,)


def _gather(obj: Any) -> list:
    """``obj`` of every rank (rank order) when torch.distributed runs with several ranks, else ``[obj]``."""
    try:
        import torch.distributed as dist
    except ImportError:
        return [obj]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def finish(stage: str, mem: PeakMemory, output: str | os.PathLike, *, status: str, error: Optional[str],
           step_s: Optional[float], step: str, shapes: dict, settings: dict, t_start: float,
           preallocated: bool = False, gather: bool = True) -> Optional[DryRunStats]:
    """Combine the ranks' measurements, write the result beside ``output`` (rank 0) and print one line.

    Returns:
        the result on rank 0 (None on the other ranks).
    """
    mine = {"peak": mem.peak, "limit": mem.limit, "start_rss": mem.start_rss, "step_s": step_s}
    ranks = _gather(mine) if gather else [mine]
    peaks = [r["peak"] for r in ranks]
    if mem.device == "cuda":
        peak = max(peaks)
        limits = [r["limit"] for r in ranks if r["limit"]]
        limit = min(limits) if limits else None
    else:  # the ranks share the machine's memory: what each used adds up; what they held at the start was free
        peak = sum(peaks)
        limit = None if mem.limit is None else mem.limit + sum(r["start_rss"] for r in ranks[1:])
    steps = [r["step_s"] for r in ranks if r["step_s"] is not None]
    if not _is_main():
        return None
    result = DryRunStats(
        stage=stage, status=status, error=error, device=mem.device, memory_measure=mem.measure
        + (f", summed over {len(ranks)} processes" if len(ranks) > 1 and mem.device == "cpu" else "")
        + (f", largest of {len(ranks)} processes" if len(ranks) > 1 and mem.device == "cuda" else ""),
        peak_memory_gib=round(peak / GIB, 3) if peak else None,
        memory_limit_gib=round(limit / GIB, 3) if limit else None, preallocated=preallocated,
        per_process_peak_gib=[round(p / GIB, 3) for p in peaks], processes=len(ranks),
        seconds_per_step=round(max(steps), 3) if steps else None, step=step, shapes=shapes, settings=settings,
        seconds_total=round(time.perf_counter() - t_start, 2))
    path = result.write(dry_run_path(output))
    use = (f" = {100 * result.peak_memory_gib / result.memory_limit_gib:.0f}% of {result.memory_limit_gib:.2f} GiB"
           if result.peak_memory_gib and result.memory_limit_gib else "")
    print(f"dry run {stage}: {status}; peak {result.peak_memory_gib} GiB ({result.memory_measure}){use}; "
          f"{result.seconds_per_step} s/step ({step}); nothing written but {path}", flush=True)
    return result


# --------------------------------------------------------------------------------------------- DPO

def dpo(cfg, args, lora_config, policy_path: str, ref_path: Optional[str], pol_dtype: str, ref_dtype: str,
        trust: bool, on_gpu: bool, t_start: float) -> Optional[DryRunStats]:
    """The DPO stage's dry run (module docstring); ``args`` is the stage's ``DPOConfig`` built with
    :data:`DPO_ARGS` over it and :func:`dpo_work_dir` as its output_dir.

    Raises:
        ConfigError: ``training.max_length`` is null (no largest shape to try), or the tokenizer
            has no chat template.
        SystemExit(1): the step ran out of (GPU) memory, after the result was written.
    """
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    from online_rlhf.jsonl import write_jsonl
    from online_rlhf.stages import run_dpo as R

    if args.max_length is None:
        raise ConfigError("dry_run needs training.max_length (the sequence length to try); it is null.")
    L = int(args.max_length)
    B, ga, world = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps), R._world_size()
    work = Path(args.output_dir)
    prompt_len = max(1, L // 2)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    status, error = "ok", None
    with PeakMemory("cuda" if on_gpu else "cpu") as mem:
        try:
            tokenizer = AutoTokenizer.from_pretrained(policy_path, trust_remote_code=trust)
            if tokenizer.chat_template is None:
                raise ConfigError(f"{policy_path}: the tokenizer has no chat template; conversational pairs need one.")
            n = B * ga * world
            ids = dummy_ids(tokenizer, 3 * n, L - prompt_len, seed=1)
            rows = [{"prompt_ids": ids[3 * j][:prompt_len], "chosen_ids": ids[3 * j + 1], "rejected_ids": ids[3 * j + 2]}
                    for j in range(n)]
            import datasets

            with args.main_process_first(local=True, desc="DPO dry-run pairs"):
                if args.local_process_index == 0:
                    rmtree(work)
                    write_jsonl(work / "pairs_dummy.jsonl", rows)
                train_ds = datasets.load_dataset("json", data_files=str(work / "pairs_dummy.jsonl"), split="train",
                                                 cache_dir=str(work / "hf_datasets"))
            policy = R._load_causal_lm(policy_path, pol_dtype, cfg.attn_implementation, trust)
            ref_model = None
            if ref_path is not None:
                ref_model = R._load_causal_lm(ref_path, ref_dtype, cfg.attn_implementation, trust)
            elif not args.precompute_ref_log_probs and lora_config is None:
                ref_model = R._load_causal_lm(policy_path, pol_dtype, cfg.attn_implementation, trust)
            trainer = R._timed_trainer_class(R.log_probs_layout(cfg.log_probs, on_gpu))(model=policy, ref_model=ref_model, args=args, train_dataset=train_ds,
                                               processing_class=tokenizer, peft_config=lora_config)
            trainer.add_callback(StepTimer())
            if args.precompute_ref_log_probs and trainer.ref_model is not None:
                trainer.ref_model = None  # as the stage does: freed before training
                ref_model = None
            trainer.train()
        except _oom_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {"train_batch_size": cfg.train_batch_size, "training.per_device_train_batch_size": B,
                "training.gradient_accumulation_steps": ga, "training.max_length": L,
                "training.gradient_checkpointing": bool(args.gradient_checkpointing),
                "training.precompute_ref_log_probs": bool(args.precompute_ref_log_probs), "lora": cfg.lora,
                "torch_dtype": pol_dtype, "bf16": bool(args.bf16), "fp16": bool(args.fp16),
                "launch_profile": cfg.launch_profile, "num_processes": world}
    step = (f"1 optimizer step: {ga} micro-batch(es) x {B} pairs x (chosen + rejected) x {L} tokens per process, "
            f"forward + backward + {getattr(args.optim, 'value', args.optim)} step" + (", reference log-probs precomputed first"
                                                          if args.precompute_ref_log_probs else ", reference in the step"))
    shapes = {"pairs_per_process": B * ga, "micro_batch_pairs": B, "sequences_per_forward": 2 * B,
              "sequence_tokens": L, "prompt_tokens": prompt_len, "response_tokens": L - prompt_len}
    result = finish("dpo", mem, cfg.output_dir, status=status, error=error, step_s=times[-1] if times else None,
                    step=step, shapes=shapes, settings=settings, t_start=t_start)
    if _is_main():
        rmtree(work)
    if status != "ok":
        print(f"error: dry run dpo: out of memory: {error}", file=sys.stderr)
        raise SystemExit(1)
    return result


# -------------------------------------------------------------------------------------------- GRPO

def grpo(cfg, on_gpu: bool, t_start: float) -> Optional[DryRunStats]:
    """The GRPO stage's dry run (module docstring), after the stage's config and process-count checks.

    Raises:
        ConfigError: ``max_length`` is null (no largest shape to try), or the tokenizer has no chat template.
        SystemExit(1): the step ran out of (GPU) memory, after the result was written.
    """
    import torch
    from transformers import AutoTokenizer

    from online_rlhf.paths import resolve_model
    from online_rlhf.stages import run_grpo as G

    if cfg.max_length is None:
        raise ConfigError("dry_run needs max_length (prompt + completion tokens to try); it is null. Set it, e.g. "
                          "max_length=1024 (in the loop: grpo.max_length).")
    L = int(cfg.max_length)
    C = min(int(cfg.max_completion_length), L - 1)  # at least one prompt token
    P = L - C
    B, ga = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    status, error, step_s, world, dtype = "ok", None, None, G._world_size(), cfg.torch_dtype
    with PeakMemory("cuda" if on_gpu else "cpu") as mem:
        try:
            policy_path = resolve_model(cfg.policy)
            tokenizer = AutoTokenizer.from_pretrained(policy_path)
            if tokenizer.chat_template is None:
                raise ConfigError(f"{policy_path}: the tokenizer has no chat template; conversational prompts need one.")
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            accelerator = G._accelerator(cfg)
            world = accelerator.num_processes
            n = B * ga * world  # one optimizer step
            ids = dummy_ids(tokenizer, 2 * n, max(P, C), seed=5)
            completions = [{"prompt_ids": ids[2 * j][:P], "completion_ids": ids[2 * j + 1][:C],
                            "advantage": 1.0 if j % 2 == 0 else -1.0, "group": j // 2} for j in range(n)]
            model, optimizer, ref_model, _, _, _, dtype = G.prepare_models(cfg, accelerator, policy_path, on_gpu,
                                                                            with_reference=True)
            old, ref = G.old_and_reference_log_probs(cfg, accelerator, model, ref_model, completions, pad_id)
            ref_model = None
            t0 = time.perf_counter()
            G.train(cfg.model_copy(update={"num_iterations": 1}), accelerator, model, optimizer, completions, old, ref,
                    pad_id)
            if on_gpu:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        except _oom_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {"per_device_train_batch_size": B, "gradient_accumulation_steps": ga, "max_length": L,
                "gradient_checkpointing": cfg.gradient_checkpointing, "beta": cfg.beta, "torch_dtype": dtype,
                "launch_profile": cfg.launch_profile, "num_processes": world}
    step = (f"1 optimizer step: {ga} micro-batch(es) x {B} completions x {L} tokens ({P} prompt + {C} completion) "
            "per process, forward + backward + AdamW step, old log-probs" + (" and reference log-probs"
                                                                           if cfg.beta != 0.0 else "") + " first")
    shapes = {"completions_per_process": B * ga, "micro_batch_completions": B, "sequence_tokens": L,
              "prompt_tokens": P, "completion_tokens": C}
    result = finish("grpo", mem, cfg.output_dir, status=status, error=error, step_s=step_s, step=step, shapes=shapes,
                    settings=settings, t_start=t_start)
    if status != "ok":
        print(f"error: dry run grpo: out of memory: {error}", file=sys.stderr)
        raise SystemExit(1)
    return result


# --------------------------------------------------------------------------------------------- SFT

def sft(cfg, ax: dict, base: str, t_start: float) -> DryRunStats:
    """The SFT stage's dry run (module docstring); ``ax`` is the resolved Axolotl config.

    Raises:
        SystemExit(1): the step ran out of (GPU) memory, after the result was written.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from online_rlhf.hardware import stage_threads

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(stage_threads())
    seq, mb = int(ax.get("sequence_len") or 2048), int(ax.get("micro_batch_size") or 1)
    bf16 = ax.get("bf16") is True or (ax.get("bf16") == "auto" and on_gpu and torch.cuda.is_bf16_supported())
    dtype = torch.bfloat16 if bf16 else torch.float16 if ax.get("fp16") is True else torch.float32
    attn = "flash_attention_2" if ax.get("flash_attention") else (ax.get("attn_implementation") or "sdpa")
    checkpointing = bool(ax.get("gradient_checkpointing"))
    device = torch.device("cuda" if on_gpu else "cpu")
    status, error, step_s = "ok", None, None
    with PeakMemory(device.type) as mem:
        try:
            tok = AutoTokenizer.from_pretrained(base)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation=attn).to(device)
            if checkpointing:
                model.gradient_checkpointing_enable()
            model.config.use_cache = False
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=float(ax.get("learning_rate") or 1e-5))
            ids = torch.tensor(dummy_ids(tok, mb, seq, seed=2), device=device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on_gpu:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        except _oom_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {k: ax.get(k) for k in ("micro_batch_size", "sequence_len", "gradient_accumulation_steps",
                                       "gradient_checkpointing", "sample_packing", "bf16", "fp16", "optimizer",
                                       "deepspeed")}
    settings.update(micro_batch_size=mb, sequence_len=seq)
    step = (f"1 step: {mb} rows x {seq} tokens, forward + backward + AdamW step, {str(dtype).replace('torch.', '')} "
            f"weights, {attn}, one process (transformers, not Axolotl)")
    result = finish("sft", mem, cfg.output_dir, status=status, error=error, step_s=step_s, step=step,
                    shapes={"rows": mb, "sequence_tokens": seq}, settings=settings, t_start=t_start, gather=False)
    if status != "ok":
        print(f"error: dry run sft: out of memory: {error}", file=sys.stderr)
        raise SystemExit(1)
    return result


# -------------------------------------------------------------------------------------- generation

def _engine_out_of_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, _oom_errors()) or ("memory" in text and ("cache" in text or "out of" in text))


def generate(cfg) -> DryRunStats:
    """The generation stage's dry run for one shard (module docstring); writes beside ``cfg.output``.

    Raises:
        SystemExit(1): the engine could not start or generate for lack of memory, after the result
            was written.
    """
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from online_rlhf.paths import resolve_model, setup_cache_env
    from online_rlhf.records import load_prompts
    from online_rlhf.stages import generate as G

    t_start = time.perf_counter()
    setup_cache_env()
    model_path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    shard = G.shard_prompts(load_prompts(cfg.prompts, cfg.prompt_split, cfg.prompt_field, cfg.limit),
                            cfg.shard_index, cfg.num_shards)
    device, dtype = G.engine_dtype(cfg)
    prompt_len = cfg.max_model_len - cfg.max_tokens
    status, error, gen_s, n, tokens = "ok", None, None, 0, []
    with PeakMemory(device, children=True, device_wide=True) as mem:
        try:
            llm = G.build_engine(cfg, model_path, cfg.seed + cfg.shard_index)
            try:
                max_seqs = int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
            except (AttributeError, TypeError, ValueError):
                max_seqs = 256
            n = max(1, min(len(shard) or 1, max_seqs // cfg.k))
            params = SamplingParams(n=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                    min_tokens=cfg.max_tokens, ignore_eos=True)
            prompts = [{"prompt_token_ids": ids} for ids in dummy_ids(tokenizer, n, prompt_len, seed=3)]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            gen_s = time.perf_counter() - t0
            tokens = [len(c.token_ids) for o in outputs for c in o.outputs]
        except Exception as e:  # vLLM wraps a CUDA OOM or a too-small KV cache in its own errors
            if not _engine_out_of_memory(e):
                raise
            status, error = "out_of_memory", f"{type(e).__name__}: {str(e)[:1000]}"
    settings = {k: getattr(cfg, k) for k in ("max_model_len", "max_tokens", "k", "kv_cache_gb", "gpu_memory_utilization",
                                             "tensor_parallel_size", "num_shards", "dtype", "enforce_eager")}
    settings["dtype"] = dtype
    step = (f"1 batch: {n} prompts x {prompt_len} tokens x k={cfg.k} samples x {cfg.max_tokens} new tokens "
            f"(the shard's prompts, at most max_num_seqs / k)" if n else "engine start")
    shapes = {"prompts": n, "prompt_tokens": prompt_len, "k": cfg.k, "max_tokens": cfg.max_tokens,
              "generated_tokens_min": min(tokens) if tokens else None,
              "generated_tokens_max": max(tokens) if tokens else None, "sequences": len(tokens),
              "tokens_per_s": round(sum(tokens) / gen_s, 1) if gen_s else None}
    result = finish("generate", mem, cfg.output, status=status, error=error, step_s=gen_s, step=step, shapes=shapes,
                    settings=settings, t_start=t_start, preallocated=device == "cuda", gather=False)
    if status != "ok":
        print(f"error: dry run generate: out of memory: {error}", file=sys.stderr)
        raise SystemExit(1)
    return result


def launch_generate(cfg) -> DryRunStats:
    """``generation/launch.py dry_run=true``: shard 0 alone, with the environment the launcher gives it
    (its GPUs, or its CPU cores and in-process engine), writing its result beside ``cfg.output``. On
    CPU, W > 1 shards share the machine's memory: the peak is multiplied by W.

    Raises:
        SystemExit: the shard failed (its exit code; its log is printed).
    """
    from online_rlhf.jsonl import atomic_open
    from online_rlhf.stages import launch as L
    from online_rlhf.stages.merge_data import shards_dir_of

    shards_dir, w = shards_dir_of(cfg), cfg.num_shards
    shards_dir.mkdir(parents=True, exist_ok=True)
    config_path = shards_dir / "generate_config.dry_run.yaml"
    with atomic_open(config_path) as f:
        f.write(cfg.model_copy(update={"shard_index": 0, "shards_dir": None}).to_yaml())
    out = dry_run_path(cfg.output)
    out.unlink(missing_ok=True)
    env = L.shard_envs(w, cfg.tensor_parallel_size)[0]
    log = shards_dir / "shard_00.dry_run.log"
    cmd = [sys.executable, "-m", L.GENERATE, "--config", str(config_path), "shard_index=0", f"num_shards={w}",
           f"output={cfg.output}"]
    rc = L.start_shard(cmd, log, env).wait()
    print(L.tail(log), flush=True)
    if rc != 0 and not out.is_file():
        print(f"[launch] dry run: shard 0 failed (exit {rc}); log: {log}", file=sys.stderr)
        raise SystemExit(rc if rc > 0 else 1)
    result = DryRunStats.read(out)
    if result.device == "cpu" and w > 1 and result.peak_memory_gib:
        result = result.model_copy(update={"peak_memory_gib": round(result.peak_memory_gib * w, 3), "processes": w,
                                           "step": result.step + f"; shard 0 of {w}, peak x{w} (CPU shards share RAM)"})
        result.write(out)
    if rc != 0:
        raise SystemExit(rc if rc > 0 else 1)
    return result


# ------------------------------------------------------------------------------------ reward model

def rewards(cfg) -> Optional[DryRunStats]:
    """The rewards stage's dry run (module docstring); writes beside ``cfg.output``. A source other
    than ``reward_model`` loads no model: prints so and writes nothing.

    Raises:
        SystemExit(1): the batch ran out of (GPU) memory, after the result was written.
    """
    t_start = time.perf_counter()
    if cfg.source != "reward_model":
        print(f"dry run rewards: source={cfg.source} loads no model here; nothing to check.")
        return None
    import torch

    from online_rlhf.hardware import stage_threads
    from online_rlhf.reward_model import RewardModel, distributed_state

    state = distributed_state()
    if state.device.type == "cpu":
        torch.set_num_threads(stage_threads(state.num_processes))
    status, error, step_s, length = "ok", None, None, cfg.max_length
    with PeakMemory(state.device.type) as mem:
        try:
            rm = RewardModel(cfg.reward_model, dtype=cfg.dtype, device=state.device, max_length=cfg.max_length)
            length = rm.max_length
            seqs = dummy_ids(rm.tokenizer, cfg.batch_size, length, seed=4)
            t0 = time.perf_counter()
            rm.score_ids(seqs, cfg.batch_size)
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        except _oom_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {"batch_size": cfg.batch_size, "max_length": cfg.max_length, "dtype": cfg.dtype,
                "num_processes": state.num_processes}
    step = f"1 batch: {cfg.batch_size} inputs x {length} tokens, forward (no grad) per process"
    result = finish("rewards", mem, cfg.output, status=status, error=error, step_s=step_s, step=step,
                    shapes={"inputs": cfg.batch_size, "tokens": length}, settings=settings, t_start=t_start)
    if status != "ok":
        print(f"error: dry run rewards: out of memory: {error}", file=sys.stderr)
        raise SystemExit(1)
    return result
