"""The generation stage's vLLM engine: the dtype it runs in, its start (:func:`build_engine`), the
engine the co-decoded configs of one shard process share (:class:`SharedEngine`), one decode of
``k`` samples per prompt (:func:`run_engine`), and how a shard process ends once an engine ran in it
(:func:`exit_without_teardown`). ``online_rlhf.stages.generate`` (the stage) calls these; vLLM is
imported only when an engine starts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from online_rlhf.dry_run import out_of_memory_errors
from online_rlhf.hardware import compute_dtype
from online_rlhf.stage_configs import GenerateConfig

# Whether build_engine started an engine inside this process (exit_without_teardown reads it), and
# the seconds the imports of vLLM took since reset_import_seconds (the stage's phase_s: engine_import).
_IN_PROCESS_ENGINE_STARTED = False
_ENGINE_IMPORT_S = [0.0]


def reset_import_seconds() -> None:
    """Start counting the seconds vLLM's imports take anew (before a config decodes)."""
    _ENGINE_IMPORT_S[0] = 0.0


def import_seconds() -> float:
    """Seconds :func:`build_engine` and :func:`run_engine` spent importing vLLM since
    :func:`reset_import_seconds`."""
    return _ENGINE_IMPORT_S[0]


def engine_dtype(cfg: GenerateConfig) -> tuple[str, str]:
    """``(device type, dtype)`` the engine runs in: ``cfg.dtype``, or for ``auto`` the hardware's
    choice (:func:`online_rlhf.hardware.compute_dtype`). vLLM's own ``auto`` would take the
    checkpoint's dtype and, for a float32 checkpoint on CPU, downcast it to bf16, which is
    emulated and very slow on CPUs without native bf16."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, compute_dtype(device, cfg.dtype)


def build_engine(cfg: GenerateConfig, model_path: str, seed: int):
    """Start vLLM for the policy in :func:`engine_dtype`. On CPU the KV cache is ``kv_cache_gb``
    GiB (an explicit ``VLLM_CPU_KVCACHE_SPACE``, in whole GiB, wins); without an explicit size
    vLLM-CPU would reserve ``gpu_memory_utilization`` of the machine's RAM. The seconds the import of
    ``vllm.LLM`` took are kept for the stats' ``phase_s`` (``engine_import``)."""
    t0 = time.perf_counter()
    from vllm import LLM

    _ENGINE_IMPORT_S[0] += time.perf_counter() - t0

    global _IN_PROCESS_ENGINE_STARTED
    _IN_PROCESS_ENGINE_STARTED = _IN_PROCESS_ENGINE_STARTED or engine_in_this_process(cfg)
    device, dtype = engine_dtype(cfg)
    kwargs: dict[str, Any] = {}
    if device == "cpu":
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return LLM(model=model_path, tokenizer=model_path, seed=seed, dtype=dtype,
               max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
               tensor_parallel_size=cfg.tensor_parallel_size, **lora_engine_args(cfg.adapter), **kwargs)


def lora_engine_args(adapter: str | None) -> dict[str, Any]:
    """vLLM's engine arguments for the LoRA adapter folder ``adapter``: LoRA on (``enable_lora``), one
    adapter at a time, ``max_lora_rank`` the smallest vLLM allows that holds the adapter's rank; ``{}``
    without one. On CPU vLLM then runs its LoRA kernels (``PunicaWrapperCPU``) and leaves its CPU
    compile mode off."""
    if not adapter:
        return {}
    from online_rlhf.adapters import adapter_rank, vllm_max_lora_rank

    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_max_lora_rank(adapter_rank(adapter))}


def lora_request(adapter: str | None) -> Any:
    """The ``vllm.lora.request.LoRARequest`` every request decodes with for the adapter folder
    ``adapter`` (by absolute path), or None without an adapter."""
    if not adapter:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest("policy", 1, str(Path(adapter).resolve()))


