"""The stage table (``online_rlhf.stage_table.STAGES``) is the only list of stages: each row is
walked against every consumer (its entry script, config and stats classes, ``testing.example_stats``,
the loop's typed sections, the plan and ``loop stages``, the launch command, the scripts that go
through ``loop stages``, the docs), so that a row added to the table and missing anywhere fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from online_rlhf import loop, stats
from online_rlhf.jsonl import read_json, write_jsonl
from online_rlhf.loop_config import LOOP_OWNED, LoopConfig
from online_rlhf.config import StageConfig
from online_rlhf.stage_launch import is_module_entry, launch_command
from online_rlhf.stage_table import STAGES
from online_rlhf.stats import StageStats
from online_rlhf.testing import example_stats

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


@pytest.mark.parametrize("name", list(STAGES))
def test_every_row_names_what_exists(name, tmp_path):
    s = STAGES[name]
    assert s.name == name
    # an entry script, or the stage module itself (run with python -m)
    entry = ROOT / (s.entry.replace(".", "/") + ".py" if is_module_entry(s.entry) else s.entry)
    assert entry.is_file(), s.entry
    assert issubclass(s.config, StageConfig)
    fields = s.config.model_fields
    for key in (*s.inputs, *s.outputs, *s.provenance.set_by_plan, *s.provenance.derived_from):
        assert key in fields, (name, key)
    for key in s.provenance.derived_from.values():
        assert key in LoopConfig.model_fields, (name, key)
    for sec in s.sections:
        assert sec in LoopConfig.model_fields, (name, sec)
    if s.stage_file_key:
        assert s.stage_file_key.split(".")[0] in LoopConfig.model_fields, (name, s.stage_file_key)
    # its stats class is one of online_rlhf.stats, with an example for the tests that fake a run
    assert issubclass(s.stats, StageStats) and getattr(stats, s.stats.__name__) is s.stats
    path = tmp_path / "out.stats.json"
    example_stats(s.stats).write(path)
    assert s.stats.read(path) == example_stats(s.stats)


def test_every_reward_source_has_its_scoring_module():
    """records.RewardSource is the one list of reward sources (the rewards stage's config and stats
    type their `source` with it); the rewards stage has a scoring module for each."""
    import importlib

    from online_rlhf.records import REWARD_SOURCES
    from online_rlhf.stage_configs import RewardConfig
    from online_rlhf.stages.get_rewards import SOURCES

    assert tuple(SOURCES) == REWARD_SOURCES == ("reward_model", "verifier", "remote", "judge")
    assert RewardConfig.model_fields["source"].annotation == stats.RewardStats.model_fields["source"].annotation
    for name, module in SOURCES.items():
        assert importlib.util.find_spec(module) is not None, (name, module)


def test_the_launch_fields_are_declared_once():
    """Every row started by `accelerate launch` has the five launch fields of
    online_rlhf.stage_configs.LAUNCH_FIELDS as declared there (type, default, bounds; a description
    may add to it), and the plan sets them (loop_config.LAUNCH_KEYS)."""
    from typing import get_args

    from online_rlhf.loop_config import LAUNCH_KEYS
    from online_rlhf.stage_configs import LAUNCH_FIELDS

    assert set(LAUNCH_FIELDS) <= set(LAUNCH_KEYS)
    rows = [s for s in STAGES.values() if s.launch_with == "accelerate"]
    assert {s.config.__name__ for s in rows} == {"RewardConfig", "DPOStageConfig", "GRPOStageConfig"}
    for s in rows:
        for name, declared in LAUNCH_FIELDS.items():
            f, (kind, info) = s.config.model_fields[name], get_args(declared)
            assert (f.annotation, f.default, f.metadata) == (kind, info.default, info.metadata), (s.name, name)
            assert info.description in f.description, (s.name, name)


def test_the_dry_run_stages_are_the_rows_with_a_dry_run():
    """One list: the rows with a ``DryRun`` are the loop's dry-run stages, ``DryRunStats.stage``
    names exactly those, and each one's config class has the ``dry_run`` key and advice of its own
    (so a stage over its limit is never left without one)."""
    from typing import get_args

    from online_rlhf.loop.memory_check import DRY_RUN_STAGES, advice
    from online_rlhf.stats import DryRunStats

    rows = [n for n, s in STAGES.items() if s.dry_run is not None]
    assert [n for _, n in DRY_RUN_STAGES] == rows and len(rows) >= 5
    assert set(get_args(DryRunStats.model_fields["stage"].annotation)) == set(rows)
    for n in rows:
        cls = STAGES[n].config
        assert "dry_run" in cls.model_fields and "dry_run_advice" in vars(cls), n
        lines = advice(n, {}, "cuda")
        assert lines and all(line.startswith((STAGES[n].section + ".", "launch_profile=", "lora=")) for line in lines), n


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.section in LOOP_OWNED])
def test_the_plan_owns_the_files_of_every_row_in_its_section(name):
    """A stage's outputs (and inputs, but for a reward model, the one input a section names
    itself) are written by the plan from the run layout: its loop section refuses them."""
    s = STAGES[name]
    owned = set(LOOP_OWNED[s.section])
    assert set(s.outputs) <= owned, (name, set(s.outputs) - owned)
    assert set(s.inputs) - {"reward_model"} <= owned, (name, set(s.inputs) - owned)


def _prompts(path: Path) -> Path:
    write_jsonl(path, [{"id": f"p{i}", "prompt": f"question {i}", "answer": str(i)} for i in range(4)])
    return path


def test_every_row_is_planned_listed_and_launchable(tmp_path, capsys):
    """With every stage on (SFT, KL, IFEval each iteration; DPO and GRPO in turn), the plan writes
    each row's config, ``loop stages`` lists it, and its command starts its entry script."""
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    (tmp_path / "start").mkdir()
    seen = set()
    for algorithm in ("dpo", "grpo"):
        run = loop.plan(None, [f"train_prompts={_prompts(tmp_path / 'train.jsonl')}",
                               f"eval_prompts={_prompts(tmp_path / 'eval.jsonl')}", f"output_root={tmp_path / 'runs'}",
                               f"run_name={algorithm}", f"policy={tmp_path / 'start'}", "iterations=1",
                               f"algorithm={algorithm}", "sft.enabled=true", f"sft.dataset={data}", "kl_samples=1",
                               "ifeval.when=every", "grpo.max_length=1024"])
        for i in (0, 1):
            entries = read_json(run / f"iter_{i}" / "plan.json")
            capsys.readouterr()
            assert loop.main(["stages", str(run), str(i)]) == 0
            listed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()]
            assert listed == list(entries) == [n for n in STAGES if n in entries]  # the table's order
            for name, e in entries.items():
                s = STAGES[name]
                assert Path(e["config"]) == run / f"iter_{i}" / "configs" / f"{name}.yaml" and Path(e["config"]).is_file()
                assert e["env"] == s.env and len(e["outputs"]) == len(s.outputs)
                argv, _ = launch_command(s, e["config"], {}, root=Path("."))
                assert s.entry in argv, (name, argv)
                seen.add(name)
    assert seen == set(STAGES)


