"""``run_loop.sh --fresh`` with a config the plan refuses leaves the old run as it was (issue 24,
item 6): before, the old run was emptied first and the plan failed after."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from online_rlhf import loop

ROOT = Path(__file__).resolve().parent.parent


def test_fresh_with_a_bad_prompt_file_keeps_the_old_run(tmp_path):
    good, bad = tmp_path / "train.jsonl", tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(4)))
    bad.write_text('{"id": "p0", "prompt": "q0", "answer": "0"}\n{"id": "p1", "prompt": \n')  # line 2 cut mid-way
    (tmp_path / "pol").mkdir()
    args = [f"eval_prompts={good}", f"output_root={tmp_path / 'runs'}", "run_name=t", f"policy={tmp_path / 'pol'}",
            "iterations=1"]
    run = loop.plan(None, [f"train_prompts={good}", *args])
    (run / "iter_1" / "generate.done").write_text("{}")  # the old run's work
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    r = subprocess.run(["bash", "run_loop.sh", "--fresh", f"train_prompts={bad}", *args], cwd=ROOT, timeout=600,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0
    assert f"{bad}:2" in r.stderr, r.stderr[-2000:]
    assert "removing the contents" not in r.stdout
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing removed
