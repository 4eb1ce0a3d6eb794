"""Key checks of the loop config's stage sections, run by the plan before any stage starts.

Every key of each typed stage section (``generation``, ``evaluation``, ``reward``, ``pairs``, ``dpo``,
``grpo``: those of ``online_rlhf.loop_config.LOOP_OWNED``, with ``dpo.training`` against
``trl.DPOConfig`` and ``dpo.lora`` against ``peft.LoraConfig``) and ``sft`` (against Axolotl's
schema), at the top level and in each ``per_iteration.<i>``, is checked here. A problem is
named by the key path as the user wrote it (``generation.temprature``,
``per_iteration.2.generaton``), with the closest known key. Keys the loop sets itself (a stage's
input and output files, the policy, the shard layout) are refused with what to set instead: the
loop would silently replace them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from .config import ConfigError, did_you_mean, validation_problems
from .loop_config import LOOP_OWNED, SECTION_CLASSES, LoopConfig
from .stage_table import stage_file
from .stage_configs import SFTStageConfig
from .dpo_config import dpo_training_problems
from .trl_args import check_axolotl_keys, check_lora

_FILES = "the loop sets each stage's input and output files itself"
_DRY = "set dry_run=true at the top level (the loop runs each stage once in dry mode)"
_LORA_KEY = ("the loop's lora key sets it (lora='{r: 16}': every stage then reads the starting policy plus the "
             "latest adapter, docs/dpo.md)")
_GEN_OWNED = {
    "model": "the loop sets the policy: set policy= (later iterations sample from the previous model)",
    "adapter": _LORA_KEY,
    "prompts": "set train_prompts (and prompts_per_iteration / train_limit) at the top level",
    "prompt_field": "set prompt_field / eval_prompt_field at the top level",
    "limit": "set prompts_per_iteration or train_limit (train), eval_limit (held-out) at the top level",
    "output": _FILES, "shards_dir": _FILES,
    "shard_index": "the launcher sets it for each shard", "num_shards": "set generation_shards at the top level",
    "dry_run": _DRY,
    "num_machines": "set num_machines at the top level (the loop writes it into the stage's config)",
    "machine_rank": "it is per machine: `python -m online_rlhf.loop exec RUN_DIR ITER STAGE machine_rank=k` on machine k",
}
_EVAL_OWNED = {**_GEN_OWNED, "prompts": "set eval_prompts at the top level", "limit": "set eval_limit at the top level",
               "prompt_field": "set eval_prompt_field at the top level"}
_IO_OWNED = {"input": _FILES, "output": _FILES}
_LAUNCH = {"num_processes": "set num_processes at the top level (the loop writes it into the stage's config)",
           "launch_profile": "set launch_profile at the top level (the loop writes it into the stage's config)",
           **{k: f"set {k} at the top level (the loop writes it into the stage's config)"
              for k in ("num_machines", "main_process_ip", "main_process_port")}}
_DPO_OWNED = {"policy": "set policy= at the top level (later iterations train the previous model)",
              "adapter": _LORA_KEY, "save_adapter": _LORA_KEY,
              "reference": "set ref_model: initial | previous at the top level",
              "pairs": _FILES, "output_dir": _FILES, **_LAUNCH, "dry_run": _DRY}
# GRPO keys that describe how the rollouts were sampled: the loop copies them from the generation
# section, so that the log-probs are those of the distribution the tokens were drawn from.
_GRPO_SAMPLED = {
    "temperature": "the loop sets it from generation.temperature (the rollouts' sampling temperature): "
                   "set generation.temperature instead",
    "max_completion_length": "the loop sets it from generation.max_tokens (the rollouts' max new tokens): "
                             "set generation.max_tokens instead",
}
# What to set instead of a loop-owned key, by section (a section not named here, and a key not named
# for its section, gets the key's entry in _WHY, else _FILES: the plan writes the stage's files).
_WHY_BY_SECTION = {"generation": _GEN_OWNED, "evaluation": _EVAL_OWNED, "dpo": _DPO_OWNED,
                   "grpo": {**_DPO_OWNED, **_GRPO_SAMPLED}}
_WHY = {**_LAUNCH, "dry_run": _DRY}


def _why(section: str, key: str) -> str:
    return _WHY_BY_SECTION.get(section, {}).get(key) or _WHY.get(key) or _FILES


# loop section -> (stage config class it feeds, keys the loop sets itself -> what to set instead),
# derived from online_rlhf.loop_config.LOOP_OWNED (which the stage table's rows give)
SECTIONS: dict[str, tuple[type[BaseModel], dict[str, str]]] = {
    name: (SECTION_CLASSES[name], {k: _why(name, k) for k in owned if k in SECTION_CLASSES[name].model_fields})
    for name, owned in LOOP_OWNED.items()}
_SFT_LOOP_KEYS = {"enabled", "config"}
_SFT_OWNED = {"base_model": "set policy= at the top level", "output_dir": "the loop writes it to <run>/sft/model",
              "dry_run": _DRY}
_PLACEHOLDER = "<set by the loop>"


def check_section_file(path: str | None, key: str, section: str) -> None:
    """The stage YAML a loop section is layered on (``dpo_config``, ``grpo_config``: the row's
    ``stage_file_key``) must not hold the keys the loop sets itself for that section
    (:data:`SECTIONS`): the loop would silently replace them (or, for the GRPO keys it copies from
    the generation section, the file would silently replace the loop's). The plan checks it before it
    builds the stage (``online_rlhf.loop.resolve``).

    Raises:
        ConfigError: no such file; or a loop-owned key in it, naming the file, the key and what to
            set instead.
    """
    data = stage_file(path, key)
    owned = SECTIONS[section][1]
    bad = [k for k in data if k in owned]
    if bad:
        raise ConfigError(f"{key}={path}: " + " ".join(f"{k}: cannot be set in this file; {owned[k]} (and remove "
                                                       f"{k} from {path})." for k in bad))


def section_problems(cls: type[BaseModel], owned: dict[str, str], section: Any, path: str) -> list[str]:
    """Problems of one stage section: unknown keys (with the closest field), keys the loop owns, and
    values of the wrong type. Cross-field checks are left to the stage config.

    Args:
        path: the section as the user wrote it, e.g. ``"per_iteration.2.generation"``.
    Returns:
        one line per problem, each starting with ``<path>.<key>``.
    """
    if not isinstance(section, dict):
        return [f"{path}: expected a mapping of {cls.__name__} keys, got {section!r:.80}."]
    out = []
    for key in section:
        if key in owned:
            out.append(f"{path}.{key}: cannot be set here; {owned[key]}.")
        elif key not in cls.model_fields:
            out.append(f"{path}.{key}: unknown key.{did_you_mean(key, cls.model_fields)} "
                       f"Known keys: {', '.join(sorted(k for k in cls.model_fields if k not in owned))}.")
    if out:
        return out
    required = {k: _PLACEHOLDER for k, f in cls.model_fields.items() if f.is_required()}
    try:
        cls.model_validate({**required, **section})
    except ValidationError as e:
        for err in e.errors():
            if err["loc"] and err["loc"][0] in section:  # field errors; model-level ones are the stage's
                loc = ".".join(str(p) for p in err["loc"])
                out.append(f"{path}.{loc}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r:.80}).")
    return out


def dpo_library_problems(dpo: dict, path: str) -> list[str]:
    """``dpo.training`` against ``trl.DPOConfig`` and ``dpo.lora`` against ``peft.LoraConfig``."""
    out = []
    if isinstance(dpo.get("training"), dict):
        out += dpo_training_problems(dpo["training"], f"{path}.training")[1]
    if isinstance(dpo.get("lora"), dict):
        try:
            check_lora(dpo["lora"], f"{path}.lora", required=False)
        except ConfigError as e:
            out.append(str(e))
    return out


def sections_problems(data: dict, prefix: str = "") -> list[str]:
    """Problems of every stage section in one loop mapping (the top level, or one
    ``per_iteration`` entry with ``prefix="per_iteration.<i>."``)."""
    out = []
    for name, (cls, owned) in SECTIONS.items():
        if name in data and data[name] is not None:
            out += section_problems(cls, owned, data[name], prefix + name)
            if name == "dpo" and isinstance(data[name], dict):
                out += dpo_library_problems(data[name], prefix + name)
    return out


def per_iteration_problems(per_iteration: dict, run_level: tuple[str, ...]) -> list[str]:
    """Unknown or run-level keys in each ``per_iteration.<i>``, then its stage sections."""
    out = []
    for i, over in per_iteration.items():
        if not isinstance(over, dict):
            out.append(f"per_iteration.{i}: expected a mapping of loop keys, got {over!r:.80}.")
            continue
        for key in over:
            if key in run_level:
                out.append(f"per_iteration.{i}.{key}: cannot be set per iteration; set it at the top level.")
            elif key not in LoopConfig.model_fields:
                known = sorted(k for k in LoopConfig.model_fields if k not in run_level)
                out.append(f"per_iteration.{i}.{key}: unknown key.{did_you_mean(key, known)} "
                           f"Keys that can change per iteration: {', '.join(known)}.")
        out += sections_problems(over, f"per_iteration.{i}.")
    return out


def sft_problems(sft: dict) -> list[str]:
    """The loop's ``sft`` section: keys the loop owns, and Axolotl keys checked against its schema."""
    out = [f"sft.{k}: cannot be set here; {why}." for k, why in _SFT_OWNED.items() if k in sft]
    extra = {k: v for k, v in sft.items() if k not in _SFT_LOOP_KEYS and k not in _SFT_OWNED}
    if extra:
        try:
            check_axolotl_keys(extra, prefix="sft.", also_known=set(SFTStageConfig.model_fields) | _SFT_LOOP_KEYS,
                               section="the loop's sft section (it takes " + ", ".join(sorted(_SFT_LOOP_KEYS))
                               + " and Axolotl config keys)")
        except ConfigError as e:
            out.append(str(e))
    return out


def check_loop_keys(data: dict, source: str, run_level: tuple[str, ...]) -> None:
    """Check every stage-section key of a loop config mapping (top level and ``per_iteration``).

    Args:
        data: the loop config as written (after overrides), already valid as a ``LoopConfig``.
        source: where it came from, for the message (file + overrides).
        run_level: top-level keys that cannot change per iteration.
    Raises:
        ConfigError: listing every problem, each named by its key path.
    """
    problems = sections_problems(data)
    problems += per_iteration_problems(data.get("per_iteration") or {}, run_level)
    problems += sft_problems(data.get("sft") or {})
    # the other keys' problems too (a top-level typo, a bad value), in one message rather than one per
    # run: LoopConfig's own errors under a key whose section was checked above are left out (said once)
    checked = {p.split(":", 1)[0].split(".", 1)[0] for p in problems}
    try:
        LoopConfig.model_validate(data)
    except ValidationError as e:
        problems += [line for err, line in zip(e.errors(), validation_problems(e, LoopConfig))
                     if not (err["loc"] and str(err["loc"][0]) in checked)]
    if problems:
        unknown = [k for k in data if k not in LoopConfig.model_fields]
        hint = ""
        if len(unknown) > len(data) - len(unknown):  # mostly unknown keys: likely a stage's file, not a loop config
            hint = ("\nMost of its keys are not loop config keys: is it a stage's config? A loop config has "
                    "configs/loop.yaml's layout. A DPO or GRPO recipe file is named from it (dpo_config=<file>, or "
                    "grpo_config=<file> with algorithm=grpo), and a stage's own YAML runs that stage by hand "
                    "(docs/architecture.md).")
        raise ConfigError(f"{source}: {len(problems)} problem(s) in the config:\n  - " + "\n  - ".join(problems) + hint)
