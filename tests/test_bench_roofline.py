"""bench/roofline.py on a synthetic run directory, and the token counts the stages record for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import roofline as rl
from online_rlhf.stages.dpo_data import check_lengths
from online_rlhf.stats import DPOStats, GenerateStats, KLStats
from online_rlhf.testing import example_stats

N = 100_000_000  # parameters of the made-up policy
_REAL_PARAMETER_COUNT = rl.parameter_count  # before the fixture below replaces it
BF16_HW = {"device": "cpu", "dtype": "float32 + bf16 autocast", "threads": 1, "processes": 2,
           "cpu_model": "test CPU", "cpu_capability": "AVX512", "cpu_native_bf16": True}


@pytest.fixture(autouse=True)
def _params(monkeypatch):
    monkeypatch.setattr(rl, "parameter_count", lambda path: N)


def _marker(it: Path, stage: str, seconds: float) -> None:
    it.mkdir(parents=True, exist_ok=True)
    (it / f"{stage}.done").write_text(json.dumps({"hash": "x", "finished_at": "2026-01-01T10:00:00",
                                                  "seconds": seconds}), encoding="utf-8")


def make_run(tmp_path: Path, old_stats: bool = False) -> Path:
    """Iteration 1: generation (1000 new + 500 prompt tokens in 10 s), DPO (1000 sequence tokens, one
    epoch, steps 20 s, reference pass 4 s, bf16 autocast), KL (100 tokens, 5 s)."""
    it = tmp_path / "run" / "iter_1"
    _marker(it, "generate", 30)
    _marker(it, "dpo", 40)
    _marker(it, "kl", 8)
    extra = {} if old_stats else {"prompt_tokens": 500}
    example_stats(GenerateStats, generated_tokens=1000, generation_s=10.0, **extra).write(
        it / "generated.jsonl.stats.json")
    dpo_extra = {} if old_stats else {"sequence_tokens": 1000, "epochs": 1.0}
    example_stats(DPOStats, hardware=BF16_HW, seconds={"total": 30.0, "model_loading": 1.0, "trainer_init": 6.0,
                                                       "reference_precompute": 4.0, "train_steps": 20.0, "save": 1.0},
                  **dpo_extra).write(it / "model.stats.json")
    example_stats(KLStats, seconds=5.0, **({} if old_stats else {"tokens": 100})).write(it / "kl.jsonl.stats.json")
    return tmp_path / "run"


def test_flops_per_stage_follow_2n_and_6n_per_token(tmp_path):
    rows = {(r["stage"], r["part"]): r for r in rl.stage_rows(make_run(tmp_path) / "iter_1", 1)}
    assert rows[("generate", "decode")]["tflop"] == pytest.approx(2 * N * 1000 / 1e12)
    assert rows[("generate", "prefill")]["tflop"] == pytest.approx(2 * N * 500 / 1e12)
    assert rows[("dpo", "steps")]["tflop"] == pytest.approx(6 * N * 1000 / 1e12)
    assert rows[("dpo", "reference pass")]["tflop"] == pytest.approx(2 * N * 1000 / 1e12)
    assert rows[("kl", "policy + reference")]["tflop"] == pytest.approx(2 * 2 * N * 100 / 1e12)
    assert rows[("dpo", "steps")]["dtype"] == "bfloat16"  # autocast counts against the bf16 limit
    assert rows[("generate", "decode")]["dtype"] == "float32"
    assert (rows[("generate", "decode")]["wall_s"], rows[("dpo", "steps")]["wall_s"]) == (30, 40)


def test_shares_and_compute_floor_against_given_limits(tmp_path, capsys):
    out = rl.main([str(make_run(tmp_path)), "--gflops-fp32", "100", "--gflops-bf16", "200",
                   "--json", str(tmp_path / "r.json")])
    rows = {(r["stage"], r["part"]): r for r in out["rows"]}
    assert rows[("generate", "decode")]["limit_s"] == pytest.approx(0.2e3 / 100)  # 2 s at 100 GFLOP/s
    assert rows[("generate", "decode")]["share"] == pytest.approx(2 / 10)
    assert rows[("dpo", "steps")]["share"] == pytest.approx((0.6e3 / 200) / 20)
    floor = (0.2 + 0.1 + 0.04) * 1e3 / 100 + (0.6 + 0.2) * 1e3 / 200
    assert out["compute_floor_s"] == pytest.approx(floor)
    assert out["stages_wall_s"] == 78
    assert json.loads((tmp_path / "r.json").read_text())["compute_floor_s"] == pytest.approx(floor)
    printed = capsys.readouterr().out.strip().splitlines()
    assert "compute floor" in printed[-2]
    assert printed[-1].startswith(f"share of the limit: {100 * floor / 78:.1f}% ")  # the last line
    assert out["share_of_limit"] == pytest.approx(floor / 78)


def test_stats_without_token_counts_are_listed_not_counted(tmp_path):
    out = rl.main([str(make_run(tmp_path, old_stats=True)), "--gflops-fp32", "100", "--gflops-bf16", "200"])
    uncounted = [r for r in out["rows"] if r["tflop"] is None]
    assert {(r["stage"], r["part"]) for r in uncounted} == {("generate", "prefill"), ("dpo", "steps"),
                                                            ("kl", "policy + reference")}
    assert all("missing" in r["note"] for r in uncounted)
    assert out["compute_floor_s"] == pytest.approx(0.2e3 / 100)  # only the decode is known


def test_not_a_run_directory_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no iter_<i> directory"):
        rl.main([str(tmp_path), "--gflops-fp32", "1", "--gflops-bf16", "1"])


def test_check_lengths_counts_the_sequence_tokens_one_epoch_trains_on():
    pairs = [{"prompt_ids": [1] * 10, "chosen_ids": [2] * 5, "rejected_ids": [3] * 30, "_where": "line 1"},
             {"prompt_ids": [1] * 50, "chosen_ids": [2] * 5, "rejected_ids": [3] * 5, "_where": "line 2"}]
    kept, info = check_lengths(pairs, max_length=32, max_prompt_length=40, truncation_mode="keep_start")
    assert len(kept) == 1  # the 50-token prompt is over max_prompt_length
    assert info["sequence_tokens"] == (10 + 5) + 32  # the rejected side is cut at max_length
    _, info = check_lengths(pairs, max_length=None, max_prompt_length=None, truncation_mode="keep_start")
    assert info["sequence_tokens"] == (15 + 40) + (55 + 55)


def test_a_limit_not_above_0_and_a_run_without_stats_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        rl.main([str(make_run(tmp_path)), "--gflops-fp32", "-5", "--gflops-bf16", "200"])
    (tmp_path / "planned" / "iter_1" / "configs").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no stats of a model-running stage"):
        rl.main([str(tmp_path / "planned"), "--gflops-fp32", "1", "--gflops-bf16", "1"])


def test_a_share_above_100_percent_is_warned(tmp_path, capsys):
    rl.main([str(make_run(tmp_path)), "--gflops-fp32", "1", "--gflops-bf16", "1"])  # far below what the run reached
    assert "share above 100%" in capsys.readouterr().err


def test_generation_wall_over_decode_is_summed_over_stages_and_iterations(tmp_path, capsys):
    run = make_run(tmp_path)  # iteration 1: generate, wall 30 s, decode 10 s
    it2 = run / "iter_2"
    _marker(it2, "generate", 14)
    example_stats(GenerateStats, generated_tokens=100, generation_s=6.0, prompt_tokens=50,
                  phase_s={"process": 1.0, "prompts": 2.0, "engine_import": 2.0, "engine_start": 3.0,
                           "decode": 6.0, "write": 0.0}).write(it2 / "generated.jsonl.stats.json")
    out = rl.main([str(run), "--gflops-fp32", "100", "--gflops-bf16", "200"])
    gen = out["generation"]
    assert (gen["wall_s"], gen["decode_s"]) == (44, 16)
    assert gen["wall_over_decode"] == pytest.approx(44 / 16)
    assert gen["phase_s"]["engine_start"] == 3.0  # iteration 1's stats have no phase_s: nothing added
    printed = capsys.readouterr().out.strip().splitlines()
    line = next(s for s in printed if s.startswith("generation stages:"))
    assert "wall 44 s over decode 16 s = 2.75x" in line and "engine_start 3 s" in line
    assert printed[-1].startswith("share of the limit:")  # still the last line


def test_a_model_folder_that_is_gone_names_a_moved_run(tmp_path):
    # a run directory moved after it ran: its stats still name the old iter_<i>/model
    gone = str(tmp_path / "old_place" / "iter_1" / "model")
    with pytest.raises(FileNotFoundError, match=r"old_place/iter_1/model: no such model folder.*moved or copied"):
        _REAL_PARAMETER_COUNT(gone)


def test_answers_from_the_evaluation_cache_are_not_counted_as_this_runs_work(tmp_path):
    run = make_run(tmp_path)
    it0 = run / "iter_0"
    _marker(it0, "eval_generate", 2)  # copied in ~2 s; decoded by another run
    example_stats(GenerateStats, generated_tokens=5000, generation_s=50.0, prompt_tokens=900,
                  reused_from="/elsewhere/seed1/iter_0/eval_generated.jsonl").write(it0 / "eval_generated.jsonl.stats.json")
    rows = rl.stage_rows(it0, 0)
    assert [(r["stage"], r["part"], r["tflop"], r["seconds"]) for r in rows] == [("eval_generate", "decode", None, None, )]
    assert "evaluation cache (/elsewhere/seed1/iter_0/eval_generated.jsonl)" in rows[0]["note"]
    both = rows + rl.stage_rows(run / "iter_1", 1)
    over = rl.generation_overhead(both)
    assert (over["wall_s"], over["decode_s"]) == (32, 10.0)  # the cached 50 decode seconds are not this run's
