"""Adding a stage takes its config class, its stats class, its module (its own entry point), its row
of the stage table and its docs page: five files (docs/adding-a-stage.md). This test adds a toy stage
to a copy of the project, touching only those five files, runs ``doc_tables --write`` (which also
rewrites the generated lists of stages in docs/README.md and docs/architecture.md and the loop-key
table of docs/custom.md: no hand edit) and then, in subprocesses, ``doc_tables --check`` and the
docs and stage-table tests (``tests/test_docs.py``, ``tests/test_stage_table.py`` in the copy) and the loop's real commands on it: ``plan`` (its
section typed, its loop-owned keys refused, its YAML written), ``stages``, ``exec`` (the stage reads
its YAML, writes its output and stats), ``mark`` and ``check`` (done and fresh)."""

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


def _add_toy_stage(proj: Path) -> set[str]:
    """The five files a new stage touches; returns their paths."""
    pkg = proj / "online_rlhf"
    with open(pkg / "stage_configs.py", "a", encoding="utf-8") as f:
        f.write(TOY_CONFIG)
    with open(pkg / "stats.py", "a", encoding="utf-8") as f:
        f.write(TOY_STATS)
    (pkg / "stages" / "toy.py").write_text(TOY_MODULE, encoding="utf-8")
    table = pkg / "stage_table.py"
    _edit(table, "RewardConfig, SFTStageConfig, StageConfig)", "RewardConfig, SFTStageConfig, StageConfig, ToyConfig)")
    _edit(table, "StageStats, stats_path)", "StageStats, ToyStats, stats_path)")
    text = table.read_text(encoding="utf-8")
    end = text.index("\n)}\n", text.index("STAGES: dict[str, Stage]"))
    table.write_text(text[:end] + "\n" + TOY_ROW + text[end + 3:], encoding="utf-8")
    (proj / "docs" / "toy.md").write_text(TOY_PAGE, encoding="utf-8")
    return {"online_rlhf/stage_configs.py", "online_rlhf/stats.py", "online_rlhf/stages/toy.py",
            "online_rlhf/stage_table.py", "docs/toy.md"}


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
