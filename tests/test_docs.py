"""README and config comments that state facts the code decides: checked against the code."""

from __future__ import annotations

import re
from pathlib import Path

from online_rlhf import stats
from online_rlhf.stage_table import STAGES, launch_command

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_lists_every_stats_class():
    """Every class of a stage's stats file (not the dry run's record, which is no stats file)."""
    classes = {name for name, c in vars(stats).items() if isinstance(c, type) and issubclass(c, stats.StageStats)
               and c is not stats.StageStats and not name.startswith("_") and c is not stats.DryRunStats}
    listed = re.search(r"model in `online_rlhf/stats\.py` \(([^)]*)\)", README).group(1)
    assert classes - set(re.findall(r"`(\w+)`", listed)) == set()


def test_cpu_accelerate_profile_comment_matches_the_multi_process_launch():
    argv, env = launch_command(STAGES["dpo"], "c.yaml", {"num_processes": 2, "launch_profile": "cpu"})
    assert env == {"ACCELERATE_USE_CPU": "true"} and "--multi_gpu" in argv and "--config_file" not in argv
    comment = (ROOT / "configs" / "accelerate" / "cpu.yaml").read_text(encoding="utf-8")
    assert "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N" in comment
    assert "This profile is one process" not in comment


def test_readme_run_directory_does_not_promise_an_iter_0_prompts_file():
    line = next(ln for ln in README.splitlines() if ln.startswith("runs/<name>/iter_<i>/prompts.jsonl"))
    assert "iter_0 has none" in line
