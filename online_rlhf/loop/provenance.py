"""Where each value of a stage YAML came from: the comment block the plan writes on top of it.

Origins, highest precedence first: ``per_iteration.<i>``, the loop's section on the command line
or in the config file, the stage's own YAML (``dpo_config`` / ``sft.config``), a top-level loop
key the plan derives the value from, else the run layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import apply_overrides, load_yaml
from ..paths import PROJECT_ROOT
from ..loop_config import LoopConfig
from ..stage_table import Stage, stage_file


class Layers:
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
            "num_machines": "num_machines", "main_process_ip": "main_process_ip", "main_process_port": "main_process_port",
            "adapter": "lora"}


def value_origins(stage: Stage, d: dict, c: LoopConfig, i: int, layers: Layers,
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
        if own_file is None:
            own_file = stage.provenance.stage_file_default
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
        origin = stage.provenance.set_by_plan.get(".".join(map(str, path)))
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
        if not origin and path[0] in ("lora", "save_adapter") and c.lora is not None:  # the loop's lora key
            origin = f"loop key lora ({layers.find(['lora']) or 'its default'})"
        key = {**_DERIVED, **stage.provenance.derived_from}.get(path[-1])
        if not origin and path[-1] in ("model", "policy") and start is not None and v != start:
            origin = ("this iteration's trained model" if str(v).endswith(f"iter_{i}/model")
                      else "the model of the iteration before")
        if not origin and key and (path[0] != "training" or path[-1] == "seed"):
            origin = f"loop key {key} ({layers.find([key]) or 'its default'})"
            if path == ["seed"] and stage.provenance.seed_offset:
                origin = f"loop key seed {stage.provenance.seed_offset} ({layers.find(['seed']) or 'its default'})"
            if path == ["num_processes"] and d.get("source", "reward_model") != "reward_model":
                origin = f"one process: source={d.get('source')} runs in one process"
        out.append((".".join(map(str, path)), v, origin or "the run layout"))
    return out


def stage_header(stage: Stage, i: int, layers: Layers, command: str, prov: list[tuple[str, Any, str]],
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

