"""Pair selection (online_rlhf/pairs.py) and the make_pairs stage: one behaviour per test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from online_rlhf.jsonl import DataError, write_jsonl
from online_rlhf.pairs import build_pairs, prompt_pairs
from online_rlhf.records import validate_pair
from online_rlhf.stats import PairsStats, stats_path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Say hi."}]


def rec(rewards, responses=None, finish=None, rid="p0"):
    responses = responses or [f"response {j}" for j in range(len(rewards))]
    return {"id": rid, "prompt": PROMPT, "responses": responses,
            "finish_reasons": finish or ["stop"] * len(responses), "rewards": rewards, "reward_source": "test"}


def pairs_of(records, **kw):
    return build_pairs(((f"mem:{i}", r) for i, r in enumerate(records)), **kw)


def test_max_min_picks_best_and_worst():
    (p,) = prompt_pairs(rec([0.2, 0.9, -0.5, 0.1]), "mem:1")
    assert p["chosen"] == [{"role": "assistant", "content": "response 1"}]
    assert p["rejected"] == [{"role": "assistant", "content": "response 2"}]
    assert (p["chosen_reward"], p["rejected_reward"]) == (0.9, -0.5)
    validate_pair(p, "mem:1")


def _texts(pairs):
    return [(p["chosen"][0]["content"][-1], p["rejected"][0]["content"][-1]) for p in pairs]


def test_best_vs_rest_pairs_the_best_with_each_lower_one_worst_first():
    # response 1 is the best, 2 the worst; 0 and 3 tie below it (ordered by index), 4 is just under the best
    r = rec([0.5, 1.0, 0.0, 0.5, 0.9])
    pairs = prompt_pairs(r, "mem:1", strategy="best_vs_rest")
    assert _texts(pairs) == [("1", "2"), ("1", "0"), ("1", "3"), ("1", "4")]
    assert pairs[0] == prompt_pairs(r, "mem:1")[0]  # the first is max_min's
    assert {p["id"] for p in pairs} == {"p0"} and all(p["chosen_reward"] == 1.0 for p in pairs)
    # min_margin leaves out each rejected one too close to the best; the cap keeps the worst ones
    assert _texts(prompt_pairs(r, "mem:1", strategy="best_vs_rest", min_margin=0.2)) == [("1", "2"), ("1", "0"), ("1", "3")]
    assert _texts(prompt_pairs(r, "mem:1", strategy="best_vs_rest", max_pairs_per_prompt=2)) == [("1", "2"), ("1", "0")]


def test_all_pairs_takes_every_two_that_differ_largest_margin_first():
    r = rec([0.5, 1.0, 0.0, 0.5])
    pairs = prompt_pairs(r, "mem:1", strategy="all_pairs")
    # margins: 1-2: 1.0; 0-2, 1-0, 1-3, 3-2: 0.5; the two 0.5s never pair (a tie)
    assert _texts(pairs) == [("1", "2"), ("0", "2"), ("1", "0"), ("1", "3"), ("3", "2")]
    assert all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    assert len(prompt_pairs(r, "mem:1", strategy="all_pairs", min_margin=0.5)) == 1


def test_multi_pair_stats_count_pairs_and_the_prompts_they_came_from(tmp_path):
    from online_rlhf.stage_configs import PairsConfig
    from online_rlhf.stages import make_pairs

    src = tmp_path / "rewards.jsonl"
    write_jsonl(src, [rec([0.0, 1.0, 0.5, 0.25], rid="a"), rec([0.3, 0.3, 0.3, 0.3], rid="tie"), rec([1.0, 0.0], rid="b")])
    stats = make_pairs.main(PairsConfig(input=str(src), output=str(tmp_path / "pairs.jsonl"), strategy="best_vs_rest"))
    assert (stats.records_in, stats.pairs_out, stats.prompts_with_pairs, stats.skipped) == (3, 4, 2, {"tie": 1})
    assert stats.margin_mean == pytest.approx((1.0 + 0.75 + 0.5 + 1.0) / 4)
    capped = make_pairs.main(PairsConfig(input=str(src), output=str(tmp_path / "p2.jsonl"), strategy="all_pairs",
                                         max_pairs_per_prompt=2))
    assert (capped.pairs_out, capped.prompts_with_pairs, capped.max_pairs_per_prompt) == (3, 2, 2)
    # a cap on a strategy that makes one pair per prompt would do nothing: refused, not recorded as if it applied
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="max_pairs_per_prompt=2 caps best_vs_rest and all_pairs; strategy=max_min"):
        PairsConfig(input=str(src), output=str(tmp_path / "p3.jsonl"), max_pairs_per_prompt=2)


def test_ties_are_skipped_and_counted():
    pairs, stats = pairs_of([rec([0.5, 0.5, 0.5], rid="tie"), rec([1.0, 0.0], rid="ok")])
    assert [p["id"] for p in pairs] == ["ok"]
    assert stats["skipped"] == {"tie": 1}
    assert (stats["records_in"], stats["pairs_out"]) == (2, 1)


def test_min_margin_skips_close_rewards():
    pairs, stats = pairs_of([rec([0.50, 0.55], rid="close"), rec([0.0, 1.0], rid="far")], min_margin=0.1)
    assert [p["id"] for p in pairs] == ["far"]
    assert stats["skipped"] == {"margin_below_min": 1}


def test_fewer_than_two_valid_responses_skipped_and_empty_counted():
    pairs, stats = pairs_of([rec([1.0, 0.0], responses=["fine answer", "   "])])
    assert pairs == []
    assert stats["skipped"] == {"fewer_than_2_valid": 1}
    assert stats["responses"]["empty"] == 1


def test_same_text_never_becomes_a_pair():
    # same text scored differently (e.g. a noisy reward): must not be chosen and rejected at once
    pairs, stats = pairs_of([rec([1.0, 0.0], responses=["same", "same"])])
    assert pairs == [] and stats["skipped"] == {"identical_responses": 1}
    assert stats["responses"]["duplicate"] == 1


def test_identical_tied_and_excluded_prompts_have_separate_skip_counts():
    records = [rec([0.5, 0.1, 0.9], responses=["same", "same ", "same"], rid="ident"),
               rec([0.5, 0.5], responses=["a", "b"], rid="tie"),
               rec([1.0, 0.0, 0.2], responses=["fine", "", "x"], finish=["stop", "stop", "length"], rid="excl"),
               rec([1.0, 0.0], rid="ok")]
    pairs, stats = pairs_of(records)
    assert [p["id"] for p in pairs] == ["ok"]
    assert stats["skipped"] == {"identical_responses": 1, "tie": 1, "fewer_than_2_valid": 1}
    assert stats["skipped_examples"]["identical_responses"] == ["mem:0 (id='ident')"]
    assert stats["skipped_examples"]["fewer_than_2_valid"] == ["mem:2 (id='excl')"]


def test_identical_valid_responses_beside_an_empty_one_are_identical():
    _, stats = pairs_of([rec([1.0, 0.0, 0.5], responses=["same", "same", "  "])])
    assert stats["skipped"] == {"identical_responses": 1}


def test_most_prompts_without_two_distinct_responses_warn():
    same = [rec([0.5] * 4, responses=["one answer"] * 4, rid=f"s{i}") for i in range(2)]
    _, stats = pairs_of(same + [rec([0.0, 1.0], rid="d")])
    assert stats["prompts_fewer_than_2_distinct"] == 2
    assert len(stats["warnings"]) == 1 and "2 of 3 prompts have fewer than 2 distinct" in stats["warnings"][0]
    _, half = pairs_of(same[:1] + [rec([0.0, 1.0], rid="d")])
    assert half["warnings"] == []  # one of two is not most


def test_stage_prints_the_low_diversity_warning(tmp_path):
    src = tmp_path / "rewards.jsonl"
    write_jsonl(src, [rec([0.5] * 3, responses=["x"] * 3, rid=f"p{i}") for i in range(3)])
    res = subprocess.run([sys.executable, str(ROOT / "annotate_data" / "make_pairs.py"), f"input={src}",
                          f"output={tmp_path / 'pairs.jsonl'}"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2, res.stderr  # 0 pairs is a failure (issue 24), after the warnings and the stats
    assert "WARNING: make_pairs: 3 of 3 prompts have fewer than 2 distinct responses" in res.stderr
    stats = PairsStats.read(stats_path(tmp_path / "pairs.jsonl"))
    assert stats.skipped == {"identical_responses": 3} and stats.warnings


def test_null_reward_leaves_out_that_response_only():
    pairs, stats = pairs_of([rec([0.9, None, 0.1], rid="n"), rec([None, None, 1.0], rid="one")])
    assert [(p["id"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == \
        [("n", "response 0", "response 2")]
    assert stats["skipped"] == {"fewer_than_2_valid": 1} and stats["responses"]["unscored"] == 3
    assert stats["reward"]["mean"] == pytest.approx((0.9 + 0.1 + 1.0) / 3)


def test_duplicate_texts_count_once_with_mean_reward():
    (p,) = prompt_pairs(rec([1.0, 0.0, 0.2], responses=["a", "a ", "b"]), "mem:1")
    assert p["chosen"][0]["content"] == "a" and p["chosen_reward"] == 0.5
    assert p["rejected"][0]["content"] == "b"


def test_truncated_excluded():
    r = rec([1.0, 0.5, 0.0], finish=["length", "stop", "stop"])
    pairs, stats = pairs_of([r], truncated="exclude")
    assert pairs[0]["chosen"][0]["content"] == "response 1"
    assert stats["responses"]["truncated_excluded"] == 1
    assert stats["truncation"] == {"policy": "exclude", "penalty": None}


def test_truncated_kept():
    pairs, _ = pairs_of([rec([1.0, 0.5, 0.0], finish=["length", "stop", "stop"])], truncated="keep")
    assert pairs[0]["chosen"][0]["content"] == "response 0"


def test_truncated_penalized():
    r = rec([1.0, 0.5, 0.0], finish=["length", "stop", "stop"])
    pairs, stats = pairs_of([r], truncated="penalize", truncated_penalty=1.5)
    p = pairs[0]
    assert p["chosen"][0]["content"] == "response 1"
    assert p["rejected"][0]["content"] == "response 0" and p["rejected_reward"] == pytest.approx(-0.5)
    assert stats["truncation"] == {"policy": "penalize", "penalty": 1.5}
    assert stats["responses"]["truncated_penalized"] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_raises_naming_the_record(bad):
    with pytest.raises(DataError, match=r"rewards\.jsonl:7.*bad-id"):
        build_pairs([("rewards.jsonl:7", rec([0.0, bad], rid="bad-id"))])


def test_random_strategies_are_deterministic_with_seed():
    records = [rec([0.1 * j for j in range(8)], rid=f"p{i}") for i in range(20)]
    for strategy in ("random", "max_random"):
        a, _ = pairs_of(records, strategy=strategy, seed=1)
        b, _ = pairs_of(records, strategy=strategy, seed=1)
        c, _ = pairs_of(records, strategy=strategy, seed=2)
        assert a == b
        assert a != c
        assert all(p["chosen_reward"] > p["rejected_reward"] for p in a)


def test_max_random_chosen_is_best():
    pairs, _ = pairs_of([rec([0.3, 0.9, 0.1, 0.2], rid=f"p{i}") for i in range(10)], strategy="max_random")
    assert all(p["chosen"][0]["content"] == "response 1" for p in pairs)
    assert len({p["rejected"][0]["content"] for p in pairs}) > 1


def test_unscored_records_skipped_and_counted():
    r = rec([0.0, 1.0])
    r["rewards"] = None
    pairs, stats = pairs_of([r])
    assert pairs == [] and stats["skipped"] == {"unscored": 1}


def test_stats_reward_summary():
    _, stats = pairs_of([rec([0.0, 1.0]), rec([2.0, 3.0], rid="p1")])
    assert stats["reward"]["mean"] == pytest.approx(1.5)
    assert stats["reward"]["std"] == pytest.approx(math.sqrt(1.25))
    assert (stats["reward"]["min"], stats["reward"]["max"]) == (0.0, 3.0)
    assert stats["chosen_reward_mean"] == pytest.approx(2.0)
    assert stats["rejected_reward_mean"] == pytest.approx(1.0)
    assert stats["margin_mean"] == pytest.approx(1.0)


def test_stage_output_loads_with_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    src = tmp_path / "rewards.jsonl"
    write_jsonl(src, [rec([0.0, 1.0, 0.5], rid="a"), rec([1.0, 1.0], rid="b"),
                      {**rec([0.2, 0.8], rid="c"), "instruction_id_list": ["x"], "kwargs": [{"n": 1}]}])
    out = tmp_path / "pairs.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "annotate_data" / "make_pairs.py"), f"input={src}",
                          f"output={out}"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    stats = PairsStats.read(stats_path(out))  # the stage's stats round-trip through their class
    assert (stats.records_in, stats.pairs_out, stats.skipped) == (3, 2, {"tie": 1})
    assert stats.truncation.policy == "exclude" and stats.reward.max == 1.0
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert ds.column_names == ["id", "prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"]
    assert ds[0]["chosen"] == [{"role": "assistant", "content": "response 1"}]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c"]


@pytest.mark.parametrize("bad", ["1.0", True, [1.0]])
def test_reward_that_is_not_a_json_number_raises(bad):
    with pytest.raises(DataError, match=r"rewards\.jsonl:3.*not a number"):
        build_pairs([("rewards.jsonl:3", rec([0.0, bad]))])


def test_huge_finite_rewards_do_not_overflow_the_stats():
    pairs, stats = pairs_of([rec([1e300, -1e300])])
    assert len(pairs) == 1 and stats["reward"]["std"] == pytest.approx(1e300)
    # a margin beyond the float range (1e308 - -1e308) is left out of the mean, not written as inf
    pairs, stats = pairs_of([rec([1e308, -1e308, 0.0])])
    assert len(pairs) == 1 and stats["margin_mean"] is None
    json.dumps(stats, allow_nan=False)
    # every pair of two huge rewards: the means of chosen and of all rewards stay finite (fmean's sum overflowed)
    pairs, stats = pairs_of([rec([1e308, -1e308, 1e308, 0.0], rid="a"), rec([1e308, 0.0], rid="b")],
                            strategy="all_pairs")
    assert stats["chosen_reward_mean"] == pytest.approx(1e308 / 6 * 5) and stats["reward"]["mean"] == pytest.approx(1e308 / 3)
    json.dumps(stats, allow_nan=False)


def test_record_without_rewards_says_to_score_it_first():
    r = rec([0.0, 1.0])
    del r["rewards"]
    with pytest.raises(DataError, match=r"gen\.jsonl:1: record has no 'rewards'.*get_rewards\.py"):
        build_pairs([("gen.jsonl:1", r)])


def test_duplicate_id_raises_naming_both_lines():
    with pytest.raises(DataError, match=r"r\.jsonl:5: id 'p0' was already used at r\.jsonl:2"):
        build_pairs([("r.jsonl:2", rec([0.0, 1.0])), ("r.jsonl:5", rec([1.0, 0.0]))])


def test_stage_refuses_to_overwrite_its_input(tmp_path):
    src = tmp_path / "rewards.jsonl"
    write_jsonl(src, [rec([0.0, 1.0])])
    before = src.read_text()
    res = subprocess.run([sys.executable, str(ROOT / "annotate_data" / "make_pairs.py"), f"input={src}",
                          f"output={tmp_path}/./rewards.jsonl"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "would overwrite the input" in res.stderr
    assert src.read_text() == before and not (tmp_path / "rewards.jsonl.stats.json").exists()


def test_stage_nan_reward_exits_2_naming_line(tmp_path):
    src = tmp_path / "rewards.jsonl"
    src.write_text(json.dumps(rec([0.0, 1.0])) + "\n" + json.dumps(rec([0.0, 1.0], rid="x")).replace("1.0", "NaN") + "\n")
    res = subprocess.run([sys.executable, str(ROOT / "annotate_data" / "make_pairs.py"), f"input={src}",
                          f"output={tmp_path / 'pairs.jsonl'}"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2
    assert "rewards.jsonl:2" in res.stderr and "'x'" in res.stderr
    assert not (tmp_path / "pairs.jsonl").exists()


def test_pairs_are_trl_conversational_preference_examples():
    trl_data = pytest.importorskip("trl.data_utils")
    from online_rlhf.testing import make_tiny_tokenizer

    (p,) = prompt_pairs(rec([0.0, 1.0]), "mem:1")
    pair = {k: p[k] for k in ("prompt", "chosen", "rejected")}
    assert trl_data.is_conversational(pair)
    text = trl_data.apply_chat_template(pair, make_tiny_tokenizer())
    assert text["prompt"].endswith("<|im_start|>assistant\n")
    assert text["chosen"].startswith("response 1") and text["rejected"].startswith("response 0")


def test_no_pairs_from_a_non_empty_input_warns_with_the_reasons_and_the_fix(tmp_path, capsys):
    from online_rlhf.stage_configs import PairsConfig
    from online_rlhf.stages import make_pairs

    cut = [rec([0.0, 1.0, 2.0], finish=["length"] * 3, rid=f"t{i}") for i in range(2)]
    _, stats = pairs_of(cut)
    assert stats["pairs_out"] == 0 and len(stats["warnings"]) == 1
    w = stats["warnings"][0]
    assert "0 pairs from 2 prompts" in w and "fewer_than_2_valid" in w
    assert "truncated=exclude dropped 6 truncated responses: use truncated=penalize" in w and "max_tokens" in w
    _, ok = pairs_of(cut, truncated="penalize")
    assert ok["pairs_out"] == 2 and ok["warnings"] == []
    _, empty = pairs_of([])
    assert empty["warnings"] == []
    src = tmp_path / "rewards.jsonl"
    write_jsonl(src, cut)
    from online_rlhf.jsonl import DataError

    with pytest.raises(DataError, match=r"0 pairs from 2 prompts .*Change: .*pairs\.truncated=penalize"):
        make_pairs.main(PairsConfig(input=str(src), output=str(tmp_path / "pairs.jsonl")))  # issue 24: not exit 0
    assert "WARNING: make_pairs: 0 pairs from 2 prompts" in capsys.readouterr().err


def test_make_pairs_counts_the_blank_lines_of_its_input(tmp_path, capsys):
    from online_rlhf.stage_configs import PairsConfig
    from online_rlhf.stages import make_pairs

    src = tmp_path / "rewards.jsonl"
    write_jsonl(src, [rec([0.0, 1.0], rid="a"), rec([1.0, 0.0], rid="b")])
    src.write_text(src.read_text().replace("\n", "\n\n", 1))
    stats = make_pairs.main(PairsConfig(input=str(src), output=str(tmp_path / "pairs.jsonl")))
    assert stats.pairs_out == 2 and stats.input_blank_lines == 1
    assert f"note: skipped 1 blank line(s) in {src} (line 2)" in capsys.readouterr().err


def test_the_unused_penalty_warning_names_a_set_penalty_only(tmp_path):
    """The loop's stage YAML holds every key: the stage default with truncated=keep is no warning."""
    from online_rlhf.stage_configs import PairsConfig
    from online_rlhf.stages import make_pairs

    write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "prompt": [{"role": "user", "content": "q"}], "responses": ["x", "y"],
                                        "finish_reasons": ["stop", "length"], "rewards": [1.0, 0.0]}])
    base = {"input": str(tmp_path / "r.jsonl"), "output": str(tmp_path / "p.jsonl"), "truncated": "keep"}
    default = PairsConfig.model_fields["truncated_penalty"].default
    assert make_pairs.main(PairsConfig(**base, truncated_penalty=default)).warnings == []
    assert "truncated_penalty=0.3 is not used" in make_pairs.main(PairsConfig(**base, truncated_penalty=0.3)).warnings[0]
