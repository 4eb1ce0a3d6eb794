"""What the machine can do: the compute dtype and the thread count every model-running stage uses.

Why this exists: on a CPU without native bfloat16 (AVX2 only: no AVX512-BF16, no AMX) torch's
bf16 matmul is emulated and about two orders of magnitude slower than fp32, while on a CPU
with AVX512-BF16 or AMX, and on GPUs, bf16 is the fast choice. A stage whose dtype is ``auto``
therefore asks :func:`compute_dtype`; an explicit dtype always wins (a bf16 request on a CPU
without native bf16 gets a one-line warning).

Threads: a stage uses every core it may run on (``os.sched_getaffinity``) that no other job is
keeping busy when it starts, split between its processes (:func:`stage_threads`);
``OMP_NUM_THREADS`` set by the user wins. OpenMP spin-waiting is shortened
(:data:`THREAD_ENV_DEFAULTS`) so that a job arriving later slows a stage down instead of stalling it.

Importable without torch (it is imported lazily), so configs can use it dry.
"""

from __future__ import annotations

import os
import sys
import time
from functools import lru_cache
from typing import Optional

DTYPES = ("float32", "bfloat16", "float16")
# Measured on an AVX2-only AMD EPYC: one-thread 1024x1024 matmul, fp32 vs bf16 (bench/bench_matmul.py).
_SLOW_BF16_NOTE = "about 100x slower than float32 in matrix products on such a CPU"
_warned: set[str] = set()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``"unknown"`` where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_capability() -> str:
    """torch's CPU kernel level: ``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``... (``"unknown"`` without torch)."""
    try:
        import torch
    except ImportError:
        return "unknown"
    return str(torch.backends.cpu.get_cpu_capability())


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bfloat16 in hardware: AVX512-BF16 or AMX tiles (torch's own checks).

    ``ONLINE_RLHF_CPU_BF16=0|1`` overrides the detection (e.g. to reproduce another machine's choice).
    """
    forced = os.environ.get("ONLINE_RLHF_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _cuda_bf16() -> bool:
    import torch

    return bool(torch.cuda.is_bf16_supported())


def compute_dtype(device_type: str, requested: str = "auto") -> str:
    """The dtype a model runs in on ``device_type`` (``"cuda"`` or ``"cpu"``).

    ``auto``:
      - GPU: ``bfloat16`` where the GPU supports it (Ampere and newer), else ``float16``;
      - CPU: ``bfloat16`` only with native bf16 (:func:`cpu_has_native_bf16`), else ``float32``.
    An explicit ``float32``/``bfloat16``/``float16`` is returned as is; ``bfloat16`` on a CPU
    without native bf16 prints a one-line warning to stderr (once per process).

    Returns:
        one of ``"float32"``, ``"bfloat16"``, ``"float16"``.
    Raises:
        ValueError: ``requested`` is not ``auto`` or one of those names.
    """
    if requested not in ("auto",) + DTYPES:
        raise ValueError(f"dtype={requested!r}: use auto, float32, bfloat16 or float16")
    on_gpu = device_type == "cuda"
    if requested == "auto":
        if on_gpu:
            return "bfloat16" if _cuda_bf16() else "float16"
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    if requested == "bfloat16" and not on_gpu and not cpu_has_native_bf16():
        warn_once("bf16-cpu", f"warning: dtype=bfloat16 on a CPU without native bf16 ({cpu_model()}, "
                              f"{cpu_capability()}): {_SLOW_BF16_NOTE}. Use dtype=auto or float32.")
    return requested


def slow_dtype_warning(info: dict) -> Optional[str]:
    """The warning a stage adds to its stats when :func:`describe`'s ``info`` shows bf16 on a CPU
    without native bf16 (else None)."""
    if info.get("device") == "cpu" and str(info.get("dtype", "")).startswith("bfloat16") and not info.get("cpu_native_bf16"):
        return (f"dtype=bfloat16 on a CPU without native bf16 ({info.get('cpu_model')}, {info.get('cpu_capability')}): "
                f"{_SLOW_BF16_NOTE}; dtype=auto picks float32 here")
    return None


def warn_once(key: str, message: str) -> None:
    """Print ``message`` to stderr the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        print(message, file=sys.stderr, flush=True)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# libgomp (torch's OpenMP on Linux) spins 300k iterations at every barrier before sleeping. When
# another job takes one of the cores, a spinning thread waits for its descheduled partner at every
# small op: 2-thread vLLM decoding fell from 112 to 44 tok/s with one core busy (1 thread: 78).
# 10k spins kept the idle speed (117 tok/s) and lost less under load (53); see docs/performance.md.
THREAD_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}


def setdefault_thread_env(env: Optional[dict] = None) -> None:
    """Put :data:`THREAD_ENV_DEFAULTS` into ``env`` (default ``os.environ``) unless set; must run
    before torch is imported (libgomp reads it when it loads)."""
    env = os.environ if env is None else env
    for k, v in THREAD_ENV_DEFAULTS.items():
        env.setdefault(k, v)


def _cpu_times(cpus: set[int]) -> tuple[float, float]:
    """(idle, total) jiffies summed over ``cpus`` from ``/proc/stat``."""
    idle = total = 0.0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                nums = [float(v) for v in vals[:8]]
                idle += nums[3] + nums[4]  # idle + iowait
                total += sum(nums)
    return idle, total


def idle_cores(sample_s: float = 0.3) -> float:
    """How many of the usable cores were idle over the last ``sample_s`` seconds (0..usable_cores);
    ``usable_cores()`` where ``/proc/stat`` cannot be read."""
    try:
        cpus = os.sched_getaffinity(0)
        i0, t0 = _cpu_times(cpus)
        time.sleep(sample_s)
        i1, t1 = _cpu_times(cpus)
    except (OSError, AttributeError, ValueError):
        return float(usable_cores())
    if t1 <= t0:
        return float(usable_cores())
    return len(cpus) * (i1 - i0) / (t1 - t0)


def fixed_cores(env: Optional[dict] = None) -> Optional[int]:
    """``ONLINE_RLHF_CORES`` from ``env`` (default ``os.environ``) as a core count, at most
    :func:`usable_cores` (a larger value is lowered with a one-line warning); None when unset or empty.

    Raises:
        ValueError: set to something other than a whole number >= 1 (the message names the
            variable, the value and the fix).
    """
    env = os.environ if env is None else env
    raw = env.get("ONLINE_RLHF_CORES", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"ONLINE_RLHF_CORES={raw!r}: give a whole number of cores >= 1 (this process may use "
                         f"{usable_cores()}), or unset it to take the cores that are free when each stage starts.")
    n, usable = int(raw), usable_cores()
    if n > usable:
        warn_once("cores-cap", f"warning: ONLINE_RLHF_CORES={n}, but this process may use {usable} cores; using {usable}.")
    return min(n, usable)


def stage_threads(num_processes: int = 1, env: Optional[dict] = None, free_cores: Optional[float] = None) -> int:
    """Threads per process for a stage with ``num_processes`` processes.

    ``OMP_NUM_THREADS`` in ``env`` (default ``os.environ``) wins. Otherwise the cores that are free
    now (usable cores minus those other jobs keep busy, :func:`idle_cores`, rounded) are split
    evenly between the processes, at least 1 thread each: OpenMP threads that share a core with
    another job wait for each other at every barrier, and one thread per free core measured faster
    than one per core. ``ONLINE_RLHF_CORES=N`` fixes the cores at N (at most the usable ones)
    instead of measuring: the thread counts, and so vLLM's samples for a seed, then do not depend
    on what else ran when a stage started.
    """
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    fixed = fixed_cores(env)
    if fixed is not None:
        free = float(fixed)
    else:
        free = idle_cores() if free_cores is None else free_cores
    cores = min(usable_cores(), max(1, int(free + 0.5)))
    return max(1, cores // max(1, num_processes))


def processes_here(num_processes: int, env: Optional[dict] = None) -> int:
    """Processes of a distributed stage that share this machine: ``LOCAL_WORLD_SIZE`` (set by
    ``accelerate launch`` / torchrun; the world size divided by the machines) when set, else
    ``num_processes``. Threads are split between these, not between every machine's ranks."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    return int(local) if local.isdigit() and int(local) > 0 else num_processes


def launch_world_size() -> int:
    """The processes ``accelerate launch`` started over all machines (``WORLD_SIZE``; 1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_process_count(planned: Optional[int], where: str) -> None:
    """Refuse a stage started with another process count than its config was planned for (the
    count changes how a batch is split and summed, so a rerun must train the same numbers).

    Args:
        planned: the config's ``num_processes`` (None: any count).
        where: the stage, for the message.
    Raises:
        ConfigError: ``WORLD_SIZE`` (:func:`launch_world_size`) differs from ``planned``.
    """
    actual = launch_world_size()
    if planned is not None and planned != actual:
        from .config import ConfigError

        how = (f"accelerate launch --num_processes {planned} ..." if planned > 1 else "one process (plain python)")
        raise ConfigError(f"{where}: the config says num_processes={planned}, but this run has {actual} process(es). "
                          f"Start it with {how} (the command on top of the loop's stage YAML), or set "
                          f"num_processes={actual} (or null) to train with this count.")


def describe(device_type: str, dtype: str, threads: Optional[int] = None, processes: int = 1) -> dict:
    """What a stage records in its stats (and benchmarks print): device, dtype, threads (per
    process), processes, CPU model and capability, and whether bf16 is native there."""
    if threads is None:
        try:
            import torch

            threads = torch.get_num_threads()
        except ImportError:
            threads = None
    return {"device": device_type, "dtype": dtype, "threads": threads, "processes": processes, "cpu_model": cpu_model(),
            "cpu_capability": cpu_capability(), "cpu_native_bf16": cpu_has_native_bf16()}


def describe_line(info: dict) -> str:
    """One line for logs and benchmark output, e.g. ``cpu float32 2 threads (AMD EPYC, AVX2, no native bf16)``."""
    bf16 = "native bf16" if info.get("cpu_native_bf16") else "no native bf16"
    procs = f"{info['processes']} processes x " if info.get("processes", 1) > 1 else ""
    return (f"{info['device']} {info['dtype']} {procs}{info.get('threads')} threads "
            f"({info.get('cpu_model')}, {info.get('cpu_capability')}, {bf16})")
