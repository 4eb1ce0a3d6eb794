"""What the stages' dry runs share (OAT's dry-run mode, per stage): does each stage fit in memory at
its maximum shapes?

A stage run with ``dry_run=true`` loads its models as usual, runs one step at the largest shapes
its config allows (dummy token ids; no input file is read for DPO, reward-model scoring and
generation), measures the peak memory and the seconds of that step, and writes only
:class:`~online_rlhf.stats.DryRunStats` to :func:`dry_run_path` (``<output>.dry_run.json``): no
checkpoint, no output file, no stats file, no ``.done`` marker. Each stage's dry run is the
``dry_run(cfg)`` of its own module (``online_rlhf.stages.run_dpo``, ``run_grpo``, ``run_sft``,
``generate``, ``launch``, ``get_rewards``): the stage's own set-up, then one step; the settings to
lower when it does not fit are its config class's ``dry_run_advice``. This module (importable
without torch or vLLM) holds what those dry runs share: the file rule, dummy token ids, and
:func:`finish` (the ranks' measurements combined, written and printed; the memory itself is
measured by ``online_rlhf.memory.PeakMemory``). The loop's dry run, which runs each of them and
judges the results, is ``online_rlhf.loop.memory_check``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .memory import PeakMemory
from .stats import DryRunStats

DRY_RUN_SUFFIX = ".dry_run.json"
GIB = float(1 << 30)


def dry_run_path(primary_output: str | os.PathLike) -> Path:
    """Where a stage's dry run writes its result: beside the stage's primary output, never inside it.

    ``runs/x/iter_1/model`` -> ``runs/x/iter_1/model.dry_run.json``;
    ``runs/x/iter_1/generated.jsonl`` -> ``runs/x/iter_1/generated.jsonl.dry_run.json``.

    Raises:
        ValueError: ``primary_output`` names no file or folder.
    """
    p = Path(primary_output)
    if not p.name or p.name in (".", ".."):
        raise ValueError(f"{str(primary_output)!r} names no file or folder.")
    return p.with_name(p.name + DRY_RUN_SUFFIX)


def dummy_ids(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` sequences of ``length`` random token ids, none of them a special token (a different
    sequence each, so vLLM's prefix cache cannot share their KV blocks)."""
    import random

    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def out_of_memory_errors() -> tuple[type, ...]:
    """The exception types a step that ran out of memory raises (``torch.OutOfMemoryError``, or
    ``RuntimeError`` on a torch without it), for a dry run's ``except``."""
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


def is_main_rank() -> bool:
    """True on global rank 0 (``RANK``, set by ``accelerate launch``; 0 without it)."""
    return int(os.environ.get("RANK", "0")) == 0


def finish(stage: str, mem: PeakMemory, output: str | os.PathLike, *, status: str, error: Optional[str],
           step_s: Optional[float], step: str, shapes: dict, settings: dict, t_start: float,
           preallocated: bool = False, gather: bool = True) -> Optional[DryRunStats]:
    """Combine the ranks' measurements, write the result beside ``output`` (rank 0) and print one line.

    With several processes every rank measures itself (``gather``: exchange them over
    torch.distributed); on CPU the ranks share the machine, so their peaks are summed; on GPUs
    each has its own device, so the largest is reported.

    Args:
        stage: the stage's name (``dpo``, ``grpo``, ``sft``, ``generate``, ``rewards``).
        mem: the block's measurement (bytes).  output: the stage's primary output (:func:`dry_run_path`).
        status: ``ok`` or ``out_of_memory`` (then ``error`` holds the message).
        step_s: seconds of the measured step, None when it did not run.
        step, shapes, settings: what one step is, in words; its sizes; the stage's memory-relevant
            values (its config class's ``dry_run_advice`` names them).
        t_start: ``time.perf_counter()`` at the stage's start.
        preallocated: the engine reserved its share of the device up front (vLLM on a GPU).
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
    if not is_main_rank():
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


def exit_if_out_of_memory(stage: str, status: str, error: Optional[str]) -> None:
    """After :func:`finish`: a step that ran out of memory ends the stage with one error line.

    Raises:
        SystemExit(1): ``status`` is not ``ok``.
    """
    if status != "ok":
        print(f"error: dry run {stage}: out of memory: {error}", file=sys.stderr)
        raise SystemExit(1)
