"""``loop plan``: the run directory's files, written only once the whole plan has passed.

:func:`plan` writes ``<run>/config.yaml`` (the resolved loop config), and per iteration the stage
YAMLs (with their provenance comments), ``plan.json`` and the train prompts; :func:`fresh_refusal`
says whether ``run_loop.sh --fresh`` may empty a folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ..jsonl import atomic_open, json_text
from ..loop_config import SECTION_CLASSES, LoopConfig, iteration_config
from ..stage_launch import launch_command, stage_machines
from ..stage_table import STAGES, Stage, prompt_source, starting_policy
from .provenance import Layers, stage_header, value_origins
from .resolve import (check_ifeval_fields, check_ifeval_prompts, check_prompt_files,
                      check_verifier_fields, drawn_argument_warnings, held_out_rows,
                      other_algorithm_warnings, overlap_warnings, prompt_key, resolve, stage_dict)


# First line of <run>/config.yaml; run_loop.sh --fresh only clears a folder whose config.yaml has it.
RUN_CONFIG_HEADER = "# online_rlhf run config, resolved from"


def plan(config_path: str | None, overrides: list[str], write: bool = True, shell_out=None,
         warn: bool | None = None) -> Path:
    """Resolve the config, write the run dir's config.yaml, stage configs, plan.json and prompt
    slices; print shell assignments (RUN_DIR, ITERATIONS, ...) for run_loop.sh to ``eval``, to
    ``shell_out`` (default: stdout).

    Every file's content is built and every input (prompt sets, models, verifier fields) checked
    first; the files are written only once the whole plan has passed (:class:`_PlanFiles`), so a
    plan refused on the way (e.g. a missing ``train_prompts`` file, at the top level or in
    ``per_iteration``) leaves an existing run directory as it was, and creates nothing.

    ``write=False`` runs every check and writes nothing (``loop plan-check``:
    ``run_loop.sh --fresh`` runs it before it empties the old run, so a plan that would be refused
    leaves the old run in place). ``warn`` (default: ``write``) prints the plan's warnings to stderr.

    Raises:
        ConfigError, DataError, FileNotFoundError: as :func:`resolve` and the prompt loaders; nothing
            has been written then.
    """
    cfg = resolve(config_path, overrides)
    check_prompt_files(cfg)  # every missing prompt file at once
    check_ifeval_prompts(cfg)
    n_ifeval = check_ifeval_fields(cfg)
    run_dir = Path(cfg.output_root) / cfg.run_name
    run_dir = run_dir.resolve()
    train_sets: dict[str, list[dict]] = {}  # prompt source -> rows (a source may change per iteration)
    warnings: list[str] = []
    eval_src, eval_rows = held_out_rows(cfg, run_dir)
    eval_ids = {prompt_key(r) for r in eval_rows}
    if cfg.eval_limit and len(eval_rows) < cfg.eval_limit:
        warnings.append(f"eval_limit={cfg.eval_limit}, but eval_prompts {eval_src} has {len(eval_rows)} prompts: the "
                        f"held-out set is those {len(eval_rows)} (set eval_limit to at most {len(eval_rows)}, or give a "
                        "larger eval_prompts file).")
    if n_ifeval is not None and cfg.ifeval.limit and n_ifeval < cfg.ifeval.limit:
        warnings.append(f"ifeval.limit={cfg.ifeval.limit}, but ifeval.prompts has {n_ifeval} prompts: IFEval scores "
                        f"those {n_ifeval} (set ifeval.limit to at most {n_ifeval}, or null for all of them).")
    seen_train: dict[str, int] = {}  # train prompt id -> first iteration that used it
    layers = Layers(config_path, [o for o in overrides if o.split("=", 1)[0] != "dry_run"])
    tokenizers: dict[str, Any] = {}  # policy dir -> tokenizer (None: none here), for the rows' prompt checks
    files = _PlanFiles()  # written at the end, once every check has passed
    for i in range(0, cfg.iterations + 1):
        it = run_dir / f"iter_{i}"
        c = iteration_config(cfg, i)
        check_verifier_fields(c, eval_rows, f"eval_prompts {eval_src}")  # scored by eval_rewards in every iteration
        entries: dict[str, dict] = {}
        prompt_checks: list[tuple[Stage, dict]] = []  # rows whose values are checked against the train prompts
        for stage in STAGES.values():
            if not stage.runs_in(cfg, i):
                continue
            d = stage.config.from_dict(stage_dict(cfg, run_dir, i, stage.name)).model_dump(mode="json")
            path = it / "configs" / f"{stage.name}.yaml"
            argv, env = launch_command(stage, str(path), d, root=Path("."), launcher=c.launcher)
            command = " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, argv)])
            note = None
            if c.launcher == "local" and stage_machines(stage, d) > 1:
                note = (f"(machine 0's part; machine k of {stage_machines(stage, d)} runs the same with machine_rank k: "
                        f"`.venv-train/bin/python -m online_rlhf.loop exec {run_dir} {i} {stage.name} machine_rank=k`)")
            prov = value_origins(stage, d, c, i, layers, start=starting_policy(c, run_dir))
            if stage.checks.library is not None:  # e.g. DPO: the trl.DPOConfig the stage will build
                stage.checks.library(d, i, prov)
            header = stage_header(stage, i, layers, command, prov, note)
            files.add(path, header + yaml.safe_dump(d, sort_keys=False, allow_unicode=True))
            inputs, outputs = stage.io(d)
            entries[stage.name] = {"env": stage.env, "config": str(path), "command": command,
                                   "inputs": inputs, "outputs": outputs}
            if stage.checks.prompts is not None:  # checked against the iteration's train prompts below
                prompt_checks.append((stage, d))
        if i >= 1:
            src = prompt_source(c.train_prompts, "train")
            if src not in train_sets:
                from ..records import load_prompts

                train_sets[src] = load_prompts(src, prompt_field=c.prompt_field)
            rows = _prompt_slice(train_sets[src], c, i)
            check_verifier_fields(c, rows, f"train_prompts {src} (iteration {i}'s prompts)")
            warnings += drawn_argument_warnings(c, rows, f"train_prompts {src} (iteration {i}'s prompts)")
            files.add(it / "prompts.jsonl", _prompt_slice_text(rows))
            warnings += overlap_warnings(rows, i, eval_ids, seen_train)
            for stage, d in prompt_checks:
                warnings += stage.checks.prompts(c, i, rows, d, tokenizers)
        files.add(it / "plan.json", json_text(entries))
    warnings += other_algorithm_warnings(cfg)
    shell = {"RUN_DIR": str(run_dir), "ITERATIONS": cfg.iterations, "LAUNCH_PROFILE": cfg.launch_profile,
             "DRY_RUN": int(cfg.dry_run)}
    files.add(run_dir / "plan_warnings.json", json_text(warnings))
    body = yaml.safe_dump(run_config_dict(cfg), sort_keys=False, allow_unicode=True)
    if write if warn is None else warn:
        for w in warnings:
            print(f"WARNING: {w}", file=sys.stderr)
    if not write:
        return run_dir
    # Every check has passed: now the files. config.yaml last, so that a write cut short (disk full)
    # leaves the run's config as it was.
    files.write()
    if cfg.num_machines > 1 and cfg.launcher == "local":
        print(f"note: num_machines={cfg.num_machines}: this is machine 0. On each other machine k (same paths on a shared "
              f"filesystem), run: bash scripts/other_machine.sh {run_dir} k", file=sys.stderr)
    # dry_run is left out: a dry run followed by the real run resolves to the same run config.
    _write_run_config(run_dir, body, f"{RUN_CONFIG_HEADER} {config_path or 'defaults'} "
                      f"{' '.join(o for o in overrides if o.split('=', 1)[0] != 'dry_run')}\n")
    for k, v in shell.items():
        print(f"{k}={shlex.quote(str(v))}", file=shell_out or sys.stdout, flush=True)
    return run_dir


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 goes to stderr inside (libraries the plan's checks import print lines such
    as "[INFO] Running in WANDB offline mode" on stdout, which run_loop.sh would ``eval``); yields a
    file object on the real stdout."""
    try:
        real_fd = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture)
        real_fd = False
    if not real_fd:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        real.flush()
        real.close()
        os.dup2(saved, 1)
        os.close(saved)


