"""Co-decoding: which generation configs may share one vLLM engine start.

The held-out answers (``eval_generate``), the KL samples (``kl_generate``) and IFEval's answers
(``ifeval_generate``) of an iteration decode with the same policy one after another. Started
separately, each pays a process start, imports and an engine start (~40 s on a 2-core CPU, 15-20 s
on a faster one). ``generation/launch.py --config A.yaml --config B.yaml ...`` decodes them in one
start: each shard's engine serves every config in turn, and each config keeps its own output,
stats, shard files and resume (``online_rlhf.stages.launch``, ``online_rlhf.stages.generate``).

Two configs can share an engine when every key that configures the engine (not a request) is equal:
everything but :data:`REQUEST_KEYS`. Their seeds may differ: with the engine inside the shard process
(one CPU shard, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the shard restores, before each config, the
random state a fresh engine with that config's seed starts from (``vllm``'s ``set_random_seed``, as
its worker does after warm-up) and empties the prefix cache, so each output is what a separate
launch decodes. Where the engine runs in processes of its own (GPUs, W > 1 CPU shards,
``VLLM_ENABLE_V1_MULTIPROCESSING`` set to something else) the seed cannot be restored, so only
greedy configs (``temperature: 0``, where the seed does not matter) join another's engine; a
sampled one runs with its own engine start. Several machines never co-decode (each machine's
launcher would have to agree on the list). :func:`refusal` says why a config cannot join.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

# GenerateConfig keys that describe requests or where they are written, not the engine: they may
# differ between configs that share an engine. Every other key (model, dtype, max_model_len,
# shards, tensor parallel, enforce_eager, memory, machines, dry_run...) must be equal, so a key added
# to GenerateConfig later counts as an engine key until it is listed here.
REQUEST_KEYS = frozenset({"prompts", "prompt_split", "prompt_field", "limit", "output", "shards_dir", "k",
                          "temperature", "top_p", "max_tokens", "seed", "save_token_ids", "merge_wait_s"})


def engine_in_process(num_shards: int, tensor_parallel_size: int, gpus: Sequence[str],
                      env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the launcher's shards run vLLM's engine inside the shard process, where the shard can
    restore the engine's random state (``online_rlhf.stages.launch.shard_envs``): one CPU shard
    without ``VLLM_CPU_OMP_THREADS_BIND`` or ``VLLM_ENABLE_V1_MULTIPROCESSING`` of yours, or
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` of yours with one device per shard."""
    env = os.environ if env is None else env
    given = env.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if given is not None:
        return given == "0" and tensor_parallel_size == 1
    return not gpus and num_shards == 1 and not env.get("VLLM_CPU_OMP_THREADS_BIND")


def engine_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The engine keys (all but :data:`REQUEST_KEYS`) whose values differ between two resolved
    generation configs, as ``"key: A vs B"``; empty when they can share an engine."""
    keys = sorted((set(a) | set(b)) - REQUEST_KEYS)
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def refusal(first: Mapping[str, Any], other: Mapping[str, Any], in_process: bool) -> Optional[str]:
    """Why the generation config ``other`` cannot decode in the engine started for ``first``
    (one line), or None when it can.

    Args:
        first, other: resolved ``GenerateConfig`` values (mappings).
        in_process: whether the engine runs inside the shard process (:func:`engine_in_process`).
    """
    if first.get("dry_run") or other.get("dry_run"):
        return "a dry run measures one config alone"
    if int(first.get("num_machines") or 1) > 1 or int(other.get("num_machines") or 1) > 1:
        return "it runs over several machines, whose launchers would each have to co-decode the same configs"
    diff = engine_differences(first, other)
    if diff:
        return "its engine settings differ (" + "; ".join(diff) + ")"
    if float(other.get("temperature", 1.0)) > 0 and not in_process:
        return ("it samples (temperature > 0) and the engine runs in processes of its own here (GPUs, several "
                "shards, or VLLM_ENABLE_V1_MULTIPROCESSING set): its seed could not be restored")
    return None


def restore_seed(seed: int) -> None:
    """Put the random state where vLLM's worker leaves it for an engine of ``seed`` once warmed up
    (``vllm.utils.torch_utils.set_random_seed``: ``random``, ``numpy``, ``torch`` and the device's
    generators). Only meaningful with the engine in this process."""
    try:
        from vllm.utils.torch_utils import set_random_seed
    except ImportError:  # another vLLM layout: the same three generators
        import random

        import numpy as np
        import torch

        def set_random_seed(s: int) -> None:
            random.seed(s)
            np.random.seed(s)
            torch.manual_seed(s)
    set_random_seed(seed)
