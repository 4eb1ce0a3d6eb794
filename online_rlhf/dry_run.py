"""Dry runs: does each stage fit in memory at its maximum shapes? (OAT's dry-run mode, per stage.)

A stage run with ``dry_run=true`` loads its models as usual, runs one step at the largest shapes
its config allows (dummy token ids; no input file is read for DPO, reward-model scoring and
generation), measures the peak memory and the seconds of that step, and writes only
:class:`~online_rlhf.stats.DryRunStats` to :func:`dry_run_path` (``<output>.dry_run.json``): no
checkpoint, no output file, no stats file, no ``.done`` marker. Each stage's dry run is the
``dry_run(cfg)`` of its own module (``online_rlhf.stages.run_dpo``, ``run_grpo``, ``run_sft``,
``generate``, ``launch``, ``get_rewards``): the stage's own set-up, then one step. This module
(importable without torch or vLLM) holds what they share: the file rule, dummy token ids,
:func:`finish` (the ranks' measurements combined, written and printed; the memory itself is
measured by ``online_rlhf.memory.PeakMemory``), and the fit check and the advice that
``python -m online_rlhf.loop dry-run RUN_DIR`` (what ``bash run_loop.sh ... dry_run=true`` runs
after its plan) prints.

Fit check (:func:`verdict`): ``over`` when the peak is above the limit or the stage ran out of
memory, ``tight`` when it is within ``MARGIN`` (10%) of the limit (allocator fragmentation, a
longer batch, another job on the machine can push it over), ``ok`` otherwise. A vLLM engine on a
GPU reserves ``gpu_memory_utilization`` of the device up front, so its peak is near the limit by
design: there only ``over`` counts.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .memory import PeakMemory
from .stage_table import STAGES
from .stats import DryRunStats

DRY_RUN_SUFFIX = ".dry_run.json"
MARGIN = 0.10  # a peak within this share of the limit is "tight"
GIB = float(1 << 30)

# The loop section each stage's keys live in (the advice names loop keys): the stage table's
# ``Stage.section`` (e.g. generate -> generation, rewards -> reward).
LOOP_SECTION = {name: s.section for name, s in STAGES.items() if s.section is not None}


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


def verdict(peak_gib: Optional[float], limit_gib: Optional[float], status: str = "ok",
            preallocated: bool = False, margin: float = MARGIN) -> str:
    """``over`` | ``tight`` | ``ok`` | ``unknown`` for a measured peak against a limit (both GiB).

    Args:
        peak_gib: the stage's peak memory; None when nothing was measured.
        limit_gib: the memory it may use; None when unknown.
        status: the dry run's status; ``out_of_memory`` is ``over`` whatever the figures.
        preallocated: the engine reserved its share up front (vLLM on a GPU): never ``tight``.
        margin: share of the limit below it that counts as ``tight``.
    """
    if status == "out_of_memory":
        return "over"
    if peak_gib is None or not limit_gib:
        return "unknown"
    if peak_gib > limit_gib:
        return "over"
    if peak_gib > (1.0 - margin) * limit_gib and not preallocated:
        return "tight"
    return "ok"


def advice(stage: str, settings: dict, device: str, prefix: Optional[str] = None) -> list[str]:
    """The settings to lower (or raise) when ``stage`` does not fit, most effective first.

    Args:
        stage: ``dpo`` | ``grpo`` | ``generate`` | ``rewards`` | ``sft``.
        settings: the stage's memory-relevant values (:attr:`DryRunStats.settings`).
        device: ``cpu`` or ``cuda``.
        prefix: how the keys are named; default: the loop's section (``dpo.``, ``generation.``, ...).
    Returns:
        one short line per setting, each naming the key with its current value.
    """
    p = (LOOP_SECTION[stage] + ".") if prefix is None else prefix
    s = settings

    def v(key: str) -> str:
        return f"{p}{key} (now {s.get(key)})"

    if stage == "dpo":
        out = [f"{v('training.per_device_train_batch_size')}: the pairs on a device per forward pass; raise "
               f"{p}training.gradient_accumulation_steps (now {s.get('training.gradient_accumulation_steps')}) to keep "
               f"{p}train_batch_size (now {s.get('train_batch_size')}), or lower {p}train_batch_size",
               f"{v('training.max_length')}: tokens of prompt + response"]
        if not s.get("training.gradient_checkpointing"):
            out.append(_checkpointing_advice(f"{p}training.gradient_checkpointing"))
        if not s.get("lora"):
            out.append(f"{p}lora: train LoRA adapters instead of every weight (no full-size optimizer state)")
        out += _zero3_advice(s, device)
        return out
    if stage == "grpo":
        out = [f"{v('per_device_train_batch_size')}: the completions on a device per forward pass; raise "
               f"{p}gradient_accumulation_steps (now {s.get('gradient_accumulation_steps')}) to keep the optimizer step",
               f"{v('max_length')}: tokens of prompt + completion (the completion is generation.max_tokens)"]
        if not s.get("gradient_checkpointing"):
            out.append(_checkpointing_advice(f"{p}gradient_checkpointing"))
        if s.get("beta"):
            out.append(f"{v('beta')}: 0 drops the KL term, and the reference model with it")
        out += _zero3_advice(s, device)
        return out
    if stage == "generate":
        out = [f"{v('max_model_len')}: the longest prompt + response the engine must hold",
               f"{v('k')}: samples per prompt, each with its own KV cache"]
        if device == "cuda":
            out.append(f"{v('gpu_memory_utilization')}: vLLM's share of the GPU (lower it when another process shares "
                       "the device; raise it when the engine cannot fit its KV cache)")
        else:
            out.append(f"{v('kv_cache_gb')}: the KV cache vLLM reserves on CPU")
        out.append(f"{v('max_tokens')}: new tokens per response")
        return out
    if stage == "rewards":
        return [f"{v('batch_size')}: inputs per forward pass", f"{v('max_length')}: tokens per input"]
    if stage == "sft":
        out = [f"{v('micro_batch_size')}: rows per forward pass (raise {p}gradient_accumulation_steps, now "
               f"{s.get('gradient_accumulation_steps')}, to keep the batch)",
               f"{v('sequence_len')}: tokens per row"]
        if not s.get("gradient_checkpointing"):
            out.append(_checkpointing_advice(f"{p}gradient_checkpointing"))
        return out
    raise ValueError(f"no advice for stage {stage!r}")


def _checkpointing_advice(key: str) -> str:
    """The advice line for a stage whose gradient checkpointing is off (``key``: its full name)."""
    return f"{key}=true: recompute activations in the backward pass"


def _zero3_advice(settings: dict, device: str) -> list[str]:
    """ZeRO-3 for a training stage on GPUs that does not use it yet; nothing on CPU."""
    if device != "cuda" or settings.get("launch_profile") == "zero3":
        return []
    return [f"launch_profile=zero3 (now {settings.get('launch_profile')}): shard weights, gradients and optimizer "
            "state over the GPUs"]


@dataclass
class Row:
    """One stage of the loop's dry run, as the table shows it.

    Attributes:
        stage: the stage's name; iteration: its iteration (0: SFT).
        result: what the stage's dry run wrote (None when it wrote nothing).
        note: why there is no result (skipped, failed with exit code ...), or a remark.
        log: the stage's dry-run log.
    """

    stage: str
    iteration: int
    result: Optional[DryRunStats] = None
    note: str = ""
    log: Optional[str] = None
    failed: bool = False

    @property
    def verdict(self) -> str:
        if self.failed:
            return "failed"
        if self.result is None:
            return "skipped"
        r = self.result
        return verdict(r.peak_memory_gib, r.memory_limit_gib, r.status, r.preallocated)


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(rows: list[Row]) -> tuple[str, int]:
    """The loop's dry-run table and advice, and its exit code.

    Returns:
        ``(text, exit code)``: 0 when every measured stage fits (``ok`` or ``tight``), 1 when one is
        ``over`` or its dry run failed (e.g. killed by the kernel's out-of-memory killer).
    """
    head = ("stage", "device", "peak GiB", "limit GiB", "use", "s/step", "verdict", "step")
    table = [head]
    for row in rows:
        r = row.result
        if r is None:
            table.append((row.stage, "-", "-", "-", "-", "-", row.verdict, row.note))
            continue
        use = (f"{100 * r.peak_memory_gib / r.memory_limit_gib:.0f}%"
               if r.peak_memory_gib is not None and r.memory_limit_gib else "-")
        table.append((row.stage, r.device, _g(r.peak_memory_gib), _g(r.memory_limit_gib), use,
                      _g(r.seconds_per_step), row.verdict, r.step + (f"; {row.note}" if row.note else "")))
    widths = [max(len(str(t[c])) for t in table) for c in range(len(head) - 1)]
    lines = ["  ".join(str(t[c]).ljust(widths[c]) for c in range(len(head) - 1)) + "  " + str(t[-1]) for t in table]
    bad = False
    for row in rows:
        r = row.result
        if row.verdict == "failed":
            bad = True
            lines.append(f"FAILED: {row.stage}: {row.note}. Log: {row.log}")
        if r is None or row.verdict not in ("over", "tight"):
            continue
        bad = bad or row.verdict == "over"
        what = ("ran out of memory" if r.status == "out_of_memory" else
                f"peak {r.peak_memory_gib:.2f} GiB of {r.memory_limit_gib:.2f} GiB")
        lines.append(f"{'DOES NOT FIT' if row.verdict == 'over' else 'TIGHT (within 10%)'}: {row.stage} {what} "
                     f"({r.memory_measure}). Lower one of:")
        lines += [f"  - {a}" for a in advice(row.stage, r.settings, r.device)]
    lines.append("dry run: nothing trained, no checkpoint written, no stage marked done. "
                 + ("Some stage would not fit (see above)." if bad else "Every measured stage fits."))
    return "\n".join(lines), int(bad)


# ------------------------------------------------------------------ what the stages' dry runs share

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
            values (:func:`advice` names them).
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
