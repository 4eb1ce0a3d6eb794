"""bench/iteration_breakdown.py on a synthetic run directory (markers, stats, a vLLM log in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


from bench import iteration_breakdown as ib  # noqa: E402
from online_rlhf.stats import DPOStats, GenerateStats, PairsStats, RewardStats  # noqa: E402
from online_rlhf.testing import example_stats  # noqa: E402


def _w(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj), encoding="utf-8")


def _marker(it: Path, stage: str, seconds: float, finished_at: str) -> None:
    _w(it / f"{stage}.done", {"hash": "x", "finished_at": finished_at, "seconds": seconds})


def make_run(tmp_path: Path) -> Path:
    """Iteration 1 of a run: 200 s of stages + 10 s of bookkeeping after iteration 0's last marker.

    generate 100 = 30 vLLM start-up + 50 generation + 20 rest; rewards 10 = 6 scoring + 4 rest;
    pairs 2 = 0.5 + 1.5 rest; dpo 48 = 5 ref + 20 steps + 3 save + 20 rest; eval 30 + 10.
    """
    run = tmp_path / "run"
    _marker(run / "iter_0", "eval_rewards", 5, "2026-01-01T10:00:00")
    it = run / "iter_1"
    t = 0
    for stage, s in (("generate", 100), ("rewards", 10), ("pairs", 2), ("dpo", 48),
                     ("eval_generate", 30), ("eval_rewards", 10)):
        t += s + 2  # 2 s of loop bookkeeping before each stage's marker: 12 s in all
        _marker(it, stage, s, f"2026-01-01T10:{t // 60:02d}:{t % 60:02d}")
    # stats files as the stages write them (read back through online_rlhf.stats)
    example_stats(GenerateStats, engine_startup_s=30.0, generation_s=50.0).write(it / "generated.jsonl.stats.json")
    example_stats(RewardStats, seconds=6.0).write(it / "rewards.jsonl.stats.json")
    example_stats(PairsStats, seconds=0.5).write(it / "pairs.jsonl.stats.json")
    example_stats(DPOStats, seconds={"total": 40.0, "model_loading": 4.0, "trainer_init": 9.0,
                                     "reference_precompute": 5.0, "train_steps": 20.0, "save": 3.0}
                  ).write(it / "model.stats.json")
    example_stats(GenerateStats, engine_startup_s=20.0, generation_s=6.0).write(it / "eval_generated.jsonl.stats.json")
    example_stats(RewardStats, seconds=3.0).write(it / "eval.jsonl.stats.json")
    return run


def test_categories_take_the_stage_timers_and_the_rest_is_startup(tmp_path):
    b = ib.breakdown(make_run(tmp_path), 1)
    s = b["seconds"]
    assert (s["vllm_startup"], s["generation"], s["scoring"], s["pair_building"]) == (30, 50, 6, 0.5)
    assert (s["reference_pass"], s["dpo_steps"], s["checkpoint_save"], s["evaluation"]) == (5, 20, 3, 40)
    assert s["startup_loading"] == pytest.approx(20 + 4 + 1.5 + 20)


def test_co_decoded_rollouts_count_their_decode_and_say_where_they_ran(tmp_path):
    run = make_run(tmp_path)
    it = run / "iter_1"
    _w(it / "generate.done", {"hash": "x", "finished_at": "2026-01-01T10:01:42", "seconds": 1,
                              "co_decoded_by": "eval_generate", "co_decoded_iteration": 0})
    example_stats(GenerateStats, engine_startup_s=0.0, generation_s=50.0).write(it / "generated.jsonl.stats.json")
    b = ib.breakdown(run, 1)
    assert b["seconds"]["generation"] == 50 and b["seconds"]["vllm_startup"] == 0
    assert b["seconds"]["startup_loading"] == pytest.approx(4 + 1.5 + 20)  # nothing of generate's 1 s turn
    assert any("decoded in the engine start of eval_generate of iteration 0" in n for n in b["notes"])
    assert not any("exceed its marker" in n for n in b["notes"])


def test_shares_add_up_to_the_iteration(tmp_path):
    b = ib.breakdown(make_run(tmp_path), 1)
    assert b["total_s"] == pytest.approx(200 + 12)
    assert sum(b["seconds"].values()) == pytest.approx(b["total_s"])
    assert sum(b["shares"].values()) == pytest.approx(1.0)


def test_bookkeeping_is_the_marker_gap_not_covered_by_stages(tmp_path):
    b = ib.breakdown(make_run(tmp_path), 1)
    assert b["seconds"]["loop_bookkeeping"] == pytest.approx(12)


def test_fixed_overhead_of_the_training_part(tmp_path):
    b = ib.breakdown(make_run(tmp_path), 1)
    work = 50 + 6 + 5 + 20
    training = 100 + 10 + 2 + 48 + 12 * 4 / 6  # bookkeeping shared by stage count
    assert b["work_s"] == pytest.approx(work)
    assert b["training_overhead_s"] == pytest.approx(training - work)
    assert b["training_overhead_share"] == pytest.approx((training - work) / training)


def test_fixed_overhead_of_the_whole_iteration_counts_evaluation(tmp_path):
    b = ib.breakdown(make_run(tmp_path), 1)
    assert b["overhead_share"] == pytest.approx((212 - 81) / 212)


def test_resumed_run_leaves_bookkeeping_out_with_a_note(tmp_path):
    run = make_run(tmp_path)
    _marker(run / "iter_0", "eval_rewards", 5, "2025-12-31T10:00:00")  # a day earlier: resumed
    b = ib.breakdown(run, 1)
    assert b["seconds"]["loop_bookkeeping"] == 0
    assert any("bookkeeping" in n for n in b["notes"])


def test_missing_stats_file_is_named(tmp_path):
    run = make_run(tmp_path)
    (run / "iter_1" / "model.stats.json").unlink()
    with pytest.raises(ib.BreakdownError, match="model.stats.json"):
        ib.breakdown(run, 1)


def test_stats_file_with_a_missing_key_is_named(tmp_path):
    run = make_run(tmp_path)
    path = run / "iter_1" / "rewards.jsonl.stats.json"
    data = json.loads(path.read_text())
    del data["seconds"]
    _w(path, data)
    with pytest.raises(ib.BreakdownError, match=r"rewards\.jsonl\.stats\.json.*missing key 'seconds'"):
        ib.breakdown(run, 1)


def test_a_shard_without_engine_counts_zero_startup(tmp_path):
    run = make_run(tmp_path)
    example_stats(GenerateStats, engine_startup_s=None, generation_s=None).write(
        run / "iter_1" / "generated.jsonl.stats.json")
    b = ib.breakdown(run, 1)
    assert b["seconds"]["vllm_startup"] == 0 and b["seconds"]["generation"] == 0


def test_default_iteration_is_the_last_with_dpo_done(tmp_path):
    assert ib.breakdown(make_run(tmp_path))["iteration"] == 1


def test_vllm_startup_phases_from_the_shard_log(tmp_path):
    log = tmp_path / "shard_00.log"
    log.write_text(
        "\n=== 2026-11-29 14:40:00 ===\n$ python generate.py\n"
        "(MainProcess pid=1) INFO 11-29 14:40:15 [api_utils.py:286] non-default args\n"
        "(EngineCore pid=2) INFO 11-29 14:40:30 [core.py:133] Initializing a V1 LLM engine\n"
        "(Worker pid=3) INFO 11-29 14:41:00 [parallel_state.py:1906] world_size=1\n"
        "(EngineCore pid=2) INFO 11-29 14:41:04 [core.py:402] init engine (profile, create kv cache, warmup model) took 2.0 s\n",
        encoding="utf-8")
    assert ib.vllm_startup_detail(log) == {"imports_s": 15, "engine_core_spawn_s": 15, "worker_spawn_s": 30,
                                           "load_and_kv_cache_s": 4}
