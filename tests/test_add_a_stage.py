"""Adding a stage takes its config class, its stats class, its module (its own entry point), its row
of the stage table and its docs page: five files (docs/adding-a-stage.md). This test adds a toy stage
to a copy of the project, touching only those five files, runs ``doc_tables --write`` (which also
rewrites the generated lists of stages in docs/README.md and docs/architecture.md and the loop-key
table of docs/custom.md: no hand edit) and then, in subprocesses, ``doc_tables --check`` and the
docs and stage-table tests (``tests/test_docs.py``, ``tests/test_stage_table.py`` in the copy) and the loop's real commands on it: ``plan`` (its
section typed, its loop-owned keys refused, its YAML written), ``stages``, ``exec`` (the stage reads
its YAML, writes its output and stats), ``mark`` and ``check`` (done and fresh).

A stage that runs a model also has a dry run, and an entry script: six files
(docs/adding-a-stage.md, items 3 and 9). The second test adds such a stage (the toy again, with a
``dry_run`` whose step and advice are its own) and runs it as the loop's dry run does: its
``dry_run=true`` from its planned YAML, and the dry-run report with its config class's advice."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOY_CONFIG = '''

class ToyConfig(StageConfig):
    """online_rlhf.stages.toy: one line per prompt, its id repeated `scale` times."""

    input: str = Field(..., description="the iteration's prompts.jsonl")
    output: str = Field(..., description="toy.jsonl: {id, text}")
    scale: int = Field(1, ge=1, description="how many times each id is repeated")
'''

TOY_STATS = '''

class ToyStats(StageStats):
    """toy's stats (``toy.jsonl.stats.json``): records in and out."""

    WRITTEN_BY: ClassVar[str] = "online_rlhf.stages.toy"
    stage: Literal["toy"]
    records_in: int
    scale: int
'''

TOY_MODULE = '''"""Toy stage: one line per prompt, its id repeated ``scale`` times.

    python -m online_rlhf.stages.toy --config toy.yaml
"""

from online_rlhf.config import run_main
from online_rlhf.jsonl import iter_jsonl, write_jsonl
from online_rlhf.stage_configs import ToyConfig
from online_rlhf.stats import ToyStats, stats_path


def main(cfg: ToyConfig) -> ToyStats:
    """Read ``cfg.input``, write ``cfg.output`` and its stats."""
    rows = [{"id": r["id"], "text": str(r["id"]) * cfg.scale} for _, r in iter_jsonl(cfg.input)]
    write_jsonl(cfg.output, rows)
    stats = ToyStats(stage="toy", records_in=len(rows), scale=cfg.scale)
    stats.write(stats_path(cfg.output))
    return stats


def cli() -> None:
    run_main(main, ToyConfig)


if __name__ == "__main__":
    cli()
'''

TOY_ROW = '''    Stage(name="toy", env="train", entry="online_rlhf.stages.toy", launch_with="python", config=ToyConfig,
          inputs=("input",), outputs=("output",), stats=ToyStats, schedule="1..N", sections=("toy",),
          build=lambda c, run_dir, i: {**section(c, "toy"), "input": str(run_dir / f"iter_{i}" / "prompts.jsonl"),
                                       "output": str(run_dir / f"iter_{i}" / "toy.jsonl")}),
)}'''

TOY_PAGE = '''# The toy stage

`toy` writes one line per prompt.

## Keys

<!-- keys:toy start -->
<!-- keys:toy end -->

## Stats

<!-- stats:toy start -->
<!-- stats:toy end -->
'''


# The same stage as a model stage would be written: a dry run (config key, advice, the stage's own
# dry_run, its name in DryRunStats.stage, the row's DryRun) and an entry script showing its recipe.
TOY_DRY_CONFIG = TOY_CONFIG.replace('''"""online_rlhf.stages.toy:''', '''"""annotate_data/toy.py:''') + '''    dry_run: bool = Field(False, description="memory check instead of the stage: one row of `scale` ids, and only <output>.dry_run.json written")

    @classmethod
    def dry_run_advice(cls, settings: dict, device: str, prefix: str) -> list[str]:
        """The one setting that sizes the step."""
        return [f"{prefix}scale (now {settings.get('scale')}): ids per row"]
