"""Peak memory of a block of work and the memory it may use, for the stages' dry runs.

- CPU: the peak resident set of this process (``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's
  high-water mark since the process started, imports included) and, with ``children=True``, the
  peak of the summed RSS of this process and every descendant, sampled every 0.1 s (an engine in a
  child process; shared pages count once per process, so it can overstate). The limit is
  ``MemAvailable`` of ``/proc/meminfo`` (or the cgroup's headroom, when lower) at the start, plus
  what this process already held then.
- CUDA, this process's tensors (DPO, SFT, reward model): ``torch.cuda.max_memory_allocated`` of
  the current device, reset at the start; the limit is the device's total memory.
- CUDA, another process's tensors (a vLLM engine core): the device's used memory, all processes,
  sampled every 0.1 s through NVML (``pynvml``, shipped with CUDA vLLM) or
  ``torch.cuda.mem_get_info``; the limit is the device's total memory.

All figures are bytes here; :class:`online_rlhf.stats.DryRunStats` holds GiB.
"""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path
from typing import Optional


def self_peak_rss() -> int:
    """Peak resident set of this process since it started, in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def self_rss() -> int:
    """Resident set of this process now, in bytes (``VmRSS``; 0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cpu_available() -> Optional[int]:
    """Bytes a new allocation can still get: ``MemAvailable`` from ``/proc/meminfo``, lowered to the
    cgroup's headroom (v2 ``memory.max - memory.current``, v1 ``limit_in_bytes - usage_in_bytes``)
    when this process runs under a lower limit. None where neither is readable."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is not None and usage is not None and limit < (1 << 60):
            headroom = max(0, limit - usage)
            avail = headroom if avail is None else min(avail, headroom)
            break
    return avail


def _tree_rss(proc) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except Exception:  # psutil.NoSuchProcess / AccessDenied: a child that just ended
            pass
    return total


def _nvml_used():
    """``(function returning the used bytes, total bytes)`` of the first visible GPU (all processes),
    or None without NVML. Creates no CUDA context (a vLLM engine started later may then fork)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if visible.startswith("GPU-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        return (lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
                int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))
    except Exception:
        return None


class PeakMemory:
    """Measure the peak memory of a ``with`` block (see the module docstring for what is measured).

    Args:
        device: ``cpu`` or ``cuda``.
        children: CPU: also sample the summed RSS of this process's descendants.
        device_wide: CUDA: sample the device's used memory (all processes) instead of this
            process's ``max_memory_allocated`` (an engine in another process).
        interval_s: sampling period of the background thread.

    After the block: :attr:`peak` and :attr:`limit` (bytes; limit None where unknown),
    :attr:`start_rss` (CPU: this process's RSS at the start) and :attr:`measure` (in words).
    """

    def __init__(self, device: str, children: bool = False, device_wide: bool = False, interval_s: float = 0.1):
        self.device, self.children, self.device_wide, self.interval_s = device, children, device_wide, interval_s
        self.peak = 0
        self.limit: Optional[int] = None
        self.start_rss = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sample = None
        if device == "cuda":
            self.measure = ("device memory used by all processes (NVML), peak" if device_wide
                            else "torch.cuda.max_memory_allocated")
        else:
            self.measure = "peak RSS" + (" of the process and its children" if children else " of the process")

    def __enter__(self) -> "PeakMemory":
        if self.device == "cuda":
            nvml = _nvml_used() if self.device_wide else None
            if nvml is not None:
                self._sample, self.limit = nvml
            else:
                import torch

                if self.device_wide:
                    self.measure = "device memory used by all processes (torch.cuda.mem_get_info), peak"
                    self._sample = lambda: (lambda f, t: t - f)(*torch.cuda.mem_get_info())
                else:
                    torch.cuda.reset_peak_memory_stats()
                self.limit = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        else:
            self.start_rss = self_rss()
            avail = cpu_available()
            self.limit = None if avail is None else avail + self.start_rss
            if self.children:
                import psutil

                me = psutil.Process()
                self._sample = lambda: _tree_rss(me)
        if self._sample is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sampled = max(self._sampled, int(self._sample()))
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._run_once()
        if self.device == "cuda":
            if self.device_wide:
                self.peak = self._sampled
            else:
                import torch

                self.peak = int(torch.cuda.max_memory_allocated())
        else:
            self.peak = max(self_peak_rss(), self._sampled)

    def _run_once(self) -> None:
        try:
            self._sampled = max(self._sampled, int(self._sample()))
        except Exception:
            pass
