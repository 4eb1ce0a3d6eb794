"""The loop's bookkeeping, called by run_loop.sh (training env):

    python -m online_rlhf.loop plan CONFIG [key=value ...]   # resolve + validate, write stage configs
    python -m online_rlhf.loop check RUN_DIR ITER STAGE       # exit 0 if STAGE is done and fresh
    python -m online_rlhf.loop mark RUN_DIR ITER STAGE SECONDS
    python -m online_rlhf.loop metrics RUN_DIR ITER           # one row of metrics.jsonl
    python -m online_rlhf.loop report RUN_DIR                 # report.md + report.png (+ wandb)

``plan`` writes ``runs/<name>/config.yaml`` (the resolved loop config) and, per iteration,
``iter_<i>/configs/<stage>.yaml`` plus ``iter_<i>/plan.json`` naming each stage's config, inputs
and outputs. A stage's freshness hash covers its config file and its inputs, so a changed config
or a re-made input reruns that stage and, through its outputs, every stage after it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError, apply_overrides, deep_merge, load_yaml
from .jsonl import DataError, read_json, read_jsonl, write_json, write_jsonl, atomic_open
from .paths import PROJECT_ROOT, default_data_dir, default_model_dir, resolve_model, setup_cache_env
from .rundir import fingerprint, is_done, mark_done
from .stage_configs import DPOStageConfig, GenerateConfig, LoopConfig, PairsConfig, RewardConfig, SFTStageConfig
from .stats import DPOStats, GenerateStats, PairsStats, RewardStats, StageStats, stats_path
from .loop_keys import check_loop_keys
from .trl_args import check_axolotl_keys, check_dpo_training, check_lora, per_device_batch

# First line of <run>/config.yaml; run_loop.sh --fresh only clears a folder whose config.yaml has it.
RUN_CONFIG_HEADER = "# online_rlhf run config, resolved from"

# Stage name -> (env, config class). The order is the order of one iteration.
STAGES = {
    "generate": ("infer", GenerateConfig),
    "rewards": ("train", RewardConfig),
    "pairs": ("train", PairsConfig),
    "dpo": ("train", DPOStageConfig),
    "eval_generate": ("infer", GenerateConfig),
    "eval_rewards": ("train", RewardConfig),
}
# Keys of the loop config whose values are fixed per run, not per iteration.
_RUN_LEVEL = ("run_name", "output_root", "iterations", "policy", "sft", "per_iteration", "wandb")


def _prompt_source(name: str, split: str) -> str:
    if name == "default":
        return str(default_data_dir() / f"ifbench_{split}.jsonl")
    return name


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
    cfg = LoopConfig.from_dict(data, src)
    for i in cfg.per_iteration:
        if not 1 <= i <= cfg.iterations:
            raise ConfigError(f"{src}: per_iteration has iteration {i}, but iterations={cfg.iterations}.")
    check_loop_keys(data, src, _RUN_LEVEL)  # every section key, named as written, before any stage check
    if cfg.policy != "default":  # the default is prepared by run_loop.sh before the plan runs
        try:
            resolve_model(cfg.policy)
        except FileNotFoundError:
            raise ConfigError(f"{src}: policy={cfg.policy}: no such directory. Give a checkpoint folder, an HF Hub id "
                              "(owner/name) or 'default'.") from None
    if cfg.sft.get("enabled"):  # the stage file's Axolotl keys too (the loop's own are checked above)
        sft = SFTStageConfig.from_dict(sft_dict(cfg, Path("/dry-run")), f"{src}, stage sft")
        check_axolotl_keys(sft.model_extra or {}, prefix=f"{cfg.sft.get('config', 'configs/sft.yaml')}: ",
                           also_known=set(SFTStageConfig.model_fields))
    # Dry validation: build every stage config of every iteration without touching models.
    dpo_dicts: dict[int, dict] = {}  # iteration -> resolved DPO stage dict (batch split checked below)
    for i in range(0, cfg.iterations + 1):
        for stage, (_, cls) in STAGES.items():
            if i == 0 and not stage.startswith("eval"):
                continue
            d = stage_dict(cfg, Path("/dry-run"), i, stage)
            stage_cfg = cls.from_dict(d, f"{src}, iteration {i}, stage {stage}")
            if stage == "generate" and stage_cfg.k < 2:
                raise ConfigError(f"{src}, iteration {i}: generation.k={stage_cfg.k}, but a chosen/rejected pair needs "
                                  "at least 2 responses per train prompt; set generation.k >= 2 (4-8 is usual).")
            if stage == "dpo":  # the merged section: also the keys of the dpo_config file
                check_dpo_training(d["training"], f"{src}, iteration {i}: dpo.training")
                check_lora(d.get("lora"), f"{src}, iteration {i}: dpo.lora", required=False)
                dpo_dicts[i] = d
    for section in ("generation", "evaluation"):
        if getattr(cfg, section).get("dtype") == "bfloat16" and cfg.launch_profile == "cpu":
            from .hardware import compute_dtype

            compute_dtype("cpu", "bfloat16")  # one-line warning where the CPU has no native bf16
    if cfg.num_processes == "auto":
        cfg.num_processes = auto_processes(cfg.launch_profile, [_dpo_batch(d) for d in dpo_dicts.values()])
    for i, d in dpo_dicts.items():
        try:
            per_device_batch(d.get("train_batch_size"), d.get("training", {}), cfg.num_processes, where="dpo.",
                             processes_key="num_processes")
        except ConfigError as e:
            raise ConfigError(f"{src}, iteration {i}: {e}") from None
    return cfg


def _dpo_batch(d: dict) -> tuple[int | None, int]:
    """(train_batch_size, gradient_accumulation_steps) of a resolved DPO stage dict."""
    return d.get("train_batch_size"), int(d.get("training", {}).get("gradient_accumulation_steps", 1))


def auto_processes(launch_profile: str, dpo_batches: list[tuple[int | None, int]], free: int | None = None) -> int:
    """``num_processes: auto``: one per GPU; on CPU (profile ``cpu``) one per usable core (or
    ``free``), lowered to the largest count that divides every iteration's ``dpo.train_batch_size``
    (with its gradient accumulation). Not load-dependent, unlike threads: the rank count changes
    how gradients are summed, and a rerun must train the same numbers."""
    if launch_profile != "cpu":
        import torch

        return max(1, torch.cuda.device_count())
    from .hardware import usable_cores

    n = free if free is not None else usable_cores()
    while n > 1 and any(b is not None and b % (n * a) for b, a in dpo_batches):
        n -= 1
    return n


def sft_dict(cfg: LoopConfig, run_dir: Path) -> dict:
    """The SFT stage config (run once, before iteration 1): the Axolotl stage file ``sft.config``,
    the loop's other ``sft`` keys over it (e.g. ``sft.dataset``, ``sft.learning_rate``), the starting
    policy as ``base_model`` and ``<run>/sft/model`` as ``output_dir``."""
    s = dict(cfg.sft)
    s.pop("enabled", None)
    d = deep_merge(_stage_file(s.pop("config", "configs/sft.yaml")), s)
    if not d.get("dataset"):
        raise ConfigError("sft.enabled=true needs sft.dataset=<SFT JSONL of {messages: [...]}> "
                          "(e.g. from sft/build_sft_data.py).")
    d["base_model"] = str(default_model_dir()) if cfg.policy == "default" else cfg.policy
    d["output_dir"] = str(run_dir / "sft" / "model")
    return d


def iteration_config(cfg: LoopConfig, i: int) -> LoopConfig:
    """The loop config as seen by iteration ``i`` (``per_iteration[i]`` merged in).

    Raises:
        ConfigError: a ``per_iteration.<i>`` value of the wrong type (names ``per_iteration.<i>``).
    """
    if i not in cfg.per_iteration:
        return cfg
    merged = deep_merge(cfg.model_dump(), cfg.per_iteration[i])
    return LoopConfig.from_dict(merged, f"per_iteration.{i}")


def starting_policy(cfg: LoopConfig, run_dir: Path) -> str:
    if cfg.sft.get("enabled"):
        return str(run_dir / "sft" / "model")
    return str(default_model_dir()) if cfg.policy == "default" else cfg.policy


def policy_of(cfg: LoopConfig, run_dir: Path, i: int) -> str:
    """Policy that iteration ``i`` samples from: the starting policy for i <= 1, else model of i-1."""
    return starting_policy(cfg, run_dir) if i <= 1 else str(run_dir / f"iter_{i - 1}" / "model")


def stage_dict(cfg: LoopConfig, run_dir: Path, i: int, stage: str) -> dict:
    """The config mapping of ``stage`` in iteration ``i`` (before validation)."""
    c = iteration_config(cfg, i)
    it = run_dir / f"iter_{i}"
    if stage == "generate":
        return {"model": policy_of(c, run_dir, i), "seed": c.seed + 1000 * i, **c.generation,
                "prompts": str(it / "prompts.jsonl"), "output": str(it / "generated.jsonl")}
    if stage == "eval_generate":
        # The held-out set is generated by the model *after* iteration i (iteration 0: the start).
        model = policy_of(c, run_dir, i + 1)
        gen = {k: v for k, v in c.generation.items() if k not in ("k", "temperature", "top_p")}
        return {"model": model, "seed": c.seed, **gen, **c.evaluation,
                "prompts": _prompt_source(c.eval_prompts, "eval"), "prompt_field": c.eval_prompt_field or c.prompt_field,
                "limit": c.eval_limit, "output": str(it / "eval_generated.jsonl")}
    if stage == "rewards":
        return {**c.reward, "input": str(it / "generated.jsonl"), "output": str(it / "rewards.jsonl")}
    if stage == "eval_rewards":
        return {**c.reward, "input": str(it / "eval_generated.jsonl"), "output": str(it / "eval.jsonl")}
    if stage == "pairs":
        return {"seed": c.seed + i, **c.pairs, "input": str(it / "rewards.jsonl"), "output": str(it / "pairs.jsonl")}
    if stage == "dpo":
        base = _stage_file(c.dpo_config)
        dpo = deep_merge(base, c.dpo)
        # the loop's seed beats the stage file's; the loop's own dpo.training beats both
        training = {**dpo.pop("training", {}), "seed": c.seed, **c.dpo.get("training", {})}
        ref = starting_policy(c, run_dir) if c.ref_model == "initial" else None
        return {**dpo, "training": training, "policy": policy_of(c, run_dir, i), "reference": ref,
                "pairs": str(it / "pairs.jsonl"), "output_dir": str(it / "model")}
    raise KeyError(stage)


def _stage_file(path: str | None) -> dict:
    """A stage's own YAML (relative paths from the project root); {} for None."""
    if not path:
        return {}
    p = Path(path) if Path(path).is_absolute() else PROJECT_ROOT / path
    return load_yaml(p)


