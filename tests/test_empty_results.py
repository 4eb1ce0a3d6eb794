"""Stages that made nothing fail instead of exiting 0 (issue 24, item 6): get_rewards on an input
without records, make_pairs when no prompt gives a pair (it still writes the empty output and the
stats, and says why and what to change)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from online_rlhf.jsonl import write_jsonl
from online_rlhf.stats import PairsStats, stats_path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_get_rewards_on_an_empty_input_exits_2_naming_it(tmp_path):
    src = tmp_path / "generated.jsonl"
    src.write_text("\n")
    r = _run("annotate_data/get_rewards.py", f"input={src}", f"output={tmp_path / 'rewards.jsonl'}")
    assert r.returncode == 2, r.stderr
    assert f"error: {src}: no generated record to score (1 blank lines)" in r.stderr
    assert not (tmp_path / "rewards.jsonl").exists()


def test_make_pairs_with_no_pair_exits_2_saying_why_after_writing_the_stats(tmp_path):
    src = tmp_path / "rewards.jsonl"
    # every prompt's K responses tie: no pair
    write_jsonl(src, [{"id": f"p{j}", "prompt": [{"role": "user", "content": "q"}], "responses": ["a", "b"],
                       "finish_reasons": ["stop", "stop"], "response_tokens": [1, 1], "rewards": [1.0, 1.0],
                       "reward_source": "verifier"} for j in range(3)])
    out = tmp_path / "pairs.jsonl"
    r = _run("annotate_data/make_pairs.py", f"input={src}", f"output={out}")
    assert r.returncode == 2, r.stderr
    assert f"error: {src}: 0 pairs from 3 prompts" in r.stderr and "Why: " in r.stderr and "Change: " in r.stderr
    assert out.read_text() == "" and PairsStats.read(stats_path(out)).pairs_out == 0