def run_config_dict(cfg: LoopConfig) -> dict:
    """The resolved loop config as ``<run>/config.yaml`` holds it: every top-level key, and in each
    stage section only the keys that were set (a section's unset keys take the stage file's or the
    stage's default, and the seeds their per-iteration offsets), so the file given back to
    ``run_loop.sh`` resolves to the same stage configs. ``dry_run`` is left out."""
    d = cfg.model_dump(mode="json", exclude={"dry_run"})
    for name in SECTION_CLASSES:  # every stage section typed by its stage's config class
        d[name] = getattr(cfg, name).model_dump(mode="json", exclude_unset=True)
    return d


def _write_run_config(run_dir: Path, body: str, header: str) -> None:
    """Write ``<run>/config.yaml``; when a rerun resolves to a different config, the previous file
    is kept as ``config_history/config.<UTC time of its write>.yaml`` first, so every config that
    produced a finished stage stays on record."""
    path = run_dir / "config.yaml"
    if path.is_file() and path.read_text(encoding="utf-8").split("\n", 1)[-1] != body:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(path.stat().st_mtime))
        kept = run_dir / "config_history" / f"config.{stamp}.yaml"
        n = 1
        while kept.exists():
            n += 1
            kept = kept.with_name(f"config.{stamp}.{n}.yaml")
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, kept)
        print(f"note: the resolved config differs from the last run's; the previous one is kept as "
              f"{kept.relative_to(run_dir)}", file=sys.stderr)
    with atomic_open(path) as f:
        f.write(header)
        f.write(body)