def _stage_io(cfg: dict, stage: str) -> tuple[list[str], list[str]]:
    if stage in ("generate", "eval_generate"):
        return [cfg["model"], cfg["prompts"]], [cfg["output"]]
    if stage in ("rewards", "eval_rewards"):
        extra = [cfg["reward_model"]] if cfg.get("reward_model") else []
        return [cfg["input"], *extra], [cfg["output"]]
    if stage == "pairs":
        return [cfg["input"]], [cfg["output"]]
    if stage == "dpo":
        ref = [cfg["reference"]] if cfg.get("reference") else []
        return [cfg["policy"], cfg["pairs"], *ref], [cfg["output_dir"]]
    raise KeyError(stage)


def plan(config_path: str | None, overrides: list[str]) -> Path:
    """Resolve the config, write the run dir's config.yaml, stage configs, plan.json and prompt
    slices; print shell assignments (RUN_DIR, ITERATIONS, ...) for run_loop.sh to ``eval``."""
    cfg = resolve(config_path, overrides)
    run_dir = Path(cfg.output_root) / cfg.run_name
    run_dir = run_dir.resolve()
    train_sets: dict[str, list[dict]] = {}  # prompt source -> rows (a source may change per iteration)
    warnings: list[str] = []
    eval_ids = _eval_ids(cfg, run_dir)
    seen_train: dict[str, int] = {}  # train prompt id -> first iteration that used it
    for i in range(0, cfg.iterations + 1):
        it = run_dir / f"iter_{i}"
        c = iteration_config(cfg, i)
        entries = {}
        for stage in STAGES:
            if i == 0 and not stage.startswith("eval"):
                continue
            d = STAGES[stage][1].from_dict(stage_dict(cfg, run_dir, i, stage)).model_dump(mode="json")
            path = it / "configs" / f"{stage}.yaml"
            _write_if_changed(path, yaml.safe_dump(d, sort_keys=False, allow_unicode=True))
            inputs, outputs = _stage_io(d, stage)
            entries[stage] = {"env": STAGES[stage][0], "config": str(path), "inputs": inputs, "outputs": outputs}
        if i == 0 and cfg.sft.get("enabled"):
            d = SFTStageConfig.from_dict(sft_dict(cfg, run_dir)).model_dump(mode="json")
            path = it / "configs" / "sft.yaml"
            _write_if_changed(path, yaml.safe_dump(d, sort_keys=False, allow_unicode=True))
            entries["sft"] = {"env": "train", "config": str(path), "inputs": [d["base_model"], d["dataset"]],
                              "outputs": [d["output_dir"]]}
        if i >= 1:
            src = _prompt_source(c.train_prompts, "train")
            if src not in train_sets:
                from .records import load_prompts

                train_sets[src] = load_prompts(src, prompt_field=c.prompt_field)
            rows = _write_prompt_slice(it / "prompts.jsonl", train_sets[src], c, i)
            warnings += _overlap_warnings(rows, i, eval_ids, seen_train)
        write_json(it / "plan.json", entries)
    shell = {
        "RUN_DIR": str(run_dir), "ITERATIONS": cfg.iterations, "LAUNCH_PROFILE": cfg.launch_profile,
        "NUM_PROCESSES": cfg.num_processes, "GENERATION_SHARDS": cfg.generation_shards,
        "SFT_ENABLED": int(bool(cfg.sft.get("enabled"))), "REWARD_SOURCE": cfg.reward.get("source", "verifier"),
    }
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    write_json(run_dir / "plan_warnings.json", warnings)
    # Last, so that a plan refused on the way (e.g. a bad prompt file) leaves the run's config as it was.
    _write_run_config(run_dir, cfg.to_yaml(), f"{RUN_CONFIG_HEADER} {config_path or 'defaults'} {' '.join(overrides)}\n")
    for k, v in shell.items():
        print(f"{k}={shlex.quote(str(v))}")
    return run_dir


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


