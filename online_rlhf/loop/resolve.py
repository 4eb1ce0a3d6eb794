"""The loop config resolved and checked: ``loop plan`` and ``loop plan-check`` start here.

:func:`resolve` loads the loop config, applies the overrides and builds every stage config of every
iteration dry (no model loaded), so a bad key or value stops the plan before any stage runs; the
other functions are the plan's checks of its inputs (prompt sets, verifier fields, local models)
and the warnings it prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from ..config import ConfigError, apply_overrides, load_yaml
from ..loop_keys import SECTIONS, check_loop_keys, check_section_file
from ..paths import PROJECT_ROOT, is_local_data, local_folder_prefix, resolve_model
from ..loop_config import LoopConfig, iteration_config
from ..stage_configs import GenerateConfig
from ..stage_table import STAGES, Stage, prompt_source, stage_file


# Keys of the loop config whose values are fixed per run, not per iteration.
_RUN_LEVEL = ("run_name", "output_root", "iterations", "policy", "sft", "per_iteration", "wandb", "dry_run", "algorithm",
              "num_machines", "machine_rank", "main_process_ip", "main_process_port", "launcher",
              "ifeval", "kl_samples", "kl_warn", "eval_cache", "co_decode", "lora")


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
            raise ConfigError(f"{src}: per_iteration has iteration {i}, but the iterations are 1..{cfg.iterations} "
                              f"(iterations={cfg.iterations}); use one of those numbers, or raise iterations.")
    if cfg.policy != "default":  # the default is prepared by run_loop.sh before the plan runs
        _check_local_model(cfg.policy, "policy", src, "a checkpoint folder, an HF Hub id (owner/name) or 'default'")
    _check_policy_is_not_an_adapter(cfg, src)
    for i in range(0, cfg.iterations + 1):  # a reward model given as a local path (Hub ids are not looked up here)
        r = iteration_config(cfg, i).reward
        if r.source == "reward_model" and r.reward_model:
            _check_local_model(r.reward_model, "reward.reward_model" if i not in cfg.per_iteration else
                               f"reward.reward_model (iteration {i})", src,
                               "a reward-model folder or an HF Hub id (owner/name)")
    # Dry validation: build every stage config of every iteration without touching models, with each
    # row's own checks (online_rlhf.stage_checks; e.g. the SFT file's Axolotl keys, generation.k).
    built: list[tuple[Stage, int, dict]] = []  # (row, iteration, resolved stage dict)
    for i in range(0, cfg.iterations + 1):
        for stage in STAGES.values():
            if not stage.runs_in(cfg, i):
                continue
            if stage.stage_file_key and stage.section in SECTIONS:  # its recipe file holds no loop-owned key
                recipe = getattr(iteration_config(cfg, i), stage.stage_file_key)
                check_section_file(recipe, stage.stage_file_key, stage.section)
                if cfg.lora is not None and "lora" in stage_file(recipe, stage.stage_file_key):
                    raise ConfigError(f"{src}: lora is set and {stage.stage_file_key}={recipe} holds a lora section "
                                      "too (a fresh adapter merged into a full checkpoint each iteration); keep one: "
                                      f"remove lora from {recipe}, or set lora=null.")
            d = stage_dict(cfg, Path("/dry-run"), i, stage.name)
            at = f"{src}, stage {stage.name}" if stage.before_the_loop else f"{src}, iteration {i}, stage {stage.name}"
            stage_cfg = stage.config.from_dict(d, at)
            if stage.checks.config is not None:
                stage.checks.config(cfg, i, d, stage_cfg, f"{src}, iteration {i}")
            built.append((stage, i, d))
    for section in ("generation", "evaluation"):
        if getattr(cfg, section).dtype == "bfloat16" and cfg.launch_profile == "cpu":
            from ..hardware import compute_dtype

            compute_dtype("cpu", "bfloat16")  # one-line warning where the CPU has no native bf16
    from ..hardware import fixed_cores

    try:
        fixed_cores()  # a bad ONLINE_RLHF_CORES is refused here, not by the first stage
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.num_processes == "auto":
        cfg.num_processes = auto_processes(cfg.launch_profile, [s.checks.batch(d) for s, _, d in built if s.checks.batch],
                                           num_machines=cfg.num_machines)
    if cfg.dry_run and cfg.num_machines > 1:
        raise ConfigError(f"{src}: dry_run=true with num_machines={cfg.num_machines}: the dry run measures each "
                          "stage on this machine alone (a multi-machine stage would wait for the others). Run it "
                          "with num_machines=1 and the per-machine process count (num_processes=<processes per "
                          "machine>): each machine holds the same share.")
    for stage, i, d in built:  # with num_processes resolved: the batch split per device, what a dry run needs
        if stage.checks.launch is not None:
            stage.checks.launch(cfg, i, d, src)
    if cfg.num_machines > 1 and cfg.generation_shards < cfg.num_machines:
        print(f"WARNING: generation_shards={cfg.generation_shards} < num_machines={cfg.num_machines}: machines "
              f"{cfg.generation_shards}..{cfg.num_machines - 1} run no generation shard (one shard per device of "
              "every machine is usual).", file=sys.stderr)
    return cfg


def _check_policy_is_not_an_adapter(cfg: LoopConfig, src: str) -> None:
    """The starting policy must be a full checkpoint (every stage reads it, and under ``lora`` the
    loop puts its own adapters on it); with ``lora``, its ``target_modules`` names must be modules
    of a local policy (:func:`online_rlhf.adapters.unknown_target_modules`).

    Raises:
        ConfigError: ``policy`` is a LoRA adapter folder (with the merge command), or a target module
            the policy does not have (naming the module names it has).
    """
    from ..adapters import is_adapter, unknown_target_modules
    from ..paths import default_model_dir

    policy = str(default_model_dir()) if cfg.policy == "default" else cfg.policy
    if is_adapter(policy):
        raise ConfigError(f"{src}: policy={cfg.policy} is a LoRA adapter folder (it holds adapter_config.json); the loop "
                          "starts from a full checkpoint. Merge it first: .venv-train/bin/python scripts/merge_lora.py "
                          f"{cfg.policy} <merged folder>, then policy=<merged folder> (add lora='{{r: ...}}' to go on "
                          "with LoRA).")
    if cfg.lora is None or cfg.lora.target_modules == "all-linear" or not (Path(policy) / "config.json").is_file():
        return
    wanted = [cfg.lora.target_modules] if isinstance(cfg.lora.target_modules, str) else cfg.lora.target_modules
    missing, linear = unknown_target_modules(policy, wanted)
    if missing:
        raise ConfigError(f"{src}: lora.target_modules names {', '.join(missing)}, which the policy {policy} has no "
                          f"linear layer for; its linear layers are {', '.join(linear)} (or target_modules=all-linear).")


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
    from ..hardware import fixed_cores, usable_cores

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


def _ifeval_prompts_path(cfg: LoopConfig) -> tuple[str, Path]:
    """``(ifeval.prompts as given, the file it names)``: ``default`` is the prepared ``ifeval.jsonl``."""
    from ..paths import default_data_dir

    given = cfg.ifeval.prompts
    return given, default_data_dir() / "ifeval.jsonl" if given == "default" else Path(given)


def check_ifeval_prompts(cfg: LoopConfig) -> None:
    """When the run has IFEval stages (``ifeval.when`` other than ``never``), their prompt file must
    exist before the first stage (else ``ifeval_generate`` fails after the training of the run).
    A Hub dataset id (``owner/name``, not a local path) is left to the stage.

    Raises:
        ConfigError: a missing local file, naming ``ifeval.prompts``, the path and the fixes.
    """
    if cfg.ifeval.when == "never":
        return
    from ..paths import default_data_dir

    given, path = _ifeval_prompts_path(cfg)
    if is_local_data(given, bare_name_is_hub=False) and not path.exists():
        raise ConfigError(f"ifeval.prompts={given}: no such file ({path}); ifeval.when={cfg.ifeval.when} runs IFEval on "
                          "it. Prepare the default with `.venv-train/bin/python scripts/prepare_default.py` (writes "
                          f"{default_data_dir() / 'ifeval.jsonl'}), point ifeval.prompts at a JSONL file of IFEval "
                          "prompts (prompt, instruction_id_list, kwargs), or set ifeval.when=never.")


def check_ifeval_fields(cfg: LoopConfig) -> Optional[int]:
    """When the run has IFEval stages, every record of a local ``ifeval.prompts`` file (the first
    ``ifeval.limit``) must carry the fields ``ifeval_score`` scores by (``instruction_id_list`` +
    ``kwargs``; :func:`online_rlhf.verifiers.missing_fields` with ``verifier=ifeval``, the check of
    :func:`check_verifier_fields`), else every IFEval score of the run would fail after training.

    Returns:
        how many prompts IFEval will score (the file's first ``ifeval.limit``), or None when the run
        has no IFEval stage or the prompts are not a local file.
    Raises:
        ConfigError: naming ``ifeval.prompts``, the file, how many records lack the fields, the first
            one's id and what it lacks, and the fixes.  DataError: a malformed file (file and line).
    """
    if cfg.ifeval.when == "never":
        return None
    from ..records import load_prompts
    from ..verifiers import missing_fields

    given, path = _ifeval_prompts_path(cfg)
    if not path.is_file():  # a Hub id is left to the stage; a missing file is check_ifeval_prompts'
        return None
    rows = load_prompts(str(path), prompt_field=None, limit=cfg.ifeval.limit)
    bad = [(r["id"], m) for r in rows if (m := missing_fields(r, "ifeval"))]
    if not bad:
        _check_instructions(rows, f"ifeval.prompts={given} ({path})", "ifeval_score would fail on every response of them")
    if bad:
        rid, lacks = bad[0]
        raise ConfigError(f"ifeval.prompts={given} ({path}): {len(bad)} of {len(rows)} prompts lack the fields IFEval "
                          f"scores by; the first, id {rid!r}, needs {lacks}. ifeval.when={cfg.ifeval.when} would score "
                          "them after the training. Give a JSONL file of IFEval prompts (prompt, instruction_id_list, "
                          "kwargs), e.g. the default (ifeval.prompts=default, prepared by "
                          "`.venv-train/bin/python scripts/prepare_default.py`), or set ifeval.when=never.")
    return len(rows)


def check_prompt_files(cfg: LoopConfig) -> None:
    """Every local prompt file of the run (``eval_prompts``, and ``train_prompts`` of each iteration,
    ``per_iteration`` included) must exist; all the missing ones are reported at once. A Hub dataset
    id (``owner/name``) is left to the loaders, as :func:`online_rlhf.records.load_prompts` does.

    Raises:
        FileNotFoundError: naming every missing file with its key (and iteration), and the fix.
    """
    wanted = [("eval_prompts", prompt_source(cfg.eval_prompts, "eval"))]
    for i in range(1, cfg.iterations + 1):
        key = "train_prompts" if i not in cfg.per_iteration else f"train_prompts (iteration {i})"
        wanted.append((key, prompt_source(iteration_config(cfg, i).train_prompts, "train")))
    missing: list[str] = []
    for key, src in wanted:
        p = Path(src)
        entry = f"{key}={src}: no such file (looked at {p.absolute()})"
        if is_local_data(src) and not p.exists() and entry not in missing:
            missing.append(entry)
    if missing:
        raise FileNotFoundError(f"{len(missing)} prompt file(s) missing: " + "; ".join(missing) + ". Fix the paths (an "
                                "absolute one is the surest), or give an HF Hub dataset id (owner/name).")


def held_out_rows(cfg: LoopConfig, run_dir: Path) -> tuple[str, list[dict]]:
    """``(source, rows)`` of the held-out prompts, loaded exactly as the eval_generate stage will load them."""
    from ..records import load_prompts

    g = GenerateConfig.from_dict(stage_dict(cfg, run_dir, 0, "eval_generate"))
    return g.prompts, load_prompts(g.prompts, g.prompt_split, g.prompt_field, g.limit)


def check_verifier_fields(c: LoopConfig, rows: list[dict], what: str) -> None:
    """With ``reward.source=verifier``, every prompt of ``rows`` must carry the fields the verifier
    scores by (:func:`online_rlhf.verifiers.missing_fields`), else the rewards stage would leave it
    unscored (``missing_field``) after its responses were generated.

    Raises:
        ConfigError: naming ``what`` (the key and file), how many prompts lack the fields, the first
            one's id, what it lacks, and the fixes (add the fields, or another reward source).
    """
    if c.reward.source != "verifier":
        return
    from ..verifiers import FIELDS_HELP, missing_fields

    bad = [(r["id"], m) for r in rows if (m := missing_fields(r, c.reward.verifier))]
    if not bad:
        if c.reward.verifier != "math":
            _check_instructions([r for r in rows if "instruction_id_list" in r], what,
                                "their responses would be generated, then left unscored")
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


def drawn_argument_warnings(c: LoopConfig, rows: list[dict], what: str) -> list[str]:
    """With ``reward.source=verifier``: one warning when IF records of ``rows`` leave an argument for
    their checker to draw at random (:func:`online_rlhf.verifiers.drawn_arguments`), naming how many,
    the first one's id, instruction and argument: the rewards stage counts them as
    ``argument_drawn_by_checker`` and the update never sees them."""
    if c.reward.source != "verifier" or c.reward.verifier == "math":
        return []
    from ..verifiers import drawn_arguments, drawn_text

    drawn = [(r["id"], d) for r in rows if "instruction_id_list" in r and (d := drawn_arguments(r))]
    if not drawn:
        return []
    rid, d = drawn[0]
    return [f"{what}: {len(drawn)} of {len(rows)} prompts leave an argument for their checker to draw at random, so "
            f"their K responses would not be judged against one constraint; the first, id {rid!r}: {drawn_text(d)}. "
            "The rewards stage counts them as argument_drawn_by_checker and trains on none of them. Give every "
            "argument a value the checker reads (scripts/build_if_prompts.py writes such prompts)."]


def _check_instructions(rows: list[dict], what: str, then: str) -> None:
    """Every IF record of ``rows`` (fields present) names checkers of the registry and kwargs they
    take (:func:`online_rlhf.verifiers.instruction_problem`).

    Raises:
        ConfigError: naming ``what``, how many records are wrong, the first one's id and its problem.
    """
    from ..verifiers import instruction_problem

    bad = [(r["id"], m) for r in rows if (m := instruction_problem(r))]
    if bad:
        rid, problem = bad[0]
        raise ConfigError(f"{what}: {len(bad)} of {len(rows)} prompts name a constraint the checkers cannot score; the "
                          f"first, id {rid!r}, has {problem}; {then}. Fix those records (the ids and kwargs of "
                          "if-verifiable's IFEval/IFBench registries; scripts/build_if_prompts.py writes valid ones).")


def other_algorithm_warnings(cfg: LoopConfig) -> list[str]:
    """One warning naming every key set for the algorithm that does not run (``grpo`` keys under
    ``algorithm=dpo``, ``dpo`` keys under ``algorithm=grpo``; top level and ``per_iteration``): not
    an error, since switching algorithms is one key, but the keys change nothing."""
    other = "grpo" if cfg.algorithm == "dpo" else "dpo"
    keys = _flat_keys(getattr(cfg, other).model_dump(exclude_unset=True), other)
    for i, over in sorted(cfg.per_iteration.items()):
        if isinstance(over.get(other), dict):
            keys += _flat_keys(over[other], f"per_iteration.{i}.{other}")
    out = [] if not keys else [
        f"{_ignored(cfg.algorithm, keys)} (the {other} section applies under algorithm={other}); remove "
        f"{'it' if len(keys) == 1 else 'them'} or set algorithm={other}."]
    return out + _pairs_under_grpo_warnings(cfg)


# What GRPO does anyway, as a pairs setting: every response of a group counts, a cut one kept as it is.
_GRPO_NEUTRAL_PAIRS = {"strategy": "max_min", "truncated": "keep"}
_GRPO_PAIRS_EQUIVALENT = {"penalize": "grpo.truncated_penalty", "exclude": "grpo.mask_truncated_completions=true"}


def _pairs_under_grpo_warnings(cfg: LoopConfig) -> list[str]:
    """Under ``algorithm=grpo`` no pairs are built: one warning naming the ``pairs`` keys set (top
    level and ``per_iteration``) to a value that would change the pairs, with GRPO's own setting for
    a truncation rule. ``strategy: max_min`` and ``truncated: keep`` (configs/loop.yaml's) are what
    GRPO does anyway and are not named."""
    if cfg.algorithm != "grpo":
        return []
    sections = [("pairs", cfg.pairs.model_dump(exclude_unset=True))]
    sections += [(f"per_iteration.{i}.pairs", over["pairs"]) for i, over in sorted(cfg.per_iteration.items())
                 if isinstance(over.get("pairs"), dict)]
    keys, hints = [], []
    for prefix, d in sections:
        for k, v in d.items():
            if _GRPO_NEUTRAL_PAIRS.get(k, object()) == v:
                continue
            keys.append(f"{prefix}.{k}={v}")
            if k == "truncated" and v in _GRPO_PAIRS_EQUIVALENT and _GRPO_PAIRS_EQUIVALENT[v] not in hints:
                hints.append(_GRPO_PAIRS_EQUIVALENT[v])
    if not keys:
        return []
    hint = f"; GRPO's own rule for cut responses: {' or '.join(hints)}" if hints else ""
    return [f"{_ignored('grpo', keys)} (no pairs are built under GRPO: every response of a group counts){hint}."]


def _ignored(algorithm: str, keys: list[str]) -> str:
    """``algorithm=<a>: k1, k2 are ignored`` (``is`` for one key): the opening of both warnings above."""
    return f"algorithm={algorithm}: {', '.join(keys)} {'is' if len(keys) == 1 else 'are'} ignored"


def _flat_keys(d: dict, prefix: str) -> list[str]:
    """``{"training": {"beta": 1}}`` -> ``["<prefix>.training.beta"]``."""
    out = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}.{k}") if isinstance(v, dict) and v else [f"{prefix}.{k}"]
    return out


def prompt_key(rec: dict) -> str:
    """Identity of a prompt for overlap checks: its text (ids of two files need not agree)."""
    return json.dumps(rec["prompt"], sort_keys=True, ensure_ascii=False)


def overlap_warnings(rows: list[dict], i: int, eval_keys: set[str], seen: dict[str, int]) -> list[str]:
    out = []
    keys = [prompt_key(r) for r in rows]
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

