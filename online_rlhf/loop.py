"""The loop's bookkeeping, called by run_loop.sh (training env):

    python -m online_rlhf.loop plan CONFIG [key=value ...]   # resolve + validate, write stage configs
    python -m online_rlhf.loop plan-check CONFIG [key=value ...]  # the plan's checks only, nothing written
    python -m online_rlhf.loop check RUN_DIR ITER STAGE       # exit 0 if STAGE is done and fresh, 1 to run (prints env, why), 3 not planned
    python -m online_rlhf.loop fresh-check RUN_DIR            # exit 0 if run_loop.sh --fresh may empty RUN_DIR, else 2 (says why)
    python -m online_rlhf.loop stages RUN_DIR ITER            # ITER's planned stages, one per line, in the stage table's order
                                                              # ("<name> after": its row has an `after` check)
    python -m online_rlhf.loop after RUN_DIR ITER STAGE       # exit 1 (with why) when STAGE's row says the loop stops after it
    python -m online_rlhf.loop pairs-check RUN_DIR ITER       # exit 1 (with why and what to change) if ITER's pairs stage made 0 pairs
    python -m online_rlhf.loop exec RUN_DIR ITER STAGE [machine_rank=R] [key=value ...]  # run STAGE as its config file says
                                                              # (R > 0: this machine's part of a multi-machine stage;
                                                              # key=value: appended to the stage's command, e.g. dry_run=true)
    python -m online_rlhf.loop dry-run RUN_DIR                # each model stage once in dry mode; fit table; exit 1 if one does not fit
    python -m online_rlhf.loop mark RUN_DIR ITER STAGE SECONDS
    python -m online_rlhf.loop output-hint RUN_DIR MESSAGE    # which stage wrote a run file MESSAGE names, how to regenerate it
    python -m online_rlhf.loop metrics RUN_DIR ITER           # one row of metrics.jsonl
    python -m online_rlhf.loop report RUN_DIR                 # report.md + report.png (+ wandb)

    python -m online_rlhf.loop -h                             # every loop config key, sections included

``plan`` writes ``runs/<name>/config.yaml`` (the resolved loop config) and, per iteration,
``iter_<i>/configs/<stage>.yaml`` plus ``iter_<i>/plan.json`` naming each stage's config, command,
inputs and outputs (the stages are the rows of ``online_rlhf.stage_table.STAGES``). A stage's YAML
holds everything it needs, launch settings included (``num_shards``, ``num_processes``,
``launch_profile``), with comments saying how to run it by hand and where each value that is not
the stage's default came from. A stage's freshness hash covers its config values and its inputs,
so any changed setting or a re-made input reruns that stage and, through its outputs, every stage
after it; its ``.done`` also records the size and hash of its outputs, so an output changed after
the stage finished (cut, edited) reruns the stage that wrote it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError, apply_overrides, load_yaml
from .jsonl import DataError, json_text, read_json, read_jsonl, write_json, write_jsonl, atomic_open
from .paths import PROJECT_ROOT, default_model_dir, local_folder_prefix, resolve_model, setup_cache_env
from .rundir import changed_outputs, fingerprint, is_done, mark_done
from .stage_configs import DPOStageConfig, GenerateConfig, LoopConfig, SFTStageConfig
from .stage_table import (STAGES, Stage, iteration_config, launch_command, no_pairs_stop, prompt_source, stage_file,
                          stage_machines,
                          starting_policy)
from .stats import DPOStats, DryRunStats, GRPOStats, PairsStats, RewardStats, StageStats, stats_path
from .loop_keys import check_loop_keys
from .trl_args import check_axolotl_keys, check_dpo_training, check_lora, per_device_batch

# First line of <run>/config.yaml; run_loop.sh --fresh only clears a folder whose config.yaml has it.
RUN_CONFIG_HEADER = "# online_rlhf run config, resolved from"

# Keys of the loop config whose values are fixed per run, not per iteration.
_RUN_LEVEL = ("run_name", "output_root", "iterations", "policy", "sft", "per_iteration", "wandb", "dry_run", "algorithm",
              "num_machines", "machine_rank", "main_process_ip", "main_process_port", "launcher",
              "ifeval", "kl_samples", "kl_warn", "eval_cache")


def resolve(config_path: str | None, overrides: list[str]) -> LoopConfig:
    """Load the loop config (``configs/loop.yaml`` layout), apply overrides, validate every stage.

    Raises:
        ConfigError: unknown/invalid key in the loop config or in any stage section, at the top level
        or in ``per_iteration`` (named by its path as written, e.g. ``per_iteration.2.generaton``,
        with the closest known key; see ``online_rlhf.loop_keys``), or a combination of values a stage
        refuses (naming the iteration and the stage).
    """
    data = load_yaml(config_path) if config_path else {}
    data = apply_overrides(data, overrides)
    src = f"{config_path or 'defaults'}" + (f" + {' '.join(overrides)}" if overrides else "")
    check_loop_keys(data, src, _RUN_LEVEL)  # every section key, named as written, before any stage check
    cfg = LoopConfig.from_dict(data, src)
    if cfg.machine_rank != 0:
        raise ConfigError(f"{src}: machine_rank={cfg.machine_rank}: run_loop.sh and the plan run on machine 0 only. "
                          f"On machine {cfg.machine_rank}, run each distributed stage of machine 0's run with "
                          f"`.venv-train/bin/python -m online_rlhf.loop exec RUN_DIR ITER STAGE machine_rank={cfg.machine_rank}` "
                          "(docs/multi-node.md).")
    for i in cfg.per_iteration:
        if not 1 <= i <= cfg.iterations:
            raise ConfigError(f"{src}: per_iteration has iteration {i}, but iterations={cfg.iterations}.")
    if cfg.policy != "default":  # the default is prepared by run_loop.sh before the plan runs
        _check_local_model(cfg.policy, "policy", src, "a checkpoint folder, an HF Hub id (owner/name) or 'default'")
    for i in range(0, cfg.iterations + 1):  # a reward model given as a local path (Hub ids are not looked up here)
        r = iteration_config(cfg, i).reward
        if r.source == "reward_model" and r.reward_model:
            _check_local_model(r.reward_model, "reward.reward_model" if i not in cfg.per_iteration else
                               f"reward.reward_model (iteration {i})", src,
                               "a reward-model folder or an HF Hub id (owner/name)")
    if cfg.sft.get("enabled"):  # the stage file's Axolotl keys too (the loop's own are checked above)
        sft = SFTStageConfig.from_dict(sft_dict(cfg, Path("/dry-run")), f"{src}, stage sft")
        check_axolotl_keys(sft.model_extra or {}, prefix=f"{cfg.sft.get('config', 'configs/sft.yaml')}: ",
                           also_known=set(SFTStageConfig.model_fields))
    # Dry validation: build every stage config of every iteration without touching models.
    dpo_dicts: dict[int, dict] = {}  # iteration -> resolved DPO stage dict (batch split checked below)
    grpo_dicts: dict[int, dict] = {}  # iteration -> resolved GRPO stage dict
    for i in range(0, cfg.iterations + 1):
        for stage in STAGES.values():
            if not stage.runs_in(cfg, i) or stage.name == "sft":
                continue
            d = stage_dict(cfg, Path("/dry-run"), i, stage.name)
            stage_cfg = stage.config.from_dict(d, f"{src}, iteration {i}, stage {stage.name}")
            if stage.name == "generate" and stage_cfg.k < 2:
                need = ("GRPO needs a group of at least 2 responses per train prompt (each response's advantage is "
                        "its reward against the group's)" if cfg.algorithm == "grpo" else
                        "a chosen/rejected pair needs at least 2 responses per train prompt")
                raise ConfigError(f"{src}, iteration {i}: generation.k={stage_cfg.k}, but {need}; set generation.k >= 2 "
                                  f"({'4-16' if cfg.algorithm == 'grpo' else '4-8'} is usual).")
            if stage.name == "grpo":
                _check_grpo_length(cfg, i, d, f"{src}, iteration {i}")
                grpo_dicts[i] = d
            if stage.name == "dpo":  # the merged section: also the keys of the dpo_config file
                check_dpo_training(d["training"], f"{src}, iteration {i}: dpo.training")
                check_lora(d.get("lora"), f"{src}, iteration {i}: dpo.lora", required=False)
                dpo_dicts[i] = d
    for section in ("generation", "evaluation"):
        if getattr(cfg, section).dtype == "bfloat16" and cfg.launch_profile == "cpu":
            from .hardware import compute_dtype

            compute_dtype("cpu", "bfloat16")  # one-line warning where the CPU has no native bf16
    from .hardware import fixed_cores

    try:
        fixed_cores()  # a bad ONLINE_RLHF_CORES is refused here, not by the first stage
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.num_processes == "auto":
        cfg.num_processes = auto_processes(cfg.launch_profile, [_dpo_batch(d) for d in dpo_dicts.values()],
                                           num_machines=cfg.num_machines)
    for i, d in dpo_dicts.items():
        try:
            per_device_batch(d.get("train_batch_size"), d.get("training", {}), cfg.num_processes, where="dpo.",
                             processes_key="num_processes")
        except ConfigError as e:
            raise ConfigError(f"{src}, iteration {i}: {e}") from None
    if cfg.dry_run:
        if cfg.num_machines > 1:
            raise ConfigError(f"{src}: dry_run=true with num_machines={cfg.num_machines}: the dry run measures each "
                              "stage on this machine alone (a multi-machine stage would wait for the others). Run it "
                              "with num_machines=1 and the per-machine process count (num_processes=<processes per "
                              "machine>): each machine holds the same share.")
        if 1 in dpo_dicts and dpo_dicts[1].get("training", {}).get("max_length") is None:
            raise ConfigError(f"{src}: dry_run=true needs dpo.training.max_length (the dummy pairs are that long); "
                              "set it, e.g. dpo.training.max_length=1024.")
        if 1 in grpo_dicts and grpo_dicts[1].get("max_length") is None:
            raise ConfigError(f"{src}: dry_run=true needs grpo.max_length (the dummy prompt + completion is that "
                              "long); set it, e.g. grpo.max_length=1024.")
    if cfg.num_machines > 1 and cfg.generation_shards < cfg.num_machines:
        print(f"WARNING: generation_shards={cfg.generation_shards} < num_machines={cfg.num_machines}: machines "
              f"{cfg.generation_shards}..{cfg.num_machines - 1} run no generation shard (one shard per device of "
              "every machine is usual).", file=sys.stderr)
    return cfg


def _check_local_model(value: str, key: str, src: str, what: str) -> None:
    """Refuse a model ``value`` that is meant as a local path (``./``, ``../``, ``/``, ``~``, two slashes,
    or ``first/rest`` with a folder ``first`` here; see :func:`online_rlhf.paths.resolve_model`) and
    does not exist, before any stage runs. A Hub id (``owner/name``) is accepted unchecked.

    Raises:
        ConfigError: naming the key, the absolute path looked at, where relative paths are taken
            from, and what to give instead (``what``).
    """
    try:
        resolve_model(value)
    except FileNotFoundError:
        looked = Path(value).expanduser().absolute()
        hub = (f" ('{local_folder_prefix(value)}' is a folder in {Path.cwd()}, so {value} is taken as a local path, "
               "not a Hub id.)" if local_folder_prefix(value) else "")
        raise ConfigError(f"{src}: {key}={value}: no such directory (looked at {looked}; run_loop.sh takes a relative "
                          f"path from where you run it when it is there, else from the project root {PROJECT_ROOT}).{hub} "
                          f"Fix the path (an absolute one is the surest), or give {what}.") from None


def _check_grpo_length(cfg: LoopConfig, i: int, d: dict, where: str) -> None:
    """``grpo.max_length`` (prompt + completion tokens) must leave room for a prompt beside a
    completion of ``generation.max_tokens`` (the stage's ``max_completion_length``); the longest
    prompt is not tokenized here (the stage counts and warns about what it cuts or drops).

    Raises:
        ConfigError: ``max_length <= generation.max_tokens``, naming both keys and where max_length was set.
    """
    L, T = d.get("max_length"), d["max_completion_length"]
    if L is None or L > T:
        return
    if "max_length" in ((cfg.per_iteration.get(i) or {}).get("grpo") or {}):
        origin = f"per_iteration.{i}.grpo.max_length"
    elif "max_length" in cfg.grpo.model_dump(exclude_unset=True):
        origin = "the grpo section"
    else:
        origin = f"grpo_config={iteration_config(cfg, i).grpo_config}"
    raise ConfigError(f"{where}: grpo.max_length={L} ({origin}) is not above generation.max_tokens={T}: a completion "
                      "of max_tokens would leave no room for its prompt, so every group is dropped or cut. Set "
                      f"grpo.max_length above the longest prompt + generation.max_tokens (e.g. {T + 512}), lower "
                      "generation.max_tokens, or set grpo.max_length=null (no cap).")


def _dpo_batch(d: dict) -> tuple[int | None, int]:
    """(train_batch_size, gradient_accumulation_steps) of a resolved DPO stage dict."""
    return d.get("train_batch_size"), int(d.get("training", {}).get("gradient_accumulation_steps", 1))


def auto_processes(launch_profile: str, dpo_batches: list[tuple[int | None, int]], free: int | None = None,
                   num_machines: int = 1) -> int:
    """``num_processes: auto``, the total over ``num_machines`` machines (this machine's count
    times ``num_machines``: the machines are taken to be alike): one per GPU; on CPU (profile
    ``cpu``) one per usable core (or ``free``, or ``ONLINE_RLHF_CORES``), lowered to the largest per-machine count whose total
    divides every iteration's ``dpo.train_batch_size`` (with its gradient accumulation). Not
    load-dependent, unlike threads: the rank count changes how gradients are summed, and a rerun
    must train the same numbers."""
    if launch_profile != "cpu":
        import torch

        return max(1, torch.cuda.device_count()) * num_machines
    from .hardware import fixed_cores, usable_cores

    try:
        fixed = fixed_cores()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n = free if free is not None else (fixed or usable_cores())
    while n > 1 and any(b is not None and b % (n * num_machines * a) for b, a in dpo_batches):
        n -= 1
    return n * num_machines


def sft_dict(cfg: LoopConfig, run_dir: Path) -> dict:
    """The SFT stage config (run once, before iteration 1): the Axolotl stage file ``sft.config``,
    the loop's other ``sft`` keys over it (e.g. ``sft.dataset``, ``sft.learning_rate``), the starting
    policy as ``base_model`` and ``<run>/sft/model`` as ``output_dir``."""
    return STAGES["sft"].build(cfg, run_dir, 0)


def stage_dict(cfg: LoopConfig, run_dir: Path, i: int, stage: str) -> dict:
    """The config mapping of ``stage`` in iteration ``i`` (before validation), as the stage table wires it."""
    return STAGES[stage].build(iteration_config(cfg, i), run_dir, i)


def _check_dpo_config(d: dict, i: int, prov: list[tuple[str, Any, str]]) -> None:
    """Build iteration ``i``'s ``trl.DPOConfig`` from its resolved DPO stage config ``d`` as the
    stage will (``run_dpo.build_dpo_args``, with the planned process count; nothing is written), so
    that values TRL refuses together (e.g. ``loss_type: sigmoid`` with the recipe's
    ``loss_weights: [1, 1]``) stop the plan instead of the DPO stage after generation, rewards and
    pairs. Skipped where TRL is not installed (the stage itself always has it).

    Raises:
        ConfigError: TRL's message, the iteration, and each ``dpo`` key it names with its value and
            where it was set (the stage YAML's provenance).
    """
    try:
        import torch

        from .stages.run_dpo import build_dpo_args
    except ImportError:
        return
    cfg = DPOStageConfig.model_validate(d)
    try:
        build_dpo_args(cfg, Path(f"{d['output_dir']}.work"), torch.cuda.is_available(),
                       world_size=d.get("num_processes") or 1)
    except ConfigError as e:
        msg = str(e).removeprefix("training: ")
        named = [(k, v, o) for k, v, o in prov if k.startswith("training.")
                 and re.search(rf"(?<![\w.]){re.escape(k.split('.', 1)[1])}(?!\w)", msg)]
        keys = "; ".join(f"dpo.{k}={json.dumps(v, default=str)} ({o})" for k, v, o in named)
        raise ConfigError(f"iteration {i}, stage dpo: {msg}" + (f" The keys: {keys}." if keys else "")
                          + " Change them so that trl.DPOConfig accepts them (nothing has run yet).") from None


def plan(config_path: str | None, overrides: list[str], write: bool = True, shell_out=None) -> Path:
    """Resolve the config, write the run dir's config.yaml, stage configs, plan.json and prompt
    slices; print shell assignments (RUN_DIR, ITERATIONS, ...) for run_loop.sh to ``eval``, to
    ``shell_out`` (default: stdout).

    Every file's content is built and every input (prompt sets, models, verifier fields) checked
    first; the files are written only once the whole plan has passed (:class:`_PlanFiles`), so a
    plan refused on the way (e.g. a missing ``train_prompts`` file, at the top level or in
    ``per_iteration``) leaves an existing run directory as it was, and creates nothing.

    ``write=False`` runs every check and writes and prints nothing (``loop plan-check``:
    ``run_loop.sh --fresh`` runs it before it empties the old run, so a plan that would be refused
    leaves the old run in place).

    Raises:
        ConfigError, DataError, FileNotFoundError: as :func:`resolve` and the prompt loaders; nothing
            has been written then.
    """
    cfg = resolve(config_path, overrides)
    _check_ifeval_prompts(cfg)
    run_dir = Path(cfg.output_root) / cfg.run_name
    run_dir = run_dir.resolve()
    train_sets: dict[str, list[dict]] = {}  # prompt source -> rows (a source may change per iteration)
    warnings: list[str] = []
    eval_src, eval_rows = _eval_rows(cfg, run_dir)
    eval_ids = {_prompt_key(r) for r in eval_rows}
    seen_train: dict[str, int] = {}  # train prompt id -> first iteration that used it
    layers = _Layers(config_path, [o for o in overrides if o.split("=", 1)[0] != "dry_run"])
    tokenizers: dict[str, Any] = {}  # policy dir -> tokenizer (None: none here), for the GRPO length check
    files = _PlanFiles()  # written at the end, once every check has passed
    for i in range(0, cfg.iterations + 1):
        it = run_dir / f"iter_{i}"
        c = iteration_config(cfg, i)
        _check_verifier_fields(c, eval_rows, f"eval_prompts {eval_src}")  # scored by eval_rewards in every iteration
        entries, grpo_values = {}, {}
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
            prov = _provenance(stage, d, c, i, layers, start=starting_policy(c, run_dir))
            if stage.name == "dpo":
                _check_dpo_config(d, i, prov)
            header = _stage_header(stage, i, layers, command, prov, note)
            files.add(path, header + yaml.safe_dump(d, sort_keys=False, allow_unicode=True))
            inputs, outputs = stage.io(d)
            entries[stage.name] = {"env": stage.env, "config": str(path), "command": command,
                                   "inputs": inputs, "outputs": outputs}
            if stage.name == "grpo":
                grpo_values = d
        if i >= 1:
            src = prompt_source(c.train_prompts, "train")
            if src not in train_sets:
                from .records import load_prompts

                train_sets[src] = load_prompts(src, prompt_field=c.prompt_field)
            rows = _prompt_slice(train_sets[src], c, i)
            _check_verifier_fields(c, rows, f"train_prompts {src} (iteration {i}'s prompts)")
            files.add(it / "prompts.jsonl", _prompt_slice_text(rows))
            warnings += _overlap_warnings(rows, i, eval_ids, seen_train)
            if grpo_values:
                warnings += _grpo_prompt_length_warnings(c, i, rows, grpo_values, tokenizers)
        files.add(it / "plan.json", json_text(entries))
    warnings += _other_algorithm_warnings(cfg)
    shell = {"RUN_DIR": str(run_dir), "ITERATIONS": cfg.iterations, "LAUNCH_PROFILE": cfg.launch_profile,
             "DRY_RUN": int(cfg.dry_run)}
    files.add(run_dir / "plan_warnings.json", json_text(warnings))
    body = yaml.safe_dump(run_config_dict(cfg), sort_keys=False, allow_unicode=True)
    if not write:
        return run_dir
    # Every check has passed: now the files. config.yaml last, so that a write cut short (disk full)
    # leaves the run's config as it was.
    files.write()
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
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
def _stdout_to_stderr():
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


def _grpo_prompt_length_warnings(c: LoopConfig, i: int, rows: list[dict], d: dict, tokenizers: dict) -> list[str]:
    """Iteration ``i``'s GRPO length check against its train prompts: the longest prompt (the starting
    policy's chat template, as the generation stage renders it) + ``generation.max_tokens`` against
    ``grpo.max_length``. Only where it is cheap: the starting policy's tokenizer is in a local folder
    (a Hub id or a model not made yet, e.g. the SFT model, is not checked here; the stage counts and
    warns about what it drops or cuts).

    Returns:
        one warning when a prompt would be dropped (it fills max_length) or a full-length completion cut.
    """
    L, T = d.get("max_length"), d["max_completion_length"]
    if L is None:
        return []
    path = str(default_model_dir()) if c.policy == "default" else c.policy  # the SFT model keeps its base's tokenizer
    if path not in tokenizers:
        tokenizers[path] = None
        if (Path(path) / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizers[path] = AutoTokenizer.from_pretrained(path)
    tok = tokenizers[path]
    if tok is None or tok.chat_template is None:
        return []
    from .chat_tokens import ChatTokenError, chat_token_ids

    lengths = []
    for r in rows:
        try:
            lengths.append((len(chat_token_ids(tok, r["prompt"], add_generation_prompt=True)), r["id"]))
        except ChatTokenError:
            continue  # the generation stage skips and counts it
    if not lengths:
        return []
    longest, rid = max(lengths)
    if longest + T <= L:
        return []
    over = sum(n >= L for n, _ in lengths)
    return [f"iteration {i}: the longest train prompt ({rid!r}) is {longest} tokens; with generation.max_tokens={T} "
            f"a completion can reach {longest + T} > grpo.max_length={L} tokens, so long completions lose their tail"
            + (f" and {over} prompt(s) that fill max_length drop their group" if over else "")
            + f". Set grpo.max_length >= {longest + T} (or null), or lower generation.max_tokens."]


def _other_algorithm_warnings(cfg: LoopConfig) -> list[str]:
    """One warning naming every key set for the algorithm that does not run (``grpo`` keys under
    ``algorithm=dpo``, ``dpo`` keys under ``algorithm=grpo``; top level and ``per_iteration``): not
    an error, since switching algorithms is one key, but the keys change nothing."""
    other = "grpo" if cfg.algorithm == "dpo" else "dpo"
    keys = _flat_keys(getattr(cfg, other).model_dump(exclude_unset=True), other)
    for i, over in sorted(cfg.per_iteration.items()):
        if isinstance(over.get(other), dict):
            keys += _flat_keys(over[other], f"per_iteration.{i}.{other}")
    if not keys:
        return []
    return [f"algorithm={cfg.algorithm}: {', '.join(keys)} {'is' if len(keys) == 1 else 'are'} ignored (the {other} "
            f"section applies under algorithm={other}); remove {'it' if len(keys) == 1 else 'them'} or set "
            f"algorithm={other}."]


def _flat_keys(d: dict, prefix: str) -> list[str]:
    """``{"training": {"beta": 1}}`` -> ``["<prefix>.training.beta"]``."""
    out = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}.{k}") if isinstance(v, dict) and v else [f"{prefix}.{k}"]
    return out


def _check_ifeval_prompts(cfg: LoopConfig) -> None:
    """When the run has IFEval stages (``ifeval.when`` other than ``never``), their prompt file must
    exist before the first stage (else ``ifeval_generate`` fails after the training of the run).
    A Hub dataset id (``owner/name``, not a local path) is left to the stage.

    Raises:
        ConfigError: a missing local file, naming ``ifeval.prompts``, the path and the fixes.
    """
    if cfg.ifeval.when == "never":
        return
    from .paths import default_data_dir

    given = cfg.ifeval.prompts
    path = default_data_dir() / "ifeval.jsonl" if given == "default" else Path(given)
    local = (given == "default" or path.suffix in (".jsonl", ".json", ".parquet", ".csv") or path.is_absolute()
             or given.startswith(".") or given.count("/") != 1)
    if local and not path.exists():
        raise ConfigError(f"ifeval.prompts={given}: no such file ({path}); ifeval.when={cfg.ifeval.when} runs IFEval on "
                          "it. Prepare the default with `.venv-train/bin/python scripts/prepare_default.py` (writes "
                          f"{default_data_dir() / 'ifeval.jsonl'}), point ifeval.prompts at a JSONL file of IFEval "
                          "prompts (prompt, instruction_id_list, kwargs), or set ifeval.when=never.")


class _Layers:
    """The layers a loop config is resolved from, for the provenance comments of the stage YAMLs:
    the loop config file as written and the command-line overrides."""

    def __init__(self, config_path: str | None, overrides: list[str]):
        self.file_name = str(config_path) if config_path else None
        self.file = load_yaml(config_path) if config_path else {}
        self.cli = apply_overrides({}, overrides)
        self.overrides = list(overrides)

    def find(self, path: list) -> str | None:
        """Where the loop key ``path`` (e.g. ``["dpo", "training", "beta"]``) was set: the command
        line or the config file; None when neither sets it."""
        if _lookup(self.cli, path)[0]:
            dotted = ".".join(map(str, path))
            given = [o for o in self.overrides if dotted == o.split("=", 1)[0] or dotted.startswith(o.split("=", 1)[0] + ".")]
            return f"command line: {given[-1] if given else dotted + '=...'}"
        if _lookup(self.file, path)[0]:
            return f"{_short(self.file_name)}: {'.'.join(map(str, path))}"
        return None


def _lookup(data: Any, path: list) -> tuple[bool, Any]:
    for k in path:
        if not isinstance(data, dict):
            return False, None
        if k not in data and str(k) in data:
            k = str(k)
        elif k not in data and isinstance(k, str) and k.isdigit() and int(k) in data:
            k = int(k)
        if k not in data:
            return False, None
        data = data[k]
    return True, data


def _short(path: str | None) -> str:
    if not path:
        return "defaults"
    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


# Stage keys the plan derives from a top-level loop key (the rest of its own keys are the run layout).
_DERIVED = {"seed": "seed", "prompts": None, "num_shards": "generation_shards", "num_processes": "num_processes",
            "launch_profile": "launch_profile", "limit": "eval_limit", "prompt_field": "prompt_field",
            "model": "policy", "policy": "policy", "base_model": "policy", "reference": "ref_model",
            "num_machines": "num_machines", "main_process_ip": "main_process_ip", "main_process_port": "main_process_port"}


# Seeds the plan offsets per iteration, so that each iteration samples and pairs afresh.
_SEED_OFFSET = {"generate": "+ 1000 x iteration", "pairs": "+ iteration"}

# Values of the evaluation stages that the plan sets itself: (stage, key) -> origin.
_PLAN_SET = {
    ("kl_generate", "k"): "loop key kl_samples",
    ("kl_generate", "prompts"): "loop key eval_prompts (the held-out prompts)",
    ("kl_generate", "temperature"): "the KL estimate samples from the policy itself (temperature 1)",
    ("kl_generate", "top_p"): "the KL estimate samples from the policy itself (top_p 1)",
    ("kl_generate", "seed"): "loop key seed + 1000 x iteration + 500",
    ("kl", "reference"): "the starting policy (KL is measured from where the loop started)",
    ("ifeval_generate", "prompts"): "loop key ifeval.prompts",
    ("grpo", "temperature"): "loop key generation.temperature (the rollouts' sampling temperature)",
    ("grpo", "max_completion_length"): "loop key generation.max_tokens (the rollouts' max new tokens)",
}


def _provenance(stage: Stage, d: dict, c: LoopConfig, i: int, layers: _Layers,
                start: str | None = None) -> list[tuple[str, Any, str]]:
    """``(key, value, origin)`` for each value of the resolved stage config ``d`` that differs from
    the stage class's default (each key of a dict field such as ``training``, one level down).
    Origins, highest precedence first: ``per_iteration.<i>``, then the loop's section on the command
    line or in the config file, then the stage's own YAML (``dpo_config`` / ``sft.config``), then
    a top-level loop key the plan derives the value from, else the run layout."""
    fields = stage.config.model_fields
    own_file = None
    if stage.stage_file_key:
        parts = stage.stage_file_key.split(".")
        own_file = _lookup(c.model_dump(), parts)[1] if len(parts) > 1 else getattr(c, parts[0])
        if own_file is None and stage.name == "sft":
            own_file = "configs/sft.yaml"
    own = stage_file(own_file) if own_file else {}
    leaves = []
    for k, v in d.items():
        f = fields.get(k)
        if isinstance(v, dict) and v:
            leaves += [([k, sub], sv) for sub, sv in v.items()]
        elif f is None or f.is_required() or v != (f.default_factory() if f.default_factory else f.default):
            leaves.append(([k], v))
    out = []
    for path, v in leaves:
        origin = _PLAN_SET.get((stage.name, ".".join(map(str, path))))
        for sec in stage.sections if origin is None else ():
            for where in (["per_iteration", i, sec], [sec]):
                origin = layers.find([*where, *path])
                if origin:
                    break
            if origin:
                break
        if not origin:  # a loop section's own default (e.g. evaluation: greedy, k=1)
            sec = next((sec for sec in stage.sections if sec != "sft"
                        and _lookup(getattr(c, sec).model_dump(exclude_unset=True), path)[0]), None)
            origin = f"the loop's default ({sec}.{'.'.join(map(str, path))})" if sec else None
        if not origin and own_file and _lookup(own, path)[0]:
            origin = _short(str(PROJECT_ROOT / own_file) if not Path(own_file).is_absolute() else own_file)
        key = "eval_prompts" if (stage.name, path[-1]) == ("eval_generate", "prompts") else _DERIVED.get(path[-1])
        if not origin and path[-1] in ("model", "policy") and start is not None and v != start:
            origin = ("this iteration's trained model" if str(v).endswith(f"iter_{i}/model")
                      else "the model of the iteration before")
        if not origin and key and (path[0] != "training" or path[-1] == "seed"):
            origin = f"loop key {key} ({layers.find([key]) or 'its default'})"
            if path == ["seed"] and stage.name in _SEED_OFFSET:
                origin = f"loop key seed {_SEED_OFFSET[stage.name]} ({layers.find(['seed']) or 'its default'})"
            if path == ["num_processes"] and d.get("source", "reward_model") != "reward_model":
                origin = f"one process: source={d.get('source')} runs in one process"
        out.append((".".join(map(str, path)), v, origin or "the run layout"))
    return out


def _stage_header(stage: Stage, i: int, layers: _Layers, command: str, prov: list[tuple[str, Any, str]],
                  note: str | None = None) -> str:
    """The comment block on top of a stage's YAML: what it is, the command that runs it (from the
    project root, as run_loop.sh does; ``note`` below it, e.g. what the other machines run) and
    where each non-default value came from."""
    src = _short(layers.file_name) + (" + " + " ".join(layers.overrides) if layers.overrides else "")
    lines = [f"# Stage {stage.name} of iteration {i}, resolved by `python -m online_rlhf.loop plan` from {src}.",
             f"# {stage.config.__name__}; this file alone reproduces the stage. From the project root:",
             f"#   {command}",
             *([f"#   {note}"] if note else []),
             "# Values that differ from the stage's defaults, and where each came from:"]
    for key, v, origin in prov:
        text = json.dumps(v, ensure_ascii=False, default=str)
        text = text if len(text) <= 60 else text[:57] + "..."
        lines.append(f"#   {key}: {text}  <- {origin}")
    return "\n".join(lines) + "\n"


def run_config_dict(cfg: LoopConfig) -> dict:
    """The resolved loop config as ``<run>/config.yaml`` holds it: every top-level key, and in each
    stage section only the keys that were set (a section's unset keys take the stage file's or the
    stage's default, and the seeds their per-iteration offsets), so the file given back to
    ``run_loop.sh`` resolves to the same stage configs. ``dry_run`` is left out."""
    d = cfg.model_dump(mode="json", exclude={"dry_run"})
    for name in ("generation", "evaluation", "reward", "pairs", "dpo", "grpo"):
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


def _eval_rows(cfg: LoopConfig, run_dir: Path) -> tuple[str, list[dict]]:
    """``(source, rows)`` of the held-out prompts, loaded exactly as the eval_generate stage will load them."""
    from .records import load_prompts

    g = GenerateConfig.from_dict(stage_dict(cfg, run_dir, 0, "eval_generate"))
    return g.prompts, load_prompts(g.prompts, g.prompt_split, g.prompt_field, g.limit)


def _check_verifier_fields(c: LoopConfig, rows: list[dict], what: str) -> None:
    """With ``reward.source=verifier``, every prompt of ``rows`` must carry the fields the verifier
    scores by (:func:`online_rlhf.verifiers.missing_fields`), else the rewards stage would leave it
    unscored (``missing_field``) after its responses were generated.

    Raises:
        ConfigError: naming ``what`` (the key and file), how many prompts lack the fields, the first
            one's id, what it lacks, and the fixes (add the fields, or another reward source).
    """
    if c.reward.source != "verifier":
        return
    from .verifiers import FIELDS_HELP, missing_fields

    bad = [(r["id"], m) for r in rows if (m := missing_fields(r, c.reward.verifier))]
    if not bad:
        return
    rid, lacks = bad[0]
    kinds = [c.reward.verifier] if c.reward.verifier != "auto" else ["ifeval", "math"]
    raise ConfigError(
        f"{what}: {len(bad)} of {len(rows)} prompts lack the fields reward.source=verifier "
        f"(reward.verifier={c.reward.verifier}) scores by; the first, id {rid!r}, needs {lacks}. Their responses would "
        f"be generated, then left unscored. Add to every prompt {' or '.join(FIELDS_HELP[k] for k in kinds)}; or score "
        "them another way: reward.source=reward_model reward.reward_model=<folder or Hub id> (a Bradley-Terry reward "
        "model), reward.source=remote reward.url=<http://...>, or reward.source=judge reward.url=<.../v1> "
        "reward.judge_model=<name>.")


def _prompt_key(rec: dict) -> str:
    """Identity of a prompt for overlap checks: its text (ids of two files need not agree)."""
    return json.dumps(rec["prompt"], sort_keys=True, ensure_ascii=False)


def _overlap_warnings(rows: list[dict], i: int, eval_keys: set[str], seen: dict[str, int]) -> list[str]:
    out = []
    keys = [_prompt_key(r) for r in rows]
    held = sum(k in eval_keys for k in keys)
    if held:
        out.append(f"iteration {i}: {held} of {len(rows)} train prompts are also held-out prompts; the held-out "
                   "reward then measures training prompts. Use disjoint train_prompts / eval_prompts.")
    again = sorted({seen[k] for k in keys if k in seen})
    if again:
        n = sum(k in seen for k in keys)
        out.append(f"iteration {i}: {n} of {len(rows)} train prompts were already used in iteration(s) "
                   f"{', '.join(map(str, again))} (the train set is smaller than iterations x prompts_per_iteration).")
    for k in keys:
        seen.setdefault(k, i)
    return out


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return  # keep mtime and bytes stable; the hash is over content anyway
    with atomic_open(path) as f:
        f.write(text)


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


def _stage_entry(run_dir: Path, i: int, stage: str) -> dict:
    plan_path = run_dir / f"iter_{i}" / "plan.json"
    entries = read_json(plan_path)
    if stage not in entries:
        raise ConfigError(f"{plan_path}: no stage {stage!r}; stages: {', '.join(entries)}.")
    return entries[stage]


def stage_hash(run_dir: Path, i: int, stage: str) -> str:
    """Hash of a stage's config values (with the run dir's own path masked; launch settings
    included, comments not) and its inputs' content: a run directory moved or copied elsewhere
    resumes where it stopped, and a changed setting of any kind reruns the stage."""
    e = _stage_entry(run_dir, i, stage)
    values = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))  # values, not the comments
    config_text = json.dumps(values, sort_keys=True, ensure_ascii=False).replace(str(run_dir), "<run_dir>")
    return fingerprint({"stage": stage, "config": config_text}, e["inputs"], root=run_dir)


def exec_stage(run_dir: Path, i: int, stage: str, overrides: list[str] = (), machine_rank: int = 0,
               wait_poll_s: float = 10.0) -> None:
    """Replace this process by the command that runs ``stage`` of iteration ``i``, built from the
    stage's config file by :func:`online_rlhf.stage_table.launch_command` (the command written on
    top of that file; the run's ``launcher`` from ``<run>/config.yaml``), from the project root.
    Prints the command first (it heads the stage's log).

    On machine ``machine_rank`` k > 0 (``num_machines`` > 1, ``launcher: local``): a stage that runs
    on machine 0 only returns at once (nothing to run here); a stage that is already done and fresh
    returns too; otherwise it first waits until the stage before it in machine 0's run is done and
    fresh (its inputs are then written), so that machine k can run every stage of the run in order
    (docs/multi-node.md) and meet machine 0 at each distributed one.

    Args:
        overrides: ``key=value`` arguments appended to the stage's command (e.g. ``dry_run=true``);
            they change this run only, not the stage's config file or its freshness hash.
    Raises:
        ConfigError: no such stage in the iteration's plan.json; ``machine_rank`` outside the stage's
            machines; a rank > 0 under ``launcher: slurm`` (srun starts every node's part).
    """
    e = _stage_entry(run_dir, i, stage)
    d = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
    launcher = _run_launcher(run_dir)
    if machine_rank != 0:
        m = stage_machines(STAGES[stage], d)
        if m > 1 and not 0 <= machine_rank < m:  # before any wait
            raise ConfigError(f"machine_rank={machine_rank} must be in 0..{m - 1} (num_machines={m}).")
        if launcher == "slurm":
            raise ConfigError(f"machine_rank={machine_rank}: this run uses launcher=slurm, where srun starts every "
                              "node's part from machine 0; nothing to start by hand.")
        if stage_machines(STAGES[stage], d) == 1:
            print(f"stage {stage} of iteration {i} runs on machine 0 only; nothing to run on machine {machine_rank}.")
            return
        _wait_for_previous_stage(run_dir, i, stage, wait_poll_s)
        if check(run_dir, i, stage):
            print(f"stage {stage} of iteration {i} is done and fresh; nothing to run on machine {machine_rank}.")
            return
    if machine_rank == 0 and not overrides and _reuse_cached(run_dir, i, stage, e, d):
        return
    argv, env = launch_command(STAGES[stage], e["config"], d, machine_rank=machine_rank, launcher=launcher,
                               extra=list(overrides))
    print("+ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, argv)]), flush=True)
    os.chdir(PROJECT_ROOT)
    os.execve(argv[0] if os.sep in argv[0] else _which(argv[0]), argv, {**os.environ, **env})


def _eval_cache_key(run_dir: Path, i: int, stage: str, e: dict, d: dict) -> str | None:
    """The evaluation-cache key of a stage (``online_rlhf.eval_cache``), or None when the stage is
    not cached here (not a ``cache_iteration_0`` row, not iteration 0, or the run turned it off)."""
    from . import eval_cache

    if i != 0 or not STAGES[stage].cache_iteration_0 or not eval_cache.enabled(_run_config(run_dir)):
        return None
    return eval_cache.cache_key(stage, d, e["inputs"])


def _reuse_cached(run_dir: Path, i: int, stage: str, e: dict, d: dict) -> bool:
    """Copy the stage's output from the evaluation cache when it holds it; True when it did."""
    from . import eval_cache

    key = _eval_cache_key(run_dir, i, stage, e, d)
    entry = eval_cache.lookup(key) if key else None
    if entry is None:
        return False
    out = Path(e["outputs"][0])
    source = eval_cache.restore(entry, out, stats_path(out), STAGES[stage].stats)
    print(f"stage {stage} of iteration {i}: the same starting policy, prompts and settings were evaluated before; "
          f"reused {source} (evaluation cache {entry}; eval_cache=false decodes afresh)", flush=True)
    return True


def _which(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if not found:
        raise ConfigError(f"{name}: not found on PATH (launcher=slurm needs SLURM's srun: run inside an allocation).")
    return found


def _run_launcher(run_dir: Path) -> str:
    """The run's ``launcher`` key (``<run>/config.yaml``); ``local`` for a run planned before the key."""
    try:
        return (yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}).get("launcher", "local")
    except FileNotFoundError:
        return "local"


def previous_stage(run_dir: Path, i: int, stage: str) -> tuple[int, str] | None:
    """The stage that machine 0 runs just before ``stage`` of iteration ``i`` (run_loop.sh's order:
    the plan.json order within an iteration, iterations in turn); None for the run's first stage."""
    names = list(read_json(run_dir / f"iter_{i}" / "plan.json"))
    at = names.index(stage)
    if at > 0:
        return i, names[at - 1]
    for j in range(i - 1, -1, -1):
        earlier = list(read_json(run_dir / f"iter_{j}" / "plan.json"))
        if earlier:
            return j, earlier[-1]
    return None


def _last_activity(run_dir: Path) -> float:
    """Newest modification time of what machine 0's loop writes as it goes: the stages' logs and
    ``.done`` markers (0.0 when there is none yet)."""
    times = [p.stat().st_mtime for pat in ("iter_*/logs/*.log", "iter_*/*.done") for p in run_dir.glob(pat)]
    return max(times, default=0.0)


def _wait_for_previous_stage(run_dir: Path, i: int, stage: str, poll_s: float) -> None:
    """Wait until machine 0 has finished the stage before ``stage`` (:func:`previous_stage`).

    Gives up when machine 0 has written nothing in the run directory (no stage log grew, no stage
    was marked done) for ``$ONLINE_RLHF_WAIT_TIMEOUT_S`` seconds (default 3600; 0 = wait for ever):
    its loop has failed or was stopped, and this machine would poll for ever.

    Raises:
        TimeoutError: naming the stage waited for, the silence and how to go on.
    """
    prev = previous_stage(run_dir, i, stage)
    if prev is None:
        return
    timeout_s = float(os.environ.get("ONLINE_RLHF_WAIT_TIMEOUT_S", "3600"))
    t0, said = time.monotonic(), -1.0
    while not check(run_dir, *prev):
        waited = time.monotonic() - t0
        silent = time.time() - max(_last_activity(run_dir), time.time() - waited)
        if timeout_s > 0 and silent > timeout_s:
            raise TimeoutError(
                f"waited {waited:.0f} s for machine 0 to finish stage {prev[1]} of iteration {prev[0]}, and machine 0 "
                f"has written nothing in {run_dir} (no stage log, no .done) for {silent:.0f} s: its run_loop.sh has "
                "failed or was stopped (see its console and iter_*/logs/). Rerun it on machine 0, then this "
                "machine's command again (ONLINE_RLHF_WAIT_TIMEOUT_S sets this limit; 0 waits for ever).")
        if said < 0 or waited - said >= 60:
            print(f"waiting for machine 0 to finish stage {prev[1]} of iteration {prev[0]} "
                  f"({waited:.0f} s so far)", flush=True)
            said = waited
        time.sleep(poll_s)


def _marker(run_dir: Path, i: int, stage: str) -> Path:
    return run_dir / f"iter_{i}" / f"{stage}.done"


def check(run_dir: Path, i: int, stage: str) -> bool:
    """True when the stage is done and fresh (:func:`stale_reason` gives None)."""
    return stale_reason(run_dir, i, stage) is None


def _recorded_outputs(run_dir: Path, i: int, stage: str) -> list[str]:
    """The files and folders whose size and hash ``<stage>.done`` records: the stage's outputs and
    its stats file."""
    outs = _stage_entry(run_dir, i, stage)["outputs"]
    return [*outs, str(stats_path(outs[0]))] if outs else []


def stale_reason(run_dir: Path, i: int, stage: str) -> str | None:
    """Why the stage must run (one line), or None when it is done and fresh: its ``.done`` exists,
    its hash matches (config and inputs unchanged), its outputs exist (a checkpoint folder only
    counts with its weights: ``*.safetensors`` or ``pytorch_model*.bin``) and are the ones it wrote
    (size and hash as recorded in ``.done``: an output cut or edited after the stage finished makes
    it run again, instead of later stages using it silently), and its stats file reads back through
    the stage's stats class (a stage whose stats are missing or broken runs again, rather than
    stopping ``metrics`` later)."""
    e = _stage_entry(run_dir, i, stage)
    marker = _marker(run_dir, i, stage)
    if not marker.is_file():
        return "not run yet"
    if not is_done(marker, stage_hash(run_dir, i, stage)):
        return "its config or inputs changed since it finished"
    missing = [o for o in e["outputs"] if not _output_present(Path(o))]
    if missing:
        return f"its output {missing[0]} is missing"
    try:
        STAGES[stage].stats.read(stats_path(e["outputs"][0]))
    except (FileNotFoundError, DataError):
        return f"its stats file {stats_path(e['outputs'][0])} is missing or not valid"
    try:
        changed = changed_outputs(marker, _recorded_outputs(run_dir, i, stage), root=run_dir)
    except (FileNotFoundError, DataError):
        return f"its marker {marker} is not readable"
    if changed:
        return f"its output changed after the stage finished ({'; '.join(changed)})"
    return None


def output_hint(run_dir: Path, message: str) -> str | None:
    """For a stage's error ``message`` that names a line of a file another stage of the run wrote
    (``<file>:<line>``: its content is bad): which stage wrote it and how to regenerate it (the first
    such file named). None when it names none.

    A stage output that is not what its stage left (:func:`stale_reason`) is rewritten by rerunning
    the same command, since that stage then runs again; otherwise removing the file does it.
    """
    for plan_path in sorted(run_dir.glob("iter_*/plan.json"), key=lambda p: int(p.parent.name.split("_")[1])):
        i = int(plan_path.parent.name.split("_")[1])
        try:
            entries = read_json(plan_path)
        except (FileNotFoundError, DataError):
            continue
        for stage, e in entries.items():
            for o in e.get("outputs", []):
                if o and re.search(re.escape(o) + r":\d+", message):  # names a line of it: its content is bad
                    why = stale_reason(run_dir, i, stage)
                    how = (f"rerun the same command: stage {stage} runs again first ({why}) and rewrites it"
                           if why is not None else f"remove it (rm -r {shlex.quote(o)}) and rerun the same command: "
                           f"stage {stage} runs again and rewrites it")
                    return f"{o} is the output of stage {stage} of iteration {i}; do not edit it by hand: {how}."
    return None


def _output_present(path: Path) -> bool:
    if not path.exists():
        return False
    if path.is_dir() and (path / "config.json").is_file():
        return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return True


def mark(run_dir: Path, i: int, stage: str, seconds: float) -> None:
    """Write the stage's ``.done``: its config-and-inputs hash, the size and hash of its outputs and
    stats file as they are now (:func:`stale_reason` compares them on the next run), the seconds. A
    stage of the evaluation cache (``online_rlhf.eval_cache``) also stores its output there."""
    mark_done(_marker(run_dir, i, stage), stage_hash(run_dir, i, stage), outputs=_recorded_outputs(run_dir, i, stage),
              root=run_dir, seconds=round(seconds, 2))
    e = _stage_entry(run_dir, i, stage)
    key = _eval_cache_key(run_dir, i, stage, e, yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8")))
    if key:
        from . import eval_cache

        out = Path(e["outputs"][0])
        eval_cache.store(key, out, stats_path(out), run_dir)


# The stages the loop's dry run checks, in order: (iteration, stage), the table's rows with a dry_run_iteration.
DRY_RUN_STAGES = tuple((s.dry_run_iteration, s.name) for s in STAGES.values() if s.dry_run_iteration is not None)


def dry_run(run_dir: Path) -> int:
    """The loop's dry run (``bash run_loop.sh ... dry_run=true``, after the plan): run each stage of
    :data:`DRY_RUN_STAGES` that the plan holds (``dpo`` or ``grpo``, as ``algorithm`` says) once with ``dry_run=true`` (``loop exec RUN_DIR I STAGE
    dry_run=true``, the stage's own command; log ``iter_<i>/logs/<stage>.dry_run.log``), read what
    each measured (:class:`~online_rlhf.stats.DryRunStats`) and print the table and advice of
    :func:`online_rlhf.dry_run.report`; also written to ``<run>/dry_run.json``.

    Pairs and verifier/remote/judge rewards load no model and are skipped. When SFT is enabled, the
    later stages' policy (the SFT model) does not exist yet: they are measured on the SFT base model
    (same architecture). Nothing is trained or marked done; stages' outputs are not written.

    Returns:
        the exit code: 0 when every measured stage fits, 1 when one would not (or its dry run failed).
    """
    import subprocess

    from .dry_run import Row, dry_run_path, report

    rows: list[Row] = []
    sft_base = None
    for i, stage in DRY_RUN_STAGES:
        plan_path = run_dir / f"iter_{i}" / "plan.json"
        entries = read_json(plan_path) if plan_path.is_file() else {}
        if stage not in entries:
            continue
        e = entries[stage]
        d = yaml.safe_load(Path(e["config"]).read_text(encoding="utf-8"))
        if stage == "sft":
            sft_base = d.get("base_model")
        if stage == "rewards" and d.get("source") != "reward_model":
            rows.append(Row(stage, i, note=f"source={d.get('source')} loads no model"))
            continue
        extra, note = ["dry_run=true"], ""
        if sft_base is not None and stage in ("generate", "dpo", "grpo"):  # the SFT model is not trained yet
            extra += [f"model={sft_base}"] if stage == "generate" else [f"policy={sft_base}"]
            if stage in ("dpo", "grpo") and d.get("reference"):
                extra.append(f"reference={sft_base}")
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


def mean_ci95(xs: list[float]) -> tuple[float, float, float]:
    """Mean and normal-approximation 95% interval (mean ± 1.96·s/√n); (nan, nan, nan) when empty."""
    if not xs:
        return (math.nan, math.nan, math.nan)
    m = statistics.fmean(xs)
    half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return (m, m - half, m + half)


# The stats files of an iteration folder: name -> class. Iteration 0 only evaluates (no train stages).
def iteration_stats(it: Path, i: int) -> dict[str, StageStats]:
    """Every stage's stats of iteration folder ``it`` (iteration ``i``), read through the classes of
    the stage table: ``{name of the stage's first output: stats}`` for the stages of the iteration's
    ``plan.json`` (iteration 0: the held-out evaluation, and no SFT stats here).

    Raises:
        FileNotFoundError: a stage's stats file is missing (its stage has not run).
        DataError: a stats file is not what its stage writes (names the file and the key).
    """
    entries = read_json(it / "plan.json")
    return {Path(e["outputs"][0]).name: STAGES[name].stats.read(stats_path(e["outputs"][0]))
            for name, e in entries.items() if name != "sft"}


def metrics(run_dir: Path, i: int) -> dict:
    """Write (or replace) iteration ``i``'s row of ``metrics.jsonl`` and ``iter_<i>/stats.json``
    (every stage's stats of the iteration); return the row.

    Unscored responses (``null`` rewards) are left out of the held-out means and counted
    (``eval_unscored_responses``). ``warnings`` lists what the loop prints after the row, e.g. most
    train prompts with fewer than 2 distinct responses (``train_prompts_fewer_than_2_distinct``).

    Raises:
        FileNotFoundError: ``eval.jsonl`` or a stage's stats file is missing (for ``i >= 1`` the
            train stages' too: generated, rewards, pairs, model).
        DataError: a stats file is not what its stage writes (names the file and the key).
    """
    it = run_dir / f"iter_{i}"
    evals = read_jsonl(it / "eval.jsonl")
    stats = iteration_stats(it, i)
    firsts = [r["rewards"][0] for r in evals]  # held-out: first (greedy) response
    rewards = [float(x) for x in firsts if x is not None]
    all_rewards = [float(x) for r in evals for x in r["rewards"] if x is not None]
    m, lo, hi = mean_ci95(all_rewards if len(all_rewards) > len(rewards) else rewards)
    row: dict[str, Any] = {
        "iteration": i, "eval_reward_mean": m, "eval_reward_ci95": [lo, hi], "eval_prompts": len(evals),
        "eval_mean_response_tokens": _mean([t for r in evals for t in r.get("response_tokens", [])]),
        "eval_truncation_rate": _rate([f for r in evals for f in r["finish_reasons"]]),
        "eval_unscored": stats["eval_generated.jsonl"].prompts_in - len(evals),
        "eval_unscored_responses": sum(x is None for r in evals for x in r["rewards"]),
        "warnings": [],
    }
    if i >= 1:
        row.update(_train_metrics(it, i, stats))
    quality = _eval_quality(run_dir, i, evals, stats)
    row["warnings"] = [*row["warnings"], *quality.pop("warnings")]
    row.update(quality)
    # One stats.json per iteration: every stage's counts.
    write_json(it / "stats.json", {name: st.model_dump(mode="json") for name, st in stats.items()})
    # Markers exist only for stages that ran (no train stages in iteration 0).
    row["stage_seconds"] = {s: read_json(_marker(run_dir, i, s)).get("seconds") for s in STAGES
                            if _marker(run_dir, i, s).exists()}
    row["hardware"] = _hardware(stats)
    rows = [r for r in (read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else [])
            if r["iteration"] != i]
    rows = sorted([*rows, row], key=lambda r: r["iteration"])
    _refit_length_control(run_dir, rows)
    write_jsonl(run_dir / "metrics.jsonl", rows)
    return row


def _first_answers(evals: list[dict]) -> dict[str, tuple[float, int]]:
    """``{prompt id: (reward, response tokens)}`` of the first (greedy) held-out answer, scored ones only."""
    return {str(r["id"]): (float(r["rewards"][0]), int((r.get("response_tokens") or [1])[0]))
            for r in evals if r["rewards"] and r["rewards"][0] is not None}


def _eval_quality(run_dir: Path, i: int, evals: list[dict], stats: dict[str, StageStats]) -> dict:
    """Iteration ``i``'s evaluation columns beyond the held-out mean (``online_rlhf.evaluation``):

    - ``eval_median_response_tokens``, ``eval_distinct_1`` / ``eval_distinct_2`` (greedy answers);
    - ``eval_reward_vs_0``: paired bootstrap of the held-out reward against iteration 0, over the
      prompts scored in both (``{diff, ci95, p_value, n, ...}``; None at iteration 0);
    - ``ifeval``: IFEval's four numbers (when ifeval_score ran); ``ifeval_vs_0``: McNemar on
      prompt-level strict pass/fail against iteration 0, plus the difference of that accuracy;
    - ``kl``: KL(policy || starting policy) in nats (``{kl_mean, kl_se, samples}``; 0 at iteration 0
      by construction), with a warning above the run's ``kl_warn``.
    The length-controlled columns are added by :func:`_refit_length_control`.
    """
    from .evaluation import distinct_n, mcnemar_exact, paired_bootstrap

    firsts = [r["responses"][0] for r in evals if r["responses"]]
    tokens = [int(r["response_tokens"][0]) for r in evals if r.get("response_tokens")]
    out: dict[str, Any] = {"eval_median_response_tokens": statistics.median(tokens) if tokens else None,
                           "eval_distinct_1": _round(distinct_n(firsts, 1)), "eval_distinct_2": _round(distinct_n(firsts, 2)),
                           "eval_reward_vs_0": None, "ifeval": None, "ifeval_vs_0": None, "kl": None, "warnings": []}
    base_file = run_dir / "iter_0" / "eval.jsonl"
    if i >= 1 and base_file.is_file():
        base, now = _first_answers(read_jsonl(base_file)), _first_answers(evals)
        common = sorted(set(base) & set(now))
        if common:
            out["eval_reward_vs_0"] = paired_bootstrap([base[k][0] for k in common], [now[k][0] for k in common])
    if "ifeval.jsonl" in stats:
        st = stats["ifeval.jsonl"]
        out["ifeval"] = {k: getattr(st, k) for k in ("prompt_strict", "prompt_loose", "instruction_strict",
                                                     "instruction_loose", "records_scored", "truncation_rate")}
        length = (st.groups or {}).get("length_constraints")
        out["ifeval"]["length_constraints_strict"] = length["strict"] if length else None
        base_file = run_dir / "iter_0" / "ifeval.jsonl"
        if i >= 1 and base_file.is_file():
            base = {str(r["id"]): r["prompt_strict"] for r in read_jsonl(base_file)}
            now = {str(r["id"]): r["prompt_strict"] for r in read_jsonl(run_dir / f"iter_{i}" / "ifeval.jsonl")}
            common = sorted(set(base) & set(now))
            if common:
                test = mcnemar_exact([base[k] for k in common], [now[k] for k in common])
                test["prompt_strict_diff"] = (sum(now[k] for k in common) - sum(base[k] for k in common)) / len(common)
                out["ifeval_vs_0"] = test
    if i == 0:
        out["kl"] = {"kl_mean": 0.0, "kl_se": 0.0, "samples": 0}  # the starting policy is the reference
    elif "kl.jsonl" in stats:
        st = stats["kl.jsonl"]
        out["kl"] = {"kl_mean": st.kl_mean, "kl_se": st.kl_se, "samples": st.samples}
        warn = _run_config(run_dir).get("kl_warn")
        if warn is not None and st.kl_mean is not None and st.kl_mean > warn:
            out["warnings"].append(f"iteration {i}: KL(policy || starting policy) = {st.kl_mean:.2f} nats per response "
                                   f"exceeds kl_warn={warn}: the policy has drifted far from where it started; check "
                                   "the held-out answers (length, repetition) before trusting the reward gain.")
    return out


def _refit_length_control(run_dir: Path, rows: list[dict]) -> None:
    """Set ``eval_reward_lc`` (length-controlled held-out reward) and ``eval_reward_lc_vs_0`` (its
    paired bootstrap against iteration 0) in every row, from one fit over the greedy held-out
    answers of every iteration in ``rows`` (``online_rlhf.evaluation.length_controlled``), so that
    all rows share the same fit. Rows without iteration 0's answers get None."""
    from .evaluation import length_controlled, paired_bootstrap

    answers = {r["iteration"]: _first_answers(read_jsonl(run_dir / f"iter_{r['iteration']}" / "eval.jsonl"))
               for r in rows if (run_dir / f"iter_{r['iteration']}" / "eval.jsonl").is_file()}
    answers = {i: a for i, a in answers.items() if a}
    for r in rows:
        r["eval_reward_lc"], r["eval_reward_lc_vs_0"] = None, None
    if 0 not in answers:
        return
    keys = {i: sorted(a) for i, a in answers.items()}
    lc = length_controlled({i: ([answers[i][k][0] for k in keys[i]], [answers[i][k][1] for k in keys[i]])
                            for i in answers})
    residual = {i: dict(zip(keys[i], lc["residuals"][i].tolist())) for i in answers}
    for r in rows:
        i = r["iteration"]
        if i not in answers:
            continue
        r["eval_reward_lc"] = lc["lc_mean"][i]
        r["eval_length_slope"] = lc["slope_per_log_token"]
        common = sorted(set(residual[0]) & set(residual[i]))
        if i >= 1 and common:
            r["eval_reward_lc_vs_0"] = paired_bootstrap([residual[0][k] for k in common], [residual[i][k] for k in common])


def _run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _hardware(stats: dict[str, StageStats]) -> dict:
    """``{stage output: {device, dtype, threads, processes, cpu_model, cpu_capability, cpu_native_bf16}}``
    for the stages of one iteration (:func:`iteration_stats`) that recorded what they ran on
    (pairs record nothing; a verifier, remote or judge reward source ran no model here)."""
    out = {}
    for name, st in stats.items():
        hw = getattr(st, "hardware", None)
        if hw:
            out[name.split(".")[0]] = hw
    return out


def _hardware_lines(rows: list[dict]) -> list[str]:
    """Report lines: the CPU once, then each stage's device, dtype and threads (last iteration's)."""
    seen = {}
    for r in rows:
        seen.update(r.get("hardware") or {})
    if not seen:
        return []
    first = next(iter(seen.values()))
    lines = ["", f"Hardware: {first.get('cpu_model')} (torch capability {first.get('cpu_capability')}, "
                 f"native bf16: {'yes' if first.get('cpu_native_bf16') else 'no'}).", ""]
    lines += [f"- {stage}: {hw.get('device')} {hw.get('dtype')}, "
              f"{str(hw['processes']) + ' processes x ' if hw.get('processes', 1) > 1 else ''}{hw.get('threads')} thread(s)"
              for stage, hw in seen.items()]
    return lines


def _train_metrics(it: Path, i: int, stats: dict[str, StageStats]) -> dict:
    """The train-side columns of iteration ``i``'s metrics row (generation, rewards, pairs, DPO),
    from the generated records, the pairs file and the stages' stats (:func:`iteration_stats`)."""
    from .pairs import distinct_texts, low_diversity_warning

    gen = read_jsonl(it / "generated.jsonl")
    rewards_stats: RewardStats = stats["rewards.jsonl"]
    sampled = [r for r in gen if len(r.get("responses", [])) >= 2]
    low = sum(distinct_texts(r["responses"]) < 2 for r in sampled)
    warning = low_diversity_warning(len(sampled), low, f"iteration {i}, generated.jsonl")
    if isinstance(stats["model"], GRPOStats):
        return {"train_prompts": len(gen), "rollout_reward_mean": rewards_stats.reward.mean,
                "train_truncation_rate": _rate([f for r in gen for f in r["finish_reasons"]]),
                "train_prompts_fewer_than_2_distinct": low, "grpo": grpo_metrics(stats["model"]),
                "warnings": [warning] if warning else []}
    pairs_stats: PairsStats = stats["pairs.jsonl"]
    dpo: DPOStats = stats["model"]
    return {
        "train_prompts": len(gen),
        # mean reward of this iteration's K rollouts per train prompt (sampled from the policy of
        # iteration i-1, on prompts it has not trained on): the on-policy reward, before DPO.
        "rollout_reward_mean": rewards_stats.reward.mean,
        "train_truncation_rate": _rate([f for r in gen for f in r["finish_reasons"]]),
        "train_prompts_fewer_than_2_distinct": low,
        "pairs": sum(1 for _ in open(it / "pairs.jsonl", encoding="utf-8")),
        "pairs_skipped": pairs_stats.skipped,
        "dpo": {"train_loss_first": dpo.train_loss_first, "train_loss_last": dpo.train_loss_last,
                "rewards_accuracies_last": dpo.rewards_accuracies_last, "steps": dpo.steps},
        "warnings": [warning] if warning else [],
    }


def grpo_metrics(g: GRPOStats) -> dict:
    """The GRPO columns of a metrics row: loss, KL, clip fraction, groups used and skipped, steps, seconds."""
    return {"loss_first": g.loss_first, "loss_last": g.loss_last, "kl_last": g.kl_last,
            "clip_fraction_mean": g.clip_fraction_mean, "reward_mean": g.reward_mean, "groups_used": g.groups_used,
            "groups_skipped": g.groups_skipped, "steps": g.steps, "seconds": g.seconds.total}


def _grpo_lines(rows: list[dict]) -> list[str]:
    """Report lines of the GRPO iterations (none for DPO runs)."""
    lines = []
    for r in rows:
        g = r.get("grpo")
        if g:
            skipped = ", ".join(f"{k} {v}" for k, v in g["groups_skipped"].items()) or "none"
            kl = "" if g["kl_last"] is None else f", KL {g['kl_last']:.4f}"
            loss = "no step" if g["loss_first"] is None else f"loss {g['loss_first']:.4f} -> {g['loss_last']:.4f}"
            lines.append(f"- iteration {r['iteration']}: {g['groups_used']} groups used (skipped: {skipped}), "
                         f"{g['steps']} steps, {loss}{kl}, clip fraction {g['clip_fraction_mean'] or 0:.3f}")
    return ["", "GRPO per iteration:", "", *lines] if lines else []


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 2) if xs else None


def _rate(reasons: list[str]) -> float | None:
    return round(sum(r == "length" for r in reasons) / len(reasons), 4) if reasons else None


def report(run_dir: Path) -> Path:
    """Write ``report.md`` (a table per iteration) and ``report.png`` (held-out reward with 95%
    intervals; stage seconds per iteration); log the rows to wandb when the config asks."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    lines = [f"# Run `{run_dir.name}`", "",
             f"Policy `{cfg['policy']}`, reward `{cfg['reward'].get('source', 'verifier')}`, "
             f"{cfg['iterations']} iteration{'s' * (cfg['iterations'] != 1)}, reference `{cfg['ref_model']}`.", "",
             "| iteration | held-out reward (95% CI) | n | rollout reward | pairs | train trunc. | eval tokens | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["eval_reward_ci95"]
        secs = sum(v for v in r["stage_seconds"].values() if v)
        rollout = r.get("rollout_reward_mean")
        lines.append(f"| {r['iteration']} | {r['eval_reward_mean']:.4f} ({lo:.4f}–{hi:.4f}) | {r['eval_prompts']} | "
                     f"{'–' if rollout is None else f'{rollout:.4f}'} | {r.get('pairs', '–')} | {r.get('train_truncation_rate', '–')} | "
                     f"{r['eval_mean_response_tokens']} | {secs:.0f} |")
    lines += ["", f"Held-out: greedy responses to the eval prompts after the iteration's {cfg.get('algorithm', 'dpo').upper()}. Rollout: mean reward "
              "of the iteration's K samples per train prompt, drawn from the previous iteration's policy."]
    lines += _quality_lines(rows, cfg)
    lines += ["", "Stage seconds per iteration:", ""]
    for r in rows:
        lines.append(f"- iteration {r['iteration']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items() if v))
    lines += _grpo_lines(rows)
    lines += _hardware_lines(rows)
    lines += ["", "![report](report.png)", ""]
    with atomic_open(run_dir / "report.md") as f:
        f.write("\n".join(lines))
    _plot(rows, run_dir / "report.png")
    if cfg.get("wandb"):
        _log_wandb(rows, run_dir, cfg)
    return run_dir / "report.md"


def metrics_line(row: dict) -> str:
    """The loop's live line after an iteration's ``metrics`` (one row of ``metrics.jsonl``): held-out
    reward, rollout reward, what the update trained on (DPO: pairs; GRPO: groups used of all, the
    skipped ones by reason; iteration 0: nothing), then :func:`_quality_summary`."""
    lo, hi = row["eval_reward_ci95"]
    parts = [f"iteration {row['iteration']}: held-out reward {row['eval_reward_mean']:.4f} "
             f"(95% CI {lo:.4f}..{hi:.4f}, n={row['eval_prompts']})"]
    if row.get("rollout_reward_mean") is not None:
        parts.append(f"rollout reward {row['rollout_reward_mean']:.4f}")
    g = row.get("grpo")
    if g:
        skipped = g.get("groups_skipped") or {}
        total = g["groups_used"] + sum(skipped.values())
        parts.append(f"grpo groups used {g['groups_used']}/{total}"
                     + (f" (skipped: {', '.join(f'{k} {v}' for k, v in skipped.items())})" if skipped else "")
                     + f", {g['steps']} steps")
    elif "pairs" in row:
        parts.append(f"pairs {row['pairs']}")
    return ", ".join(parts) + _quality_summary(row)


def _quality_summary(row: dict) -> str:
    """The evaluation part of the loop's live ``metrics`` line (empty parts left out)."""
    parts = []
    t = row.get("eval_reward_vs_0")
    if t:
        parts.append(f"vs iteration 0 {t['diff']:+.4f} (95% CI {t['ci95'][0]:+.4f}..{t['ci95'][1]:+.4f}, {_p(t)})")
    if row.get("eval_median_response_tokens") is not None:
        parts.append(f"median tokens {row['eval_median_response_tokens']}")
    kl, kl_se = (row.get("kl") or {}).get("kl_mean"), (row.get("kl") or {}).get("kl_se")
    if kl is not None and row["iteration"] >= 1:  # k1 estimate: unbiased, can be negative on few samples
        parts.append(f"KL {kl:.3f} nats" + (f" (se {kl_se:.3f})" if kl_se is not None else ""))
    f = row.get("ifeval")
    if f and f.get("prompt_strict") is not None:
        parts.append(f"IFEval prompt/instruction strict {100 * f['prompt_strict']:.1f}/{100 * f['instruction_strict']:.1f}"
                     + ("" if f.get("length_constraints_strict") is None
                        else f" (length_constraints {100 * f['length_constraints_strict']:.1f})"))
    return "".join(", " + p for p in parts)


def _fmt(x: Any, nd: int = 4, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"


def _paired_cell(t: dict | None) -> str:
    """``+0.0312 (−0.0100–+0.0700), p=0.14`` for a paired test result; – when there is none."""
    if not t:
        return "–"
    lo, hi = t["ci95"]
    return f"{_fmt(t['diff'], signed=True)} ({_fmt(lo, signed=True)}–{_fmt(hi, signed=True)}), {_p(t)}"


def _p(t: dict) -> str:
    """A bootstrap p-value; 0 resamples on the other side of 0 reads p < 1/resamples."""
    return f"p<{1 / t['resamples']:.0e}" if t["p_value"] == 0 else f"p={t['p_value']:.3g}"


def _quality_lines(rows: list[dict], cfg: dict) -> list[str]:
    """The report's tables of paired comparisons with iteration 0, length and drift, and IFEval."""
    lines = ["", "## Against iteration 0 (paired), length and drift", "",
             "| iteration | Δ held-out reward (95% CI), p | LC reward | Δ LC reward (95% CI), p | tokens mean / median | "
             "trunc. | distinct-1 / -2 | KL nats (se) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = r.get("kl") or {}
        lines.append(f"| {r['iteration']} | {_paired_cell(r.get('eval_reward_vs_0'))} | {_fmt(r.get('eval_reward_lc'))} | "
                     f"{_paired_cell(r.get('eval_reward_lc_vs_0'))} | {r.get('eval_mean_response_tokens')} / "
                     f"{r.get('eval_median_response_tokens', '–')} | {r.get('eval_truncation_rate')} | "
                     f"{_fmt(r.get('eval_distinct_1'), 3)} / {_fmt(r.get('eval_distinct_2'), 3)} | "
                     f"{_fmt(kl.get('kl_mean'), 3)} ({_fmt(kl.get('kl_se'), 3)}) |")
    slope = next((r.get("eval_length_slope") for r in rows if r.get("eval_length_slope") is not None), None)
    lines += ["", "Δ: paired bootstrap over the held-out prompts scored in both iterations (10,000 resamples, seed 0; "
              "95% percentile interval, two-sided p). LC reward: length-controlled, the mean residual of one OLS fit "
              f"reward = a + b·log(response tokens) over every iteration's greedy held-out answers (b = {_fmt(slope)}) "
              "plus iteration 0's mean (after AlpacaEval's length-controlled win rate, Dubois et al. 2024, "
              "arXiv 2404.04475). KL: mean over responses sampled from the iteration's policy (temperature 1) of "
              "log p_policy − log p_start, summed over response tokens (0 at iteration 0 by construction)."]
    if any(r.get("ifeval") for r in rows):
        lines += ["", "## IFEval", "",
                  "| iteration | prompts | prompt strict | prompt loose | instruction strict | instruction loose | "
                  "length_constraints strict | Δ prompt strict vs 0 (McNemar p) | trunc. |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            f = r.get("ifeval")
            if not f:
                continue
            t = r.get("ifeval_vs_0")
            vs = f"{100 * t['prompt_strict_diff']:+.1f} (p={t['p_value']:.3g}; {t['new_only']} gained, {t['base_only']} lost)" if t else "–"
            pct = {k: "–" if f.get(k) is None else f"{100 * f[k]:.1f}" for k in
                   ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose", "length_constraints_strict")}
            lines.append(f"| {r['iteration']} | {f['records_scored']} | {pct['prompt_strict']} | {pct['prompt_loose']} | "
                         f"{pct['instruction_strict']} | {pct['instruction_loose']} | {pct['length_constraints_strict']} | "
                         f"{vs} | {f.get('truncation_rate')} |")
        ifeval = cfg.get("ifeval") or {}
        lines += ["", f"IFEval (Zhou et al. 2023): greedy answers, max_tokens {ifeval.get('max_tokens')}, "
                  f"{'all prompts' if not ifeval.get('limit') else 'the first %s prompts' % ifeval.get('limit')}, scored "
                  "with the if-verifiable checkers; percentages. McNemar: exact test on prompt-level strict pass/fail."]
    warned = [w for r in rows for w in r.get("warnings", []) if "kl_warn" in w]
    if warned:
        lines += ["", "**Warnings**", "", *[f"- {w}" for w in warned]]
    return lines


def _plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in rows]
    means = [r["eval_reward_mean"] for r in rows]
    err = [[m - r["eval_reward_ci95"][0] for m, r in zip(means, rows)],
           [r["eval_reward_ci95"][1] - m for m, r in zip(means, rows)]]
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(16, 4))
    a.errorbar(its, means, yerr=err, marker="o", capsize=4)
    a.set_xticks(its)
    a.set_xlabel("iteration (0 = starting policy)")
    a.set_ylabel("held-out reward (mean, 95% CI)")
    a.set_title("Held-out reward per iteration")
    for key, label, shift in (("eval_reward_vs_0", "held-out reward", -0.05), ("eval_reward_lc_vs_0", "length-controlled", 0.05)):
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key)]
        if pts:
            c.errorbar([i + shift for i, _ in pts], [t["diff"] for _, t in pts], capsize=4, marker="o", label=label,
                       yerr=[[t["diff"] - t["ci95"][0] for _, t in pts], [t["ci95"][1] - t["diff"] for _, t in pts]])
    c.axhline(0.0, color="grey", lw=0.8)
    c.set_xticks(its)
    c.set_xlabel("iteration")
    c.set_ylabel("difference vs iteration 0 (paired 95% CI)")
    c.set_title("Paired change vs the starting policy")
    if any(r.get("eval_reward_vs_0") for r in rows):
        c.legend(fontsize=8)
    stages = [s for s in STAGES if any(r["stage_seconds"].get(s) for r in rows)]
    bottom = [0.0] * len(rows)
    for s in stages:
        vals = [r["stage_seconds"].get(s) or 0.0 for r in rows]
        b.bar(its, vals, bottom=bottom, label=s)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_xticks(its)
    b.set_xlabel("iteration")
    b.set_ylabel("seconds")
    b.set_title("Stage wall time")
    if stages:
        b.legend(fontsize=8)
    fig.tight_layout()
    with atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def _log_wandb(rows: list[dict], run_dir: Path, cfg: dict) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    import wandb

    run = wandb.init(project="online-rlhf", name=run_dir.name, id=f"loop-{run_dir.name}", resume="allow",
                     config=cfg, dir=str(run_dir))
    for r in rows:
        rollout = {"train/rollout_reward_mean": r["rollout_reward_mean"]} if r.get("rollout_reward_mean") is not None else {}
        grpo = {f"train/grpo_{k}": v for k, v in (r.get("grpo") or {}).items() if isinstance(v, (int, float))}
        quality = {f"eval/{k}": v for k, v in (("reward_lc", r.get("eval_reward_lc")),
                                                   ("kl", (r.get("kl") or {}).get("kl_mean")),
                                                   ("ifeval_prompt_strict", (r.get("ifeval") or {}).get("prompt_strict")))
                   if v is not None}
        run.log({"eval/reward_mean": r["eval_reward_mean"], "train/pairs": r.get("pairs", 0), **rollout, **grpo, **quality,
                 **{f"time/{k}": v for k, v in r["stage_seconds"].items() if v}}, step=r["iteration"])
    run.finish()


def main(argv: list[str]) -> int:
    setup_cache_env()
    if not argv:
        print(__doc__)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Loop config keys (configs/loop.yaml, or key=value after `bash run_loop.sh [CONFIG]`):")
        print("\n".join(LoopConfig._field_lines("  ")))
        return 0
    cmd, args = argv[0], argv[1:]
    try:
        if cmd in ("plan", "plan-check", "run-dir"):
            cfg_path = args[0] if args and "=" not in args[0] else None
            overrides = args[1:] if cfg_path else args
            if cmd in ("plan", "plan-check"):  # plan-check: every check of the plan, nothing written
                with _stdout_to_stderr() as real_stdout:
                    plan(cfg_path, overrides, write=cmd == "plan", shell_out=real_stdout)
            else:  # where the run lives, nothing written (run_loop.sh locks it before any change)
                cfg = resolve(cfg_path, overrides)
                print((Path(cfg.output_root) / cfg.run_name).resolve())
        elif cmd == "fresh-check":  # 0: run_loop.sh --fresh may empty RUN_DIR; 2: it must not (says why)
            reason = fresh_refusal(Path(args[0]))
            if reason:
                print(f"run_loop.sh: {reason}", file=sys.stderr)
                return 2
        elif cmd == "pairs-check":  # 0: go on; 1: the iteration made 0 pairs (prints why and what to change)
            line = no_pairs_stop(Path(args[0]), int(args[1]))
            if line:
                print(line)
                return 1
        elif cmd == "stages":  # the iteration's stages in the stage table's order, "<name> after" for a row with a hook
            for name in read_json(Path(args[0]) / f"iter_{int(args[1])}" / "plan.json"):
                print(name + (" after" if STAGES[name].after is not None else ""))
        elif cmd == "after":  # 0: go on; 1: the stage's row says stop (prints why), e.g. pairs made 0 pairs
            hook = STAGES[args[2]].after
            line = hook(Path(args[0]), int(args[1])) if hook is not None else None
            if line:
                print(line)
                return 1
        elif cmd == "check":  # 0 done and fresh, 1 to run (prints the stage's env, then why), 3 not in the plan
            entries = read_json(Path(args[0]) / f"iter_{int(args[1])}" / "plan.json")
            if args[2] not in entries:
                return 3
            why = stale_reason(Path(args[0]), int(args[1]), args[2])
            if why is None:
                return 0
            print(entries[args[2]]["env"])
            print(why)
            return 1
        elif cmd == "exec":  # exec RUN_DIR ITER STAGE [machine_rank=R] [key=value ...]
            ranks = [a.split("=", 1)[1] for a in args[3:] if a.startswith("machine_rank=")]
            try:
                rank = int(ranks[-1]) if ranks else 0
            except ValueError:
                raise ConfigError(f"exec: machine_rank={ranks[-1]!r} is not an integer.") from None
            exec_stage(Path(args[0]), int(args[1]), args[2], [a for a in args[3:] if not a.startswith("machine_rank=")],
                       machine_rank=rank)
        elif cmd == "dry-run":
            return dry_run(Path(args[0]))
        elif cmd == "output-hint":  # output-hint RUN_DIR MESSAGE: which stage wrote a file the message names
            line = output_hint(Path(args[0]), " ".join(args[1:]))
            if line:
                print(line)
        elif cmd == "mark":
            mark(Path(args[0]), int(args[1]), args[2], float(args[3]))
        elif cmd == "metrics":
            row = metrics(Path(args[0]), int(args[1]))
            print(metrics_line(row))
            for w in row["warnings"]:
                print(f"WARNING: {w}")
        elif cmd == "report":
            print(report(Path(args[0])))
        else:
            print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
            return 2
    except (ConfigError, DataError, FileNotFoundError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