def _eval_ids(cfg: LoopConfig, run_dir: Path) -> set[str]:
    """Keys of the held-out prompts, loaded exactly as the eval_generate stage will load them."""
    from .records import load_prompts

    g = GenerateConfig.from_dict(stage_dict(cfg, run_dir, 0, "eval_generate"))
    return {_prompt_key(r) for r in load_prompts(g.prompts, g.prompt_split, g.prompt_field, g.limit)}


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


def _write_prompt_slice(path: Path, train: list[dict], c: LoopConfig, i: int) -> list[dict]:
    """Iteration i's train prompts: slice i of ``prompts_per_iteration`` (wrapping), else the first ``train_limit``."""
    n = c.prompts_per_iteration
    if n:
        start = ((i - 1) * n) % len(train)
        rows = (train + train)[start:start + min(n, len(train))]
    else:
        rows = train[: c.train_limit] if c.train_limit else train
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    _write_if_changed(path, text)
    return rows


def _stage_entry(run_dir: Path, i: int, stage: str) -> dict:
    plan_path = run_dir / f"iter_{i}" / "plan.json"
    entries = read_json(plan_path)
    if stage not in entries:
        raise ConfigError(f"{plan_path}: no stage {stage!r}; stages: {', '.join(entries)}.")
    return entries[stage]


