"""The loop's dry run (``bash run_loop.sh ... dry_run=true``, after its plan: ``python -m
online_rlhf.loop dry-run RUN_DIR``): a memory check of each model stage.

Each row of the stage table with a :class:`~online_rlhf.stage_table.DryRun` runs once with
``dry_run=true`` on its planned config (the stage's own ``dry_run``: its set-up and one step at the
largest shapes; ``online_rlhf.dry_run`` holds what those share). Its measurement is judged here
(:func:`verdict`) and printed as one table (:func:`report`), with the settings to lower for a stage
that does not fit: its config class's ``dry_run_advice``, with the keys named as the loop names them
(:func:`advice`).

Fit check (:func:`verdict`): ``over`` when the peak is above the limit or the stage ran out of
memory, ``tight`` when it is within ``MARGIN`` (10%) of the limit (allocator fragmentation, a
longer batch, another job on the machine can push it over), ``ok`` otherwise. A vLLM engine on a
GPU reserves ``gpu_memory_utilization`` of the device up front, so its peak is near the limit by
design: there only ``over`` counts.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from ..dry_run import dry_run_path
from ..jsonl import read_json, write_json
from ..paths import PROJECT_ROOT
from ..stage_table import STAGES
from ..stats import DryRunStats

MARGIN = 0.10  # a peak within this share of the limit is "tight"

# The stages the loop's dry run checks, in order: (iteration, stage), the table's rows with a dry run.
DRY_RUN_STAGES = tuple((s.dry_run.iteration, s.name) for s in STAGES.values() if s.dry_run is not None)


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
    """The settings to lower (or raise) when ``stage`` does not fit, most effective first: its config
    class's ``dry_run_advice`` (:meth:`online_rlhf.config.StageConfig.dry_run_advice`).

    Args:
        stage: a stage of the table with a dry run (``dpo``, ``grpo``, ``generate``, ``rewards``, ``sft``).
        settings: the stage's memory-relevant values (:attr:`DryRunStats.settings`).
        device: ``cpu`` or ``cuda``.
        prefix: how the keys are named; default: the stage's loop section (``dpo.``, ``generation.``, ...).
    Returns:
        one short line per setting, each naming the key with its current value.
    """
    row = STAGES[stage]
    return row.config.dry_run_advice(settings, device, (row.section + ".") if prefix is None else prefix)


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


def dry_run(run_dir: Path) -> int:
    """The loop's dry run (``bash run_loop.sh ... dry_run=true``, after the plan): run each stage of
    :data:`DRY_RUN_STAGES` that the plan holds (``dpo`` or ``grpo``, as ``algorithm`` says) once with
    ``dry_run=true`` (``loop exec RUN_DIR I STAGE dry_run=true``, the stage's own command; log
    ``iter_<i>/logs/<stage>.dry_run.log``), read what each measured
    (:class:`~online_rlhf.stats.DryRunStats`) and print the table and advice of :func:`report`; also
    written to ``<run>/dry_run.json``. Each row's :class:`~online_rlhf.stage_table.DryRun` says what
    differs per stage.

    Stages whose config loads no model (verifier/remote/judge rewards: the row's ``skip``) are
    skipped. When SFT is enabled, the later stages' policy (the SFT model) does not exist yet: their
    ``policy_keys`` are measured on the SFT base model (same architecture). Nothing is trained or
    marked done; stages' outputs are not written.

    Returns:
        the exit code: 0 when every measured stage fits, 1 when one would not (or its dry run failed).
    """
    rows: list[Row] = []
    sft_base = None
    for i, stage in DRY_RUN_STAGES:
        plan_path = run_dir / f"iter_{i}" / "plan.json"
        entries = read_json(plan_path) if plan_path.is_file() else {}
        if stage not in entries:
            continue
        e, spec = entries[stage], STAGES[stage].dry_run
        d = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
        if spec.base_model_key is not None:  # SFT: the later stages' policy is its output, not trained here
            sft_base = d.get(spec.base_model_key)
        why_not = spec.skip(d) if spec.skip is not None else None
        if why_not:  # e.g. rewards from a verifier
            rows.append(Row(stage, i, note=why_not))
            continue
        extra, note = ["dry_run=true"], ""
        if sft_base is not None and spec.policy_keys:  # the SFT model is not trained yet
            extra += [f"{k}={sft_base}" for k in spec.policy_keys if d.get(k)]
            note = "measured on the SFT base model"
        out = dry_run_path(e["outputs"][0])
        out.unlink(missing_ok=True)  # never report an earlier dry run's figures
        log = run_dir / f"iter_{i}" / "logs" / f"{stage}.dry_run.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[dry run] {stage} (iteration {i}) · log {log}", flush=True)
        with open(log, "w", encoding="utf-8") as f:
            rc = subprocess.run([sys.executable, "-m", "online_rlhf.loop", "exec", str(run_dir), str(i), stage, *extra],
                                stdout=f, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT).returncode
        result = DryRunStats.read(out) if out.is_file() else None
        if result is None:
            why = ("killed (exit %d; on CPU often the kernel's out-of-memory killer)" % rc if rc < 0 or rc in (137, 9)
                   else f"exit {rc}, no result written")
            errors = [ln[7:].strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()
                      if ln.startswith("error: ")]
            if errors:  # the stage's own one-line reason (e.g. a config it refused), not a memory verdict
                why += f": {errors[-1][:200]}"
            rows.append(Row(stage, i, note=why, log=str(log), failed=True))
        else:
            rows.append(Row(stage, i, result=result, note=note, log=str(log)))
    text, code = report(rows)
    print(text, flush=True)
    write_json(run_dir / "dry_run.json", [{"stage": r.stage, "iteration": r.iteration, "verdict": r.verdict,
                                           "note": r.note, "log": r.log,
                                           "result": r.result.model_dump(mode="json") if r.result else None}
                                          for r in rows])
    return code