def test_the_scripts_go_through_loop_stages_and_the_docs_name_every_stage():
    for script in ("run_loop.sh", "scripts/other_machine.sh"):
        assert "-m online_rlhf.loop stages " in (ROOT / script).read_text(encoding="utf-8"), script
    missing = [name for name in STAGES if not re.search(rf"(?<![\w.]){name}(?!\w)", DOCS)]
    assert not missing, f"stages no page of README.md or docs/ names: {missing}"


# A loop config under which every row builds (SFT on, KL on); seed 7 shows the per-iteration offsets.
_PROSE_BASE = {"seed": 7, "iterations": 3, "kl_samples": 2, "sft": {"enabled": True, "dataset": "/data/sft.jsonl"}}


def _built(name: str, i: int, **overrides) -> dict:
    from online_rlhf.config import apply_overrides

    cfg = LoopConfig.from_dict(apply_overrides(dict(_PROSE_BASE), [f"{k}={v}" for k, v in overrides.items()]))
    return STAGES[name].build(cfg, Path("/run"), i)


def _seed_formula(text: str) -> tuple[int, int]:
    """``+ 1000 x iteration + 500`` -> (1000, 500): seed = loop seed + a x iteration + b."""
    m = re.fullmatch(r"(?:loop key seed )?\+ (?:(\d+) x )?iteration(?: \+ (\d+))?", text.strip())
    assert m, text
    return int(m.group(1) or 1), int(m.group(2) or 0)