'''

TOY_DRY_MODULE = '''"""Toy stage with a dry run: one line per prompt, its id repeated ``scale`` times.

    python annotate_data/toy.py --config toy.yaml
"""

import time

from online_rlhf.config import run_main
from online_rlhf.dry_run import exit_if_out_of_memory, finish
from online_rlhf.jsonl import iter_jsonl, write_jsonl
from online_rlhf.memory import PeakMemory
from online_rlhf.stage_configs import ToyConfig
from online_rlhf.stats import ToyStats, stats_path


def read_rows(cfg: ToyConfig) -> list[dict]:
    """Step 1: one row per prompt."""
    return [{"id": r["id"], "text": str(r["id"]) * cfg.scale} for _, r in iter_jsonl(cfg.input)]


def write_stats(cfg: ToyConfig, rows: list[dict]) -> ToyStats:
    """Step 2: the stats beside the output."""
    stats = ToyStats(stage="toy", records_in=len(rows), scale=cfg.scale)
    stats.write(stats_path(cfg.output))
    return stats


def dry_run(cfg: ToyConfig):
    """The set-up and one step at the largest shape: one row of ``scale`` ids; only the result is written."""
    t_start = time.perf_counter()
    with PeakMemory("cpu") as mem:
        t0 = time.perf_counter()
        row = "x" * cfg.scale
        step_s = time.perf_counter() - t0
    result = finish("toy", mem, cfg.output, status="ok", error=None, step_s=step_s, step=f"1 row of {len(row)} ids",
                    shapes={"ids": cfg.scale}, settings={"scale": cfg.scale}, t_start=t_start, gather=False)
    exit_if_out_of_memory("toy", "ok", None)
    return result


def main(cfg: ToyConfig):
    """Read ``cfg.input``, write ``cfg.output`` and its stats (``dry_run``: :func:`dry_run` instead)."""
    if cfg.dry_run:
        return dry_run(cfg)
    rows = read_rows(cfg)
    write_jsonl(cfg.output, rows)
    return write_stats(cfg, rows)


def cli() -> None:
    run_main(main, ToyConfig)


if __name__ == "__main__":
    cli()
'''

TOY_DRY_SCRIPT = '''"""Toy stage with a dry run: one line per prompt, its id repeated ``scale`` times.

    python annotate_data/toy.py --config toy.yaml

The recipe is ``main`` of online_rlhf/stages/toy.py, in this order, and where each step's work lives:

    dry_run(cfg)               dry_run=true, instead: one row at the largest shape
    read_rows(cfg)             1. one row per prompt
    write_stats(cfg, rows)     2. toy.jsonl's stats (online_rlhf/stats.py)
"""

from online_rlhf.stages.toy import cli

if __name__ == "__main__":
    cli()
