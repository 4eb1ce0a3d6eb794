"""A stage output changed after its stage finished reruns that stage (issue 24, item 3).

The report's case: after a finished run, ``iter_1/pairs.jsonl`` is cut (at a line boundary, or
mid-line) and the run is resumed. Before, the pairs stage stayed "done earlier, skipped" (its
``.done`` covered config and inputs only) and DPO trained on what was left. Now ``.done`` records
each output's size and sha256, the stage runs again and ``loop check`` says why in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from online_rlhf import loop
from online_rlhf.loop import freshness
from online_rlhf.jsonl import read_json, write_jsonl
from online_rlhf.stats import PairsStats, stats_path
from online_rlhf.testing import example_stats


@pytest.fixture
def done_pairs(tmp_path):
    """A planned run whose iteration-1 pairs stage finished with 4 pairs and is marked done."""
    train = tmp_path / "train.jsonl"
    write_jsonl(train, [{"id": f"p{j}", "prompt": f"question {j}", "answer": str(j)} for j in range(6)])
    policy = tmp_path / "models" / "start"
    policy.mkdir(parents=True)
    args = [f"train_prompts={train}", f"eval_prompts={train}", f"output_root={tmp_path / 'runs'}", "run_name=t",
            f"policy={policy}", "iterations=1"]
    run_dir = loop.plan(None, args)
    it = run_dir / "iter_1"
    write_jsonl(it / "rewards.jsonl", [{"id": "p0"}])
    pairs = [{"id": f"p{j}", "prompt": [{"role": "user", "content": f"question {j}"}],
              "chosen": [{"role": "assistant", "content": "yes"}],
              "rejected": [{"role": "assistant", "content": "no"}]} for j in range(4)]
    write_jsonl(it / "pairs.jsonl", pairs)
    example_stats(PairsStats, pairs_out=4).write(stats_path(it / "pairs.jsonl"))
    loop.mark(run_dir, 1, "pairs", 1.0)
    assert loop.check(run_dir, 1, "pairs")
    return run_dir, it / "pairs.jsonl"


def _cut(path: Path, at_line_boundary: bool) -> None:
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) if at_line_boundary else data[:len(lines[0]) + len(lines[1]) // 2])


@pytest.mark.parametrize("at_line_boundary", [True, False])
def test_a_cut_output_makes_its_stage_run_again_saying_why(done_pairs, at_line_boundary, capsys):
    run_dir, pairs = done_pairs
    before = pairs.stat().st_size
    _cut(pairs, at_line_boundary)
    assert not loop.check(run_dir, 1, "pairs")
    why = loop.stale_reason(run_dir, 1, "pairs")
    assert why == f"its output changed after the stage finished (<root>/iter_1/pairs.jsonl: {before} -> " \
                  f"{pairs.stat().st_size} bytes)"
    # the loop's check command: exit 1, the env, then the reason (run_loop.sh prints it as "runs again: ...")
    assert loop.main(["check", str(run_dir), "1", "pairs"]) == 1
    assert capsys.readouterr().out.splitlines() == ["train", why]
    # the hint for a stage that then fails on the file: regenerate it, do not edit it
    hint = loop.output_hint(run_dir, f"{pairs}:3: not valid JSON (Unterminated string)")
    assert hint.startswith(f"{pairs} is the output of stage pairs of iteration 1; do not edit it by hand: rerun the "
                           "same command: stage pairs runs again first (its output changed")


def test_same_size_edit_and_stats_edit_are_seen_too(done_pairs):
    run_dir, pairs = done_pairs
    text = pairs.read_text()
    pairs.write_text(text.replace('"yes"', '"yep"', 1).replace('"no"', '"nn"', 1))
    assert "same size, other content" in loop.stale_reason(run_dir, 1, "pairs")
    pairs.write_text(text)  # restored byte for byte: fresh again
    assert loop.check(run_dir, 1, "pairs")
    st = stats_path(pairs)
    st.write_text(st.read_text().replace('"pairs_out": 4', '"pairs_out": 5'))
    assert "pairs.jsonl.stats.json" in loop.stale_reason(run_dir, 1, "pairs")
    st.write_text(st.read_text().replace('"pairs_out": 5', '"pairs_out": "many"'))
    why = loop.stale_reason(run_dir, 1, "pairs")  # a stats file its class refuses: the reason says why
    assert why.startswith(f"its stats file {st} is not valid (") and "'pairs_out'" in why


def test_done_records_size_and_hash_and_a_marker_without_them_is_still_read(done_pairs):
    run_dir, pairs = done_pairs
    marker = run_dir / "iter_1" / "pairs.done"
    rec = read_json(marker)["outputs"]
    assert rec["<root>/iter_1/pairs.jsonl"]["bytes"] == pairs.stat().st_size
    assert len(rec["<root>/iter_1/pairs.jsonl"]["sha256"]) == 64
    old = read_json(marker)
    del old["outputs"]  # a .done written before outputs were recorded: nothing to compare, stays fresh
    marker.write_text(json.dumps(old))
    _cut(pairs, True)
    assert loop.check(run_dir, 1, "pairs")


def test_reasons_for_a_stage_never_run_or_with_changed_inputs(done_pairs):
    run_dir, _ = done_pairs
    assert loop.stale_reason(run_dir, 1, "dpo") == "not run yet"
    write_jsonl(run_dir / "iter_1" / "rewards.jsonl", [{"id": "p1"}])
    rewards = run_dir / "iter_1" / "rewards.jsonl"
    assert loop.stale_reason(run_dir, 1, "pairs") == ("its config or inputs changed since it finished "
                                                      f"(input {rewards} changed)")
    assert loop.output_hint(run_dir, "some error naming no run file") is None
    assert loop.output_hint(run_dir, f"{run_dir}/iter_1/pairs.jsonl: 0 pairs") is None  # no line: not its content


def test_a_changed_key_is_named_and_an_old_marker_keeps_the_plain_reason(done_pairs):
    """``.done`` keeps the config values and one digest per input, so the reason names the key with
    its old and new value; a marker written before that record gives the reason without the list."""
    run_dir, _ = done_pairs
    config = Path(freshness.stage_entry(run_dir, 1, "pairs")["config"])
    text = config.read_text()
    assert "\nmin_margin: " in text  # a top-level key of the pairs stage YAML
    changed = "\n".join("min_margin: 0.25" if line.startswith("min_margin: ") else line for line in text.splitlines())
    config.write_text(changed + "\nextra_key: 1\n")
    why = loop.stale_reason(run_dir, 1, "pairs")
    assert why.startswith("its config or inputs changed since it finished (")
    assert "min_margin: 0.0 -> 0.25" in why and "extra_key: (unset) -> 1" in why
    # the same number written otherwise hashes apart, so it is named too
    config.write_text(text.replace("\nmin_margin: 0.0", "\nmin_margin: 0"))
    assert loop.stale_reason(run_dir, 1, "pairs").endswith("(min_margin: 0.0 -> 0)")
    # many changes: four in full, the rest by name
    many = "".join(f"extra_{j}: {j}\n" for j in range(6))
    config.write_text(text + many)
    assert loop.stale_reason(run_dir, 1, "pairs").endswith("; and 2 more: extra_4, extra_5)")
    rewards = run_dir / "iter_1" / "rewards.jsonl"
    saved = rewards.read_bytes()
    rewards.unlink()
    config.write_text(text)
    assert loop.stale_reason(run_dir, 1, "pairs").endswith(f"(input {rewards} is missing)")
    rewards.write_bytes(saved)
    config.write_text(changed + "\nextra_key: 1\n")
    marker = run_dir / "iter_1" / "pairs.done"
    old = read_json(marker)
    del old["config"], old["input_digests"]
    marker.write_text(json.dumps(old))
    assert loop.stale_reason(run_dir, 1, "pairs") == "its config or inputs changed since it finished"
    config.write_text(text)
    assert loop.check(run_dir, 1, "pairs")


def test_mark_refuses_stats_its_stage_class_does_not_read(done_pairs):
    # marking such a stage done would only make the next check rerun it: refuse, and keep the old marker
    run_dir, pairs = done_pairs
    marker = run_dir / "iter_1" / "pairs.done"
    before = marker.read_bytes()
    st = stats_path(pairs)
    st.write_text(st.read_text().replace('"pairs_out": 4', '"pairs_out": "many"'))
    with pytest.raises(loop.ConfigError) as e:
        loop.mark(run_dir, 1, "pairs", 2.0)
    msg = str(e.value)
    assert str(st) in msg and "'pairs_out'" in msg and "Nothing was marked." in msg
    assert f"online_rlhf.loop exec {run_dir} 1 pairs" in msg
    assert marker.read_bytes() == before