@pytest.mark.parametrize("name", list(STAGES))
def test_each_rows_provenance_prose_is_what_its_build_does(name):
    """The comment block of a stage YAML repeats a row's prose (``set_by_plan``, ``seed_offset``):
    each ``set_by_plan`` key is set by the build (following the loop key its origin names, or not
    following the row's own sections when the origin names none), and the seed follows the offset
    the row states (none stated: one seed for every iteration)."""
    s = STAGES[name]
    prose = s.provenance
    d1, d2 = _built(name, 1), _built(name, 2)
    offset = prose.seed_offset or prose.set_by_plan.get("seed")
    seed_key = "training.seed" if "training" in d1 else "seed"
    seeds = [d.get("training", d).get("seed") for d in (d1, d2)]
    if offset:
        a, b = _seed_formula(offset)
        assert seeds == [7 + a + b, 7 + 2 * a + b], (name, seed_key, seeds, offset)
    else:  # no offset stated: the same seed in every iteration (the loop's, or the stage file's: SFT)
        assert seeds[0] == seeds[1], (name, seed_key, seeds)
    for key, origin in prose.set_by_plan.items():
        assert key in d1, (name, key)
        follows = re.match(r"loop key ([\w.]+)", origin)
        if follows and follows.group(1) != "seed":
            loop_key, now = follows.group(1), d1[key]
            other = ("/elsewhere/x.jsonl" if isinstance(now, str) else now + 3 if isinstance(now, int)
                     else round(now / 2, 3))
            assert _built(name, 1, **{loop_key: other})[key] == other, (name, key, loop_key)
        elif not follows:  # fixed by the plan: the row's own sections do not reach it
            for sec in s.sections:
                if key in getattr(LoopConfig.model_fields[sec].annotation, "model_fields", {}):
                    value = d1[key] / 2 if isinstance(d1[key], float) else d1[key]
                    assert _built(name, 1, **{f"{sec}.{key}": value})[key] == d1[key], (name, key, sec)


@pytest.mark.parametrize("entry", sorted({s.entry for s in STAGES.values() if not is_module_entry(s.entry)}))
def test_each_entry_script_shows_its_recipe_as_main_runs_it(entry):
    """An entry script (dpo_iteration/run_dpo.py) lists the steps of its stage's ``main`` and where
    each one's work lives: the functions it names are called by ``main`` in that order, every step
    function of the stage module that ``main`` calls is named, and every file it names exists."""
    import ast

    text = (ROOT / entry).read_text(encoding="utf-8")
    module = re.search(r"^from (online_rlhf\.stages\.\w+) import cli$", text, flags=re.M).group(1)
    listed = re.findall(r"^    (\w+)\(", ast.get_docstring(ast.parse(text)), flags=re.M)
    src = (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
    tree = ast.parse(src)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [c.func.id for c in sorted((c for c in ast.walk(main) if isinstance(c, ast.Call)  # in the order they run
                                        and isinstance(c.func, ast.Name)), key=lambda c: (c.end_lineno, c.end_col_offset))]
    it = iter(calls)
    assert listed and all(name in it for name in listed), (entry, listed, calls)  # in main, in this order
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    steps = [c for c in dict.fromkeys(calls) if c in defined and not c.startswith("_")]
    assert [n for n in listed if n in defined] == steps, (entry, listed, steps)
    for path in re.findall(r"\b((?:online_rlhf|generation)/[\w/]+\.py)\b", text):
        assert (ROOT / path).is_file(), (entry, path)