'''

TOY_DRY_ROW = TOY_ROW.replace('entry="online_rlhf.stages.toy"', 'entry="annotate_data/toy.py"').replace(
    'sections=("toy",),', 'sections=("toy",), dry_run=DryRun(iteration=1),')

# The files `python -m online_rlhf.doc_tables --write` rewrites beyond the stage's own page, in
# generated sections only, never a hand-written line: the lists of stages of docs/README.md and
# docs/architecture.md (`<!-- index:... -->`) and the loop-key table of docs/custom.md
# (`<!-- keys:loop -->`, which gains the stage's loop section).
GENERATED = {"docs/README.md", "docs/architecture.md", "docs/custom.md"}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new), encoding="utf-8")


def _copy_project(dst: Path) -> None:
    """Every tracked file (the docs tests read the scripts, tests and benches too), and the train env."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    for link in (".venv-train", ".cache"):
        if (ROOT / link).exists():
            (dst / link).symlink_to((ROOT / link).resolve())


def _add_toy_stage(proj: Path, dry_run: bool = False) -> set[str]:
    """The files a new stage touches (five; six with a dry run and an entry script); returns their paths."""
    pkg = proj / "online_rlhf"
    with open(pkg / "stage_configs.py", "a", encoding="utf-8") as f:
        f.write(TOY_DRY_CONFIG if dry_run else TOY_CONFIG)
    with open(pkg / "stats.py", "a", encoding="utf-8") as f:
        f.write(TOY_STATS)
    (pkg / "stages" / "toy.py").write_text(TOY_DRY_MODULE if dry_run else TOY_MODULE, encoding="utf-8")
    touched = {"online_rlhf/stage_configs.py", "online_rlhf/stats.py", "online_rlhf/stages/toy.py",
               "online_rlhf/stage_table.py", "docs/toy.md"}
    if dry_run:
        _edit(pkg / "stats.py", 'stage: Literal["dpo", "grpo", "sft", "generate", "rewards"]',
              'stage: Literal["dpo", "grpo", "sft", "generate", "rewards", "toy"]')
        (proj / "annotate_data" / "toy.py").write_text(TOY_DRY_SCRIPT, encoding="utf-8")
        touched.add("annotate_data/toy.py")
    table = pkg / "stage_table.py"
    _edit(table, "RewardConfig, SFTStageConfig, StageConfig)", "RewardConfig, SFTStageConfig, StageConfig, ToyConfig)")
    _edit(table, "StageStats, stats_path)", "StageStats, ToyStats, stats_path)")
    text = table.read_text(encoding="utf-8")
    end = text.index("\n)}\n", text.index("STAGES: dict[str, Stage]"))
    table.write_text(text[:end] + "\n" + (TOY_DRY_ROW if dry_run else TOY_ROW) + text[end + 3:], encoding="utf-8")
    (proj / "docs" / "toy.md").write_text(TOY_PAGE, encoding="utf-8")
    return touched


def _run(proj: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(proj)}
    p = subprocess.run([sys.executable, *args], cwd=proj, env=env, capture_output=True, text=True)
    if check:
        assert p.returncode == 0, (args, p.stdout[-2000:], p.stderr[-4000:])
    return p


def _changed(proj: Path) -> set[str]:
    """The files of the copy that differ from the project's, or are new (caches and envs aside)."""
    return {str(p.relative_to(proj)) for p in proj.rglob("*") if p.is_file() and not p.is_symlink()
            and not {".venv-train", ".cache", "__pycache__", ".pytest_cache"} & set(p.parts)
            and (not (ROOT / p.relative_to(proj)).is_file()
                 or (ROOT / p.relative_to(proj)).read_bytes() != p.read_bytes())}


def test_a_toy_stage_in_five_files_is_planned_run_and_marked(tmp_path):
    proj = tmp_path / "proj"
    _copy_project(proj)
    touched = _add_toy_stage(proj)
    assert len(touched) == 5
    assert _changed(proj) == touched

    # its page's tables and the lists of stages are generated, and then agree with their sources
    stale = _run(proj, "-m", "online_rlhf.doc_tables", "--check", check=False)
    assert stale.returncode == 1 and "index:stage_pages" in stale.stderr and "keys:toy" in stale.stderr
    _run(proj, "-m", "online_rlhf.doc_tables", "--write")
    assert _changed(proj) == touched | GENERATED, _changed(proj)
    _run(proj, "-m", "online_rlhf.doc_tables", "--check")
    page = (proj / "docs" / "toy.md").read_text(encoding="utf-8")
    assert "| `scale` | int | `1` | `toy.scale` |" in page and "| `output` | str | required | the plan |" in page
    assert "- [toy.md](toy.md): `toy`" in (proj / "docs" / "README.md").read_text(encoding="utf-8")
    arch = (proj / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "| `toy` | train | 1..N | - | [toy.md](toy.md) |" in arch and "| `ToyStats` |" in arch

    # the docs and stage-table tests pass in the copy as they are (index links, stage list, stats
    # classes, tables; every row against every consumer, the module entry included)
    docs = _run(proj, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py", "tests/test_stage_table.py",
                check=False)
    assert docs.returncode == 0 and " passed" in docs.stdout, docs.stdout[-4000:]

    # its loop section is typed by its config class: a misspelt key and a loop-owned key are refused
    base = ["-m", "online_rlhf.loop", "plan", "configs/loop.yaml", f"output_root={tmp_path / 'runs'}",
            "iterations=1", "kl_samples=0", "ifeval.when=never"]
    bad = _run(proj, *base, "toy.scael=2", "toy.output=x.jsonl", check=False)
    assert bad.returncode != 0 and "toy.scael" in bad.stderr and "toy.output: cannot be set here" in bad.stderr

    _run(proj, *base, "toy.scale=3")
    run = tmp_path / "runs" / "default"
    stages = _run(proj, "-m", "online_rlhf.loop", "stages", str(run), "1").stdout.split()
    assert "toy" in stages
    yaml_text = (run / "iter_1" / "configs" / "toy.yaml").read_text(encoding="utf-8")
    assert "scale: 3" in yaml_text and "-m online_rlhf.stages.toy --config" in yaml_text

    # exec -> mark -> check: the loop's own cycle
    assert _run(proj, "-m", "online_rlhf.loop", "check", str(run), "1", "toy", check=False).returncode == 1
    _run(proj, "-m", "online_rlhf.loop", "exec", str(run), "1", "toy")
    out = run / "iter_1" / "toy.jsonl"
    prompts = (run / "iter_1" / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(prompts) > 0
    assert '"scale": 3' in (run / "iter_1" / "toy.jsonl.stats.json").read_text(encoding="utf-8")
    _run(proj, "-m", "online_rlhf.loop", "mark", str(run), "1", "toy", "1.0")
    assert _run(proj, "-m", "online_rlhf.loop", "check", str(run), "1", "toy", check=False).returncode == 0


def test_a_toy_model_stage_with_a_dry_run_in_six_files(tmp_path):
    proj = tmp_path / "proj"
    _copy_project(proj)
    touched = _add_toy_stage(proj, dry_run=True)
    assert len(touched) == 6 and "annotate_data/toy.py" in touched
    assert _changed(proj) == touched
    _run(proj, "-m", "online_rlhf.doc_tables", "--write")
    assert _changed(proj) == touched | GENERATED, _changed(proj)
    # the docs and stage-table tests of the copy pass: among them, DryRunStats.stage against the rows
    # with a dry run, the toy's own advice, and its entry script's recipe against its main
    checks = _run(proj, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs.py", "tests/test_stage_table.py",
                  check=False)
    assert checks.returncode == 0 and " passed" in checks.stdout, checks.stdout[-4000:]

    # its dry_run key is the loop's (dry_run=true at the top level), not the section's
    base = ["-m", "online_rlhf.loop", "plan", "configs/loop.yaml", f"output_root={tmp_path / 'runs'}",
            "iterations=1", "kl_samples=0", "ifeval.when=never"]
    bad = _run(proj, *base, "toy.dry_run=true", check=False)
    assert bad.returncode != 0 and "toy.dry_run: cannot be set here; set dry_run=true at the top level" in bad.stderr
    _run(proj, *base, "toy.scale=3")
    run = tmp_path / "runs" / "default"
    yaml_text = (run / "iter_1" / "configs" / "toy.yaml").read_text(encoding="utf-8")
    assert "annotate_data/toy.py --config" in yaml_text and "dry_run: false" in yaml_text

    # the loop's dry run of it: its planned YAML with dry_run=true (memory_check runs exactly this
    # command), only <output>.dry_run.json written; then the report names its advice under its section
    _run(proj, "-m", "online_rlhf.loop", "exec", str(run), "1", "toy", "dry_run=true")
    out = run / "iter_1" / "toy.jsonl"
    assert (run / "iter_1" / "toy.jsonl.dry_run.json").is_file() and not out.exists()
    report = _run(proj, "-c", (
        "import sys; from online_rlhf.dry_run import dry_run_path; from online_rlhf.stats import DryRunStats\n"
        "from online_rlhf.loop.memory_check import DRY_RUN_STAGES, Row, report\n"
        f"r = DryRunStats.read(dry_run_path({str(out)!r}))\n"
        "assert (1, 'toy') in DRY_RUN_STAGES and r.stage == 'toy' and r.settings == {'scale': 3}\n"
        "over = r.model_copy(update={'memory_limit_gib': 0.001, 'peak_memory_gib': 1.0})\n"
        "text, code = report([Row('toy', 1, result=over)])\n"
        "print(code); print(text)\n"))
    assert report.stdout.startswith("1\n") and "DOES NOT FIT: toy" in report.stdout
    assert "  - toy.scale (now 3): ids per row" in report.stdout