def stage_hash(run_dir: Path, i: int, stage: str) -> str:
    """Hash of a stage's config (with the run dir's own path masked) and its inputs' content:
    a run directory moved or copied elsewhere resumes where it stopped."""
    e = _stage_entry(run_dir, i, stage)
    config_text = Path(e["config"]).read_text(encoding="utf-8").replace(str(run_dir), "<run_dir>")
    return fingerprint({"stage": stage, "config": config_text}, e["inputs"], root=run_dir)


def _marker(run_dir: Path, i: int, stage: str) -> Path:
    return run_dir / f"iter_{i}" / f"{stage}.done"


def check(run_dir: Path, i: int, stage: str) -> bool:
    """True when the stage's ``.done`` exists, its hash matches and its outputs exist (a checkpoint
    folder only counts with its weights: ``*.safetensors`` or ``pytorch_model*.bin``)."""
    e = _stage_entry(run_dir, i, stage)
    return is_done(_marker(run_dir, i, stage), stage_hash(run_dir, i, stage)) and all(
        _output_present(Path(o)) for o in e["outputs"])


def _output_present(path: Path) -> bool:
    if not path.exists():
        return False
    if path.is_dir() and (path / "config.json").is_file():
        return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return True


def mark(run_dir: Path, i: int, stage: str, seconds: float) -> None:
    mark_done(_marker(run_dir, i, stage), stage_hash(run_dir, i, stage), seconds=round(seconds, 2))


def mean_ci95(xs: list[float]) -> tuple[float, float, float]:
    """Mean and normal-approximation 95% interval (mean ± 1.96·s/√n); (nan, nan, nan) when empty."""
    if not xs:
        return (math.nan, math.nan, math.nan)
    m = statistics.fmean(xs)
    half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return (m, m - half, m + half)


# The stats files of an iteration folder: name -> class. Iteration 0 only evaluates (no train stages).
EVAL_STATS = {"eval_generated.jsonl": GenerateStats, "eval.jsonl": RewardStats}
TRAIN_STATS = {"generated.jsonl": GenerateStats, "rewards.jsonl": RewardStats, "pairs.jsonl": PairsStats,
               "model": DPOStats}