class SharedEngine:
    """One vLLM engine for the several configs one shard process decodes (co-decoding,
    ``online_rlhf.co_decode``): started by the first config that has a prompt to decode, reused by
    the others (their engine settings are equal; :func:`online_rlhf.stages.generate.main_many` checks).

    Attributes:
        llm: the engine, None until started.
        owner: the output of the config that started it.
        decoded: how many configs have decoded on it so far.
        process_counted: whether a config's stats already hold the process start-up phase.
    """

    def __init__(self) -> None:
        self.llm: Any = None
        self.owner: str | None = None
        self.decoded = 0
        self.process_counted = False

    def get(self, cfg: GenerateConfig, model_path: str, seed: int) -> Any:
        """The engine, started now (:func:`build_engine`, seed ``seed``) when it is not yet; before a
        second or later config decodes on it, its prefix cache is emptied, so that the config's
        prompts are computed as on a fresh engine."""
        if self.llm is None:
            self.llm, self.owner = build_engine(cfg, model_path, seed), cfg.output
        elif self.decoded:
            self.llm.reset_prefix_cache()
        return self.llm


def engine_in_this_process(cfg: GenerateConfig) -> bool:
    """Whether vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one device),
    so that its random state can be set here before a decode."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and cfg.tensor_parallel_size == 1


def run_engine(cfg: GenerateConfig, model_path: str, prompt_ids: list[list[int]], stop_ids: list[int],
               seed: int, engine: SharedEngine | None = None) -> tuple[list[Any], float, float]:
    """Start vLLM (or take ``engine``'s, co-decoding) and sample ``cfg.k`` responses for each
    token-id prompt (vLLM's progress bar shows prompts done and output tokens/s). With the engine in
    this process (:func:`engine_in_this_process`) the random state is set to what a fresh engine of
    ``seed`` starts from (``online_rlhf.co_decode.restore_seed``) right before decoding, so that a
    config decodes the same on a shared engine as on its own.

    Returns:
        ``(outputs, startup_s, generation_s)``: one vLLM ``RequestOutput`` per prompt, in order;
        engine start-up (importing vLLM included; 0.0 on an engine another config started) and
        generation wall seconds.
    """
    t0 = time.perf_counter()
    from vllm import SamplingParams

    from online_rlhf.co_decode import restore_seed

    _ENGINE_IMPORT_S[0] += time.perf_counter() - t0
    params = SamplingParams(n=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p,
                            max_tokens=cfg.max_tokens, stop_token_ids=stop_ids)
    shared = engine is not None and engine.llm is not None
    llm = build_engine(cfg, model_path, seed) if engine is None else engine.get(cfg, model_path, seed)
    startup_s = 0.0 if shared else time.perf_counter() - t0
    if engine_in_this_process(cfg):
        restore_seed(seed)
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=True,
                           lora_request=lora_request(cfg.adapter))
    generation_s = time.perf_counter() - t0
    if engine is not None:
        engine.decoded += 1
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    return outputs, startup_s, generation_s


def engine_out_of_memory(e: BaseException) -> bool:
    """Whether an error of the engine's start or generation says it lacked memory (vLLM wraps a CUDA
    out-of-memory error, or a KV cache too small for ``max_model_len``, in its own errors)."""
    text = str(e).lower()
    return isinstance(e, out_of_memory_errors()) or ("memory" in text and ("cache" in text or "out of" in text))


def exit_without_teardown() -> None:
    """After a shard process has written everything (outputs, stats, locks released): when an
    engine ran inside this process (:func:`engine_in_this_process`, so no engine process is left to
    stop), end with ``os._exit(0)``. The interpreter's own exit would free the engine's model and KV
    cache object by object, 4.3 s against 0.4 s for a 2 GiB cache on an AVX2 EPYC (2026-12-03);
    nothing of the stage is left to write by then. Otherwise (no engine, or vLLM's engine process)
    it returns and the process exits as usual."""
    if not _IN_PROCESS_ENGINE_STARTED:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
