"""The docs (README.md and docs/*.md) and config comments that state facts the code decides:
checked against the code. The stage pages' key and stats tables are generated from their classes
(``python -m online_rlhf.doc_tables --write``); these tests fail when a page and its class disagree."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from online_rlhf import doc_tables, stats
from online_rlhf.stage_launch import launch_command
from online_rlhf.stage_table import STAGES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# ------------------------------------------------------------------------------ generated tables

def test_every_stage_of_the_stage_table_has_a_page_that_names_it():
    pages = doc_tables.stage_pages()
    assert set(STAGES) - set(pages) == set(), "stages without a docs page (add one to doc_tables.PAGES)"
    assert set(pages) - set(STAGES) == set(), "pages for stages that are not in the stage table"
    for stage, page in pages.items():
        assert f"`{stage}`" in (ROOT / page).read_text(encoding="utf-8"), f"{page} does not name stage {stage}"


def test_every_stage_page_has_its_config_and_stats_tables():
    for page in doc_tables.PAGES:
        for stage in page.stages:
            kinds = {(t.kind, t.cls) for t in page.tables}
            assert ("keys", STAGES[stage].config) in kinds, f"{page.path}: no key table of {STAGES[stage].config.__name__}"
            assert ("stats", STAGES[stage].stats) in kinds, f"{page.path}: no stats table of {STAGES[stage].stats.__name__}"


def test_key_and_stats_tables_agree_with_their_classes():
    assert doc_tables.check() == []


def test_the_check_fails_when_a_table_and_its_class_disagree(tmp_path):
    for path in {*(page.path for page in doc_tables.PAGES), *(index.path for index in doc_tables.INDEXES)}:
        dst = tmp_path / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((ROOT / path).read_text(encoding="utf-8"), encoding="utf-8")
    dpo = tmp_path / "docs" / "dpo.md"
    dpo.write_text(dpo.read_text(encoding="utf-8").replace("| `train_batch_size` |", "| `train_batchsize` |"),
                   encoding="utf-8")
    assert any("keys:dpo" in p for p in doc_tables.check(tmp_path))
    assert doc_tables.write(tmp_path) == ["docs/dpo.md"] and doc_tables.check(tmp_path) == []
    dpo.write_text(dpo.read_text(encoding="utf-8").replace("<!-- stats:dpo end -->", ""), encoding="utf-8")
    assert any("stats:dpo end" in p for p in doc_tables.check(tmp_path))


def test_the_check_fails_when_a_list_of_stages_and_the_stage_table_disagree(tmp_path):
    for path in {*(page.path for page in doc_tables.PAGES), *(index.path for index in doc_tables.INDEXES)}:
        dst = tmp_path / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((ROOT / path).read_text(encoding="utf-8"), encoding="utf-8")
    index = tmp_path / "docs" / "README.md"
    index.write_text(index.read_text(encoding="utf-8").replace("- [kl.md](kl.md): `kl`\n", ""), encoding="utf-8")
    arch = tmp_path / "docs" / "architecture.md"
    arch.write_text(arch.read_text(encoding="utf-8").replace("| `KLStats` |", "| `KLStat` |"), encoding="utf-8")
    problems = doc_tables.check(tmp_path)
    assert any("index:stage_pages" in p for p in problems) and any("index:stats_classes" in p for p in problems)
    assert sorted(doc_tables.write(tmp_path)) == ["docs/README.md", "docs/architecture.md"]
    assert doc_tables.check(tmp_path) == []


def test_the_stage_list_says_when_each_stage_runs():
    text = doc_tables.render_stage_list("docs/architecture.md")
    assert "| `dpo` | train | 1..N | `algorithm: dpo` | [dpo.md](dpo.md) |" in text
    assert "| `eval_generate` | infer | 0..N | - | [generation.md](generation.md) |" in text
    assert "| `ifeval_score` | train | `ifeval.when`: 0 and N (`ends`)" in text


def test_a_table_lists_every_field_with_its_default_and_loop_key():
    text = doc_tables.render(doc_tables.Table("dpo", "keys", STAGES["dpo"].config, ("dpo",)))
    for name in STAGES["dpo"].config.model_fields:
        assert f"| `{name}` |" in text
    assert "| `beta`" not in text  # TRL's DPOConfig keys are described, not enumerated
    assert "| `training` | mapping | `{}` | `dpo.training` |" in text
    assert "| `output_dir` | str | required | the plan |" in text
    kl = doc_tables.render(doc_tables.Table("kl", "keys", STAGES["kl"].config, stage="kl"))
    assert "| `batch_size` | int | `8` | - |" in kl and "| `policy` | str | required | the plan |" in kl


# ------------------------------------------------------------------------------------ links

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_points_to_an_existing_file_and_heading():
    bad = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert bad == []


def test_link_and_anchor_parsing():
    assert _slug("Resume and `--fresh`") == "resume-and---fresh"
    assert _LINK.findall("see [a](docs/x.md#y) and ![img](p.png)") == ["docs/x.md#y"]


def test_docs_index_links_every_page():
    index = _page("README.md")
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


# ------------------------------------------------------------------------------------ README

def test_readme_is_short_and_holds_the_two_commands():
    assert len(README.encode("utf-8")) <= 12 * 1024
    assert "bash run_loop.sh            # the main job" in README
    assert "bash scripts/run_tests.sh   # the tests" in README


def test_readme_stage_yaml_header_is_what_the_plan_writes(tmp_path, monkeypatch):
    """The example header of README "Change one thing" against a real plan of the same command
    (prompts from a small file, 2 cores, IFEval off: the plan would need the prepared IFEval set)."""
    from online_rlhf import loop
    from online_rlhf.hardware import usable_cores
    from online_rlhf.jsonl import write_jsonl

    if usable_cores() < 2:
        pytest.skip("the README's example is of a 2-core machine")
    monkeypatch.setenv("ONLINE_RLHF_CORES", "2")
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, [{"id": f"p{i}", "prompt": f"question {i}", "answer": str(i)} for i in range(8)])
    run_dir = loop.plan(str(ROOT / "configs" / "loop.yaml"), [
        f"train_prompts={prompts}", f"eval_prompts={prompts}", f"output_root={tmp_path / 'runs'}", "ifeval.when=never",
        "dpo.training.beta=0.05"], shell_out=io.StringIO())
    written = (run_dir / "iter_1" / "configs" / "dpo.yaml").read_text(encoding="utf-8").splitlines()
    block = re.search(r"```\n(# Stage dpo of iteration 1.*?)```", README, re.S).group(1).splitlines()
    assert block[0].startswith("# Stage dpo of iteration 1, resolved by `python -m online_rlhf.loop plan` from ")
    assert written[0].startswith(block[0].split(" from ")[0])
    example_root = "/home/me/online-rlhf/runs/"
    for line in block[1:]:
        if line.strip() in ("#   ...", "#"):
            continue
        assert line.replace(example_root, f"{tmp_path / 'runs'}/") in written, f"not in the plan's header: {line}"


# ------------------------------------------------------------------------ facts on the pages

def test_architecture_lists_every_stats_class():
    """Every class of a stage's stats file (not the dry run's record, which is no stats file), in the
    list doc_tables generates: a stats class that no stage page documents is missing from it."""
    classes = {name for name, c in vars(stats).items() if isinstance(c, type) and issubclass(c, stats.StageStats)
               and c is not stats.StageStats and not name.startswith("_") and c is not stats.DryRunStats}
    listed = re.search(r"<!-- index:stats_classes start -->(.*?)<!-- index:stats_classes end -->",
                       _page("architecture.md"), re.S).group(1)
    assert classes - set(re.findall(r"^\| `(\w+)` \|", listed, flags=re.M)) == set()


def test_architecture_stage_list_is_the_stage_table():
    rows = re.findall(r"^\| `(\w+)` \| (infer|train) \|", _page("architecture.md"), flags=re.M)
    assert [name for name, _ in rows] == list(STAGES)
    assert all(STAGES[name].env == env for name, env in rows)


def test_cpu_accelerate_profile_comment_matches_the_multi_process_launch():
    argv, env = launch_command(STAGES["dpo"], "c.yaml", {"num_processes": 2, "launch_profile": "cpu"})
    assert env == {"ACCELERATE_USE_CPU": "true"} and "--multi_gpu" in argv and "--config_file" not in argv
    comment = (ROOT / "configs" / "accelerate" / "cpu.yaml").read_text(encoding="utf-8")
    assert "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N" in comment
    assert "This profile is one process" not in comment


def test_run_directory_page_does_not_promise_an_iter_0_prompts_file():
    line = next(ln for ln in _page("run-directory.md").splitlines() if ln.startswith("runs/<name>/iter_<i>/prompts.jsonl"))
    assert "iter_0 has none" in line


def test_no_page_points_at_readme_sections_that_moved():
    """The README's old sections live in docs/ now: nothing in the code or configs names them."""
    old = re.compile(r"README[^\n]{0,8}(Multi-node|Dry run|GRPO|Evaluation|Performance|Run directory)")
    hits = [f"{p.relative_to(ROOT)}" for d in ("online_rlhf", "scripts", "configs", "tests", "bench")
            for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".sbatch")
            and old.search(p.read_text(encoding="utf-8", errors="replace"))]
    hits += [name for name in ("run_loop.sh",) if old.search((ROOT / name).read_text(encoding="utf-8"))]
    assert hits == []