def iteration_stats(it: Path, i: int) -> dict[str, StageStats]:
    """Every stage's stats of iteration folder ``it`` (iteration ``i``), read through their classes:
    ``{output name: stats}`` for the train stages (``i >= 1`` only: iteration 0 has none) and the
    held-out evaluation.

    Raises:
        FileNotFoundError: a stage's stats file is missing (its stage has not run).
        DataError: a stats file is not what its stage writes (names the file and the key).
    """
    files = {**(TRAIN_STATS if i >= 1 else {}), **EVAL_STATS}
    return {name: cls.read(stats_path(it / name)) for name, cls in files.items()}


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
    # One stats.json per iteration: every stage's counts.
    write_json(it / "stats.json", {name: st.model_dump(mode="json") for name, st in stats.items()})
    # Markers exist only for stages that ran (no train stages in iteration 0).
    row["stage_seconds"] = {s: read_json(_marker(run_dir, i, s)).get("seconds") for s in STAGES
                            if _marker(run_dir, i, s).exists()}
    row["hardware"] = _hardware(stats)
    rows = [r for r in (read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else [])
            if r["iteration"] != i]
    rows = sorted([*rows, row], key=lambda r: r["iteration"])
    write_jsonl(run_dir / "metrics.jsonl", rows)
    return row


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
    pairs_stats: PairsStats = stats["pairs.jsonl"]
    rewards_stats: RewardStats = stats["rewards.jsonl"]
    dpo: DPOStats = stats["model"]
    sampled = [r for r in gen if len(r.get("responses", [])) >= 2]
    low = sum(distinct_texts(r["responses"]) < 2 for r in sampled)
    warning = low_diversity_warning(len(sampled), low, f"iteration {i}, generated.jsonl")
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
    lines += ["", "Held-out: greedy responses to the eval prompts after the iteration's DPO. Rollout: mean reward "
              "of the iteration's K samples per train prompt, drawn from the previous iteration's policy.",
              "", "Stage seconds per iteration:", ""]
    for r in rows:
        lines.append(f"- iteration {r['iteration']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items() if v))
    lines += _hardware_lines(rows)
    lines += ["", "![report](report.png)", ""]
    with atomic_open(run_dir / "report.md") as f:
        f.write("\n".join(lines))
    _plot(rows, run_dir / "report.png")
    if cfg.get("wandb"):
        _log_wandb(rows, run_dir, cfg)
    return run_dir / "report.md"


def _plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in rows]
    means = [r["eval_reward_mean"] for r in rows]
    err = [[m - r["eval_reward_ci95"][0] for m, r in zip(means, rows)],
           [r["eval_reward_ci95"][1] - m for m, r in zip(means, rows)]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.errorbar(its, means, yerr=err, marker="o", capsize=4)
    a.set_xticks(its)
    a.set_xlabel("iteration (0 = starting policy)")
    a.set_ylabel("held-out reward (mean, 95% CI)")
    a.set_title("Held-out reward per iteration")
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
        run.log({"eval/reward_mean": r["eval_reward_mean"], "train/pairs": r.get("pairs", 0), **rollout,
                 **{f"time/{k}": v for k, v in r["stage_seconds"].items() if v}}, step=r["iteration"])
    run.finish()


def main(argv: list[str]) -> int:
    setup_cache_env()
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    try:
        if cmd in ("plan", "run-dir"):
            cfg_path = args[0] if args and "=" not in args[0] else None
            overrides = args[1:] if cfg_path else args
            if cmd == "plan":
                plan(cfg_path, overrides)
            else:  # where the run lives, nothing written (run_loop.sh locks it before any change)
                cfg = resolve(cfg_path, overrides)
                print((Path(cfg.output_root) / cfg.run_name).resolve())
        elif cmd == "check":
            return 0 if check(Path(args[0]), int(args[1]), args[2]) else 1
        elif cmd == "mark":
            mark(Path(args[0]), int(args[1]), args[2], float(args[3]))
        elif cmd == "metrics":
            row = metrics(Path(args[0]), int(args[1]))
            lo, hi = row["eval_reward_ci95"]
            rollout = row.get("rollout_reward_mean")
            print(f"iteration {row['iteration']}: held-out reward {row['eval_reward_mean']:.4f} "
                  f"(95% CI {lo:.4f}-{hi:.4f}, n={row['eval_prompts']}), "
                  + ("" if rollout is None else f"rollout reward {rollout:.4f}, ") + f"pairs {row.get('pairs', '-')}")
            for w in row["warnings"]:
                print(f"WARNING: {w}")
        elif cmd == "report":
            print(report(Path(args[0])))
        else:
            print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
            return 2
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