def _prompt_slice(train: list[dict], c: LoopConfig, i: int) -> list[dict]:
    """Iteration i's train prompts: slice i of ``prompts_per_iteration`` (wrapping), else the first ``train_limit``."""
    n = c.prompts_per_iteration
    if n:
        start = ((i - 1) * n) % len(train)
        return (train + train)[start:start + min(n, len(train))]
    return train[: c.train_limit] if c.train_limit else train


def _prompt_slice_text(rows: list[dict]) -> str:
    """An iteration's train prompts (:func:`_prompt_slice`) as the JSONL text of its ``prompts.jsonl``."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return  # keep mtime and bytes stable; the hash is over content anyway
    with atomic_open(path) as f:
        f.write(text)


class _PlanFiles:
    """The files a plan writes into the run directory, held as text until the whole plan has passed.

    ``add`` only records ``(path, text)`` (a later ``add`` of the same path replaces the text);
    ``write`` then writes each file atomically (:func:`online_rlhf.jsonl.atomic_open`; a file that
    already holds the text is left untouched, mtime included), creating folders as needed. A plan
    that raises before ``write`` has created and changed nothing.
    """

    def __init__(self) -> None:
        self.texts: dict[Path, str] = {}

    def add(self, path: Path, text: str) -> None:
        self.texts[Path(path)] = text

    def write(self) -> None:
        for path, text in self.texts.items():
            _write_if_changed(path, text)


# The layout an interrupted or refused plan of earlier versions could leave behind (no config.yaml):
# per iteration, stage configs, plan.json, prompts.jsonl and logs; the lock at the top.
_PLAN_LEFTOVERS = {"configs", "plan.json", "prompts.jsonl", "logs"}


def fresh_refusal(run_dir: Path) -> str | None:
    """Why ``run_loop.sh --fresh`` must not empty ``run_dir``; None when it may.

    It may when ``run_dir`` is missing or holds nothing but ``.lock``; when its ``config.yaml``
    starts with the header :func:`plan` writes (:data:`RUN_CONFIG_HEADER`, or the older
    ``# resolved from``); or when it holds only what a plan that stopped half way could leave
    (before plans wrote nothing until they had passed): ``.lock`` and ``iter_<n>/`` folders with
    nothing but ``configs/`` (YAML files only), ``plan.json``, ``prompts.jsonl`` and ``logs/``
    (``.log`` files only).

    Returns:
        a one-line reason naming ``run_dir`` and what to do (choose another run, or empty it
        yourself), or None.
    """
    if not run_dir.is_dir():
        return None
    config = run_dir / "config.yaml"
    if config.is_file():
        with open(config, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        if first.startswith((RUN_CONFIG_HEADER, "# resolved from ")):
            return None
    elif _only_plan_leftovers(run_dir):
        return None
    return (f"--fresh refuses to clear {run_dir}: it holds files but no run config.yaml written by this loop, so it "
            "is not a run directory. Choose another output_root/run_name, or empty it yourself.")


def _only_plan_leftovers(run_dir: Path) -> bool:
    """True when ``run_dir`` holds only ``.lock`` and the per-iteration files of :data:`_PLAN_LEFTOVERS`."""
    for top in run_dir.iterdir():
        if top.name == ".lock" and top.is_file():
            continue
        if not (top.is_dir() and not top.is_symlink() and top.name.startswith("iter_") and top.name[5:].isdigit()):
            return False
        for entry in top.iterdir():
            if entry.name not in _PLAN_LEFTOVERS or entry.is_symlink():
                return False
            if entry.name == "configs" and not (entry.is_dir() and all(
                    f.is_file() and not f.is_symlink() and f.suffix in (".yaml", ".tmp") for f in entry.iterdir())):
                return False
            if entry.name == "logs" and not (entry.is_dir() and all(
                    f.is_file() and not f.is_symlink() and f.suffix == ".log" for f in entry.iterdir())):
                return False
            if entry.name in ("plan.json", "prompts.jsonl") and not entry.is_file():
                return False
    return True

