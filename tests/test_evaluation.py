"""Evaluation: paired tests, length control, IFEval scores, the KL estimate, and the loop's
IFEval/KL stages (plan, metrics, report) on synthetic stage outputs."""

import math
from pathlib import Path

import numpy as np
import pytest

from online_rlhf import evaluation as ev
from online_rlhf import loop
from online_rlhf.jsonl import read_json, read_jsonl, write_jsonl
from online_rlhf.paths import default_data_dir
from online_rlhf.stats import DPOStats, GenerateStats, IFEvalStats, KLStats, PairsStats, RewardStats
from online_rlhf.testing import example_stats

IFEVAL = default_data_dir() / "ifeval.jsonl"


# ----------------------------------------------------------------------------- paired tests

def test_identical_iterations_differ_by_zero_with_p_one():
    x = np.random.default_rng(1).random(48)
    t = ev.paired_bootstrap(x, x)
    assert t["diff"] == 0.0 and t["ci95"] == [0.0, 0.0] and t["p_value"] == 1.0


def test_a_constant_shift_gives_an_interval_that_excludes_zero():
    x = np.random.default_rng(2).random(48)
    t = ev.paired_bootstrap(x, x + 0.05)
    assert t["diff"] == pytest.approx(0.05)
    assert t["ci95"] == pytest.approx([0.05, 0.05]) and t["p_value"] == 0.0  # every resample differs by 0.05


def test_noise_around_no_change_is_not_significant_and_the_seed_fixes_the_result():
    rng = np.random.default_rng(3)
    a = rng.random(200)
    b = a + rng.normal(0, 0.2, 200) - 0.0  # no true change
    t = ev.paired_bootstrap(a, b)
    assert t["ci95"][0] < 0 < t["ci95"][1] and t["p_value"] > 0.05
    assert ev.paired_bootstrap(a, b) == t


def test_paired_bootstrap_refuses_misaligned_scores():
    with pytest.raises(ValueError, match="aligned"):
        ev.paired_bootstrap([1.0, 2.0], [1.0])


def test_mcnemar_counts_discordant_prompts_and_matches_the_binomial():
    base = [True] * 10 + [False] * 30
    new = [True] * 10 + [True] * 12 + [False] * 18  # 12 gained, 0 lost
    t = ev.mcnemar_exact(base, new)
    assert (t["base_only"], t["new_only"]) == (0, 12)
    assert t["p_value"] == pytest.approx(2 * 0.5 ** 12)
    assert ev.mcnemar_exact(base, base)["p_value"] == 1.0


# ----------------------------------------------------------------------------- length control

def test_reward_driven_by_length_alone_has_no_length_controlled_gain():
    rng = np.random.default_rng(4)
    t0 = rng.integers(50, 150, 48)
    t1 = t0 // 4 + 1  # much shorter answers
    reward = lambda t: 0.9 - 0.1 * np.log(t)  # shorter is better, nothing else changes
    lc = ev.length_controlled({0: (reward(t0), t0), 1: (reward(t1), t1)})
    assert reward(t1).mean() - reward(t0).mean() > 0.1  # the plain gain
    assert lc["lc_mean"][1] == pytest.approx(lc["lc_mean"][0], abs=1e-9)
    assert lc["lc_mean"][0] == pytest.approx(reward(t0).mean())
    assert lc["slope_per_log_token"] == pytest.approx(-0.1)


def test_equal_lengths_everywhere_leave_the_reward_as_is():
    lc = ev.length_controlled({0: ([0.0, 0.5, 1.0], [24, 24, 24]), 1: ([1.0, 1.0, 1.0], [24, 24, 24])})
    assert lc["slope_per_log_token"] == 0.0 and lc["lc_mean"] == {0: pytest.approx(0.5), 1: pytest.approx(1.0)}


def test_a_gain_at_equal_length_survives_length_control():
    rng = np.random.default_rng(5)
    t = rng.integers(20, 200, 64)
    r0 = rng.random(64) * 0.5
    lc = ev.length_controlled({0: (r0, t), 1: (r0 + 0.2, t)})
    assert lc["lc_mean"][1] - lc["lc_mean"][0] == pytest.approx(0.2)


# ----------------------------------------------------------------------------- IFEval and fluency

def test_ifeval_scores_prompt_and_instruction_level():
    strict = [[True, True], [True, False], [False]]
    loose = [[True, True], [True, True], [False]]
    s = ev.ifeval_scores(strict, loose)
    assert s == {"prompt_strict": pytest.approx(1 / 3), "prompt_loose": pytest.approx(2 / 3),
                 "instruction_strict": pytest.approx(3 / 5), "instruction_loose": pytest.approx(4 / 5)}


def test_distinct_n_drops_with_repetition():
    assert ev.distinct_n(["a b c d"], 1) == 1.0
    assert ev.distinct_n(["a a a a"], 1) == 0.25 and ev.distinct_n(["a a a a"], 2) == pytest.approx(1 / 3)
    assert ev.distinct_n(["one"], 2) is None


def test_ifeval_instruction_results_strict_and_loose():
    from online_rlhf.verifiers import ifeval_instruction_results

    rec = {"id": "x", "prompt": [{"role": "user", "content": "q"}],
           "instruction_id_list": ["punctuation:no_comma", "detectable_format:title"], "kwargs": [{}, {}]}
    assert ifeval_instruction_results(rec, "<<Title>>\nno commas here") == ([True, True], [True, True])
    assert ifeval_instruction_results(rec, "a, b") == ([False, False], [False, False])
    assert ifeval_instruction_results(rec, "") == ([False, False], [False, False])


def test_ifeval_score_stage_writes_the_four_numbers_and_counts_unscorable_records(tmp_path):
    from online_rlhf.stage_configs import IFEvalScoreConfig
    from online_rlhf.stages import ifeval_score

    def rec(i, ids, response, finish="stop"):
        return {"id": i, "prompt": [{"role": "user", "content": "q"}], "responses": [response],
                "finish_reasons": [finish], "response_tokens": [5], "instruction_id_list": ids, "kwargs": [{}] * len(ids)}

    write_jsonl(tmp_path / "gen.jsonl", [
        rec("a", ["punctuation:no_comma", "detectable_format:title"], "<<T>>\nno commas"),  # 2 of 2
        rec("b", ["punctuation:no_comma", "detectable_format:title"], "a, b", "length"),  # 0 of 2
        rec("c", ["punctuation:no_comma"], "*fine*"),  # 1 of 1
        rec("d", ["no:such_instruction"], "x"),  # unscorable
    ])
    st = ifeval_score.main(IFEvalScoreConfig(input=str(tmp_path / "gen.jsonl"), output=str(tmp_path / "ifeval.jsonl")))
    assert (st.records_in, st.records_scored, st.instructions) == (4, 3, 5)
    assert st.skipped == {"unknown_instruction:no:such_instruction": 1} and st.skipped_ids["unknown_instruction:no:such_instruction"] == ["d"]
    assert (st.prompt_strict, st.instruction_strict) == (pytest.approx(2 / 3), pytest.approx(3 / 5))
    assert st.truncation_rate == pytest.approx(1 / 3, abs=1e-4)
    # per instruction group: punctuation 2 of 3 (a, c), detectable_format 1 of 2 (a)
    assert st.groups == {"detectable_format": {"instructions": 2, "strict": 0.5, "loose": 0.5},
                         "punctuation": {"instructions": 3, "strict": pytest.approx(2 / 3, abs=1e-6),
                                         "loose": pytest.approx(2 / 3, abs=1e-6)}}
    rows = read_jsonl(tmp_path / "ifeval.jsonl")
    assert rows[1]["instruction_id_list"] == ["punctuation:no_comma", "detectable_format:title"]
    assert [r["prompt_strict"] for r in rows] == [True, False, True] and rows[0]["strict"] == [True, True]
    assert IFEvalStats.read(tmp_path / "ifeval.jsonl.stats.json") == st
    # K answers to one IFEval prompt: refused, not scored on the first answer alone
    many = rec("e", ["punctuation:no_comma"], "a, b")
    many.update(responses=["a, b", "no comma", "x"], finish_reasons=["stop"] * 3, response_tokens=[3] * 3)
    write_jsonl(tmp_path / "gen.jsonl", [rec("a", ["punctuation:no_comma"], "ok"), many])
    from online_rlhf.jsonl import DataError
    with pytest.raises(DataError, match=r"gen\.jsonl: 1 record\(s\) hold more than one response \(the first, id 'e', has 3\)"
                                        r".*k=1 and temperature 0"):
        ifeval_score.main(IFEvalScoreConfig(input=str(tmp_path / "gen.jsonl"), output=str(tmp_path / "k.jsonl")))
    assert not (tmp_path / "k.jsonl").exists()


# ----------------------------------------------------------------------------- KL estimate

def test_kl_is_zero_when_the_policy_is_the_reference(tmp_path):
    from online_rlhf.stage_configs import KLConfig
    from online_rlhf.stages import kl_estimate
    from online_rlhf.testing import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "tiny", seed=1)
    other = make_tiny_policy(tmp_path / "other", seed=2)
    records = [{"id": f"p{j}", "prompt": [{"role": "user", "content": f"question {j}"}],
                "responses": ["some words here", "more"], "finish_reasons": ["stop", "length"],
                "response_tokens": [4, 2]} for j in range(3)]
    write_jsonl(tmp_path / "kl_generated.jsonl", records)
    same = kl_estimate.main(KLConfig(input=str(tmp_path / "kl_generated.jsonl"), policy=str(policy),
                                     reference=str(policy), output=str(tmp_path / "kl.jsonl"), batch_size=4))
    assert same.kl_mean == 0.0 and same.samples == 6 and same.retokenized_length_differs == 6  # made-up counts
    assert same.retokenized == 6  # no sampled ids in these records: the text was re-tokenized
    rows = read_jsonl(tmp_path / "kl.jsonl")
    assert all(x == 0.0 for r in rows for x in r["kl"]) and all(lp < 0 for r in rows for lp in r["logp_policy"])
    # a different reference: log-probs differ, the per-sample differences are what the mean averages
    diff = kl_estimate.main(KLConfig(input=str(tmp_path / "kl_generated.jsonl"), policy=str(policy),
                                     reference=str(other), output=str(tmp_path / "kl2.jsonl"), batch_size=1))
    rows2 = read_jsonl(tmp_path / "kl2.jsonl")
    assert diff.kl_mean != 0.0
    flat = lambda rs, k: [x for r in rs for x in r[k]]
    assert flat(rows2, "logp_policy") == pytest.approx(flat(rows, "logp_policy"), abs=1e-4)  # batch size 1 vs 4
    assert diff.kl_mean == pytest.approx(np.mean([x for r in rows2 for x in r["kl"]]))


def test_kl_scores_the_sampled_ids_when_the_records_have_them(tmp_path):
    import torch

    from online_rlhf.jsonl import DataError
    from online_rlhf.stage_configs import KLConfig
    from online_rlhf.stages import kl_estimate
    from online_rlhf.testing import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "tiny", seed=1)
    other = make_tiny_policy(tmp_path / "other", seed=2)
    # ids no re-tokenization of the text would give: the stage must score these, not the text
    prompt_ids, responses = [5, 6, 7, 8], [[9, 10, 11], [12, 13]]
    records = [{"id": "p0", "prompt": [{"role": "user", "content": "question"}], "responses": ["x", "y"],
                "finish_reasons": ["stop", "length"], "response_tokens": [3, 2],
                "prompt_token_ids": prompt_ids, "response_token_ids": responses}]
    write_jsonl(tmp_path / "in.jsonl", records)
    st = kl_estimate.main(KLConfig(input=str(tmp_path / "in.jsonl"), policy=str(policy), reference=str(other),
                                   output=str(tmp_path / "kl.jsonl")))
    assert (st.samples, st.retokenized, st.retokenized_length_differs) == (2, 0, 0)
    assert st.tokens == 2 * len(prompt_ids) + 3 + 2  # prompt + response ids scored per model
    row = read_jsonl(tmp_path / "kl.jsonl")[0]
    assert row["response_tokens"] == [3, 2]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    with torch.no_grad():  # the sum of the response tokens' log-probs, computed by hand
        ids = torch.tensor([prompt_ids + responses[0]])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        expect = sum(logp[len(prompt_ids) - 1 + t, responses[0][t]].item() for t in range(3))
    assert row["logp_policy"][0] == pytest.approx(expect, abs=1e-4)
    records[0]["response_token_ids"] = [[9, 10, 11]]  # one id list for two responses
    write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match="record 1 .*response_token_ids"):
        kl_estimate.main(KLConfig(input=str(tmp_path / "bad.jsonl"), policy=str(policy), reference=str(other),
                                  output=str(tmp_path / "kl_bad.jsonl")))


def test_kl_log_probs_batched_longest_first_equal_one_sequence_at_a_time(tmp_path):
    """Sorting by length, padding and scoring only positions after the shortest prompt of a batch
    give each sequence the same sum as a full forward pass over that sequence alone, in input order."""
    import torch
    from transformers import AutoModelForCausalLM

    from online_rlhf.stages.kl_estimate import sequence_log_probs
    from online_rlhf.testing import make_tiny_policy

    model = AutoModelForCausalLM.from_pretrained(make_tiny_policy(tmp_path / "tiny", seed=3), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()
    seqs = [(rand(p), rand(r)) for p, r in [(3, 7), (12, 2), (1, 1), (8, 15), (5, 0), (20, 4), (2, 9)]]
    got = sequence_log_probs(model, seqs, batch_size=3, pad_id=0)
    with torch.no_grad():
        for (p, r), value in zip(seqs, got):
            logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0, :-1].float(), -1)  # (T-1, V)
            expect = sum(logp[len(p) - 1 + t, tok].item() for t, tok in enumerate(r))
            assert value == pytest.approx(expect, abs=1e-4)
    assert got[4] == 0.0  # an empty response scores nothing


def test_kl_under_bf16_autocast_stays_within_tolerance_of_float32(tmp_path, monkeypatch):
    """dtype auto on a CPU with native bf16 (forced here): bf16 autocast forwards, float32
    log-softmax. Tolerance: the KL estimate moves by at most a tenth of its standard error, and
    every per-response log-prob stays within 2% (+0.05 nats) of the float32 run's; they are not
    bit-equal (the autocast really ran)."""
    from online_rlhf.stage_configs import KLConfig
    from online_rlhf.stages import kl_estimate
    from online_rlhf.testing import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "p", seed=1, initializer_range=0.1)
    other = make_tiny_policy(tmp_path / "r", seed=2, initializer_range=0.1)
    g = np.random.default_rng(0)
    records = [{"id": f"p{j}", "prompt": [{"role": "user", "content": "q"}], "responses": ["a", "b"],
                "finish_reasons": ["length", "length"], "response_tokens": [int(n) for n in g.integers(5, 40, 2)],
                "prompt_token_ids": [int(x) for x in g.integers(5, 500, int(g.integers(3, 30)))]} for j in range(6)]
    for r in records:
        r["response_token_ids"] = [[int(x) for x in g.integers(5, 500, n)] for n in r["response_tokens"]]
    write_jsonl(tmp_path / "in.jsonl", records)
    run = lambda dtype, out: kl_estimate.main(KLConfig(input=str(tmp_path / "in.jsonl"), policy=str(policy),
                                                       reference=str(other), output=str(tmp_path / out), dtype=dtype))
    fp32 = run("float32", "kl32.jsonl")
    monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", "1")
    auto = run("auto", "kl_auto.jsonl")
    assert fp32.dtype == "float32" and auto.dtype == "float32 + bf16 autocast"
    assert auto.hardware["dtype"] == "float32 + bf16 autocast"
    flat = lambda name, k: [x for r in read_jsonl(tmp_path / name) for x in r[k]]
    assert max(abs(x) for x in flat("kl32.jsonl", "kl")) > 1.0  # two different random models: KLs far from 0
    # the estimate moves by less than a tenth of its own standard error (the Monte Carlo noise)
    assert abs(auto.kl_mean - fp32.kl_mean) <= 0.1 * fp32.kl_se
    a, b = flat("kl_auto.jsonl", "logp_policy"), flat("kl32.jsonl", "logp_policy")
    assert a == pytest.approx(b, rel=0.02, abs=0.05) and a != b
    monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", "0")  # no native bf16: auto is plain float32
    assert run("auto", "kl_off.jsonl").dtype == "float32"
    assert kl_estimate.precision("bfloat16", "cpu") == ("bfloat16", None)


def test_kl_counts_length_mismatches_only_for_re_tokenized_responses(tmp_path):
    """``retokenized_length_differs`` is about text re-tokenized here; a record with the sampled ids
    is scored on those ids, whatever its ``response_tokens`` says."""
    from online_rlhf.stage_configs import KLConfig
    from online_rlhf.stages import kl_estimate
    from online_rlhf.testing import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "tiny", seed=1)
    with_ids = {"id": "s", "prompt": [{"role": "user", "content": "question"}], "responses": ["x", "y"],
                "finish_reasons": ["stop", "length"], "response_tokens": [7, 9],  # not the id counts (3, 2)
                "prompt_token_ids": [5, 6, 7, 8], "response_token_ids": [[9, 10, 11], [12, 13]]}
    from_text = {"id": "t", "prompt": [{"role": "user", "content": "question"}], "responses": ["some words here"],
                 "finish_reasons": ["stop"], "response_tokens": [1000]}  # cannot be its re-tokenized length
    write_jsonl(tmp_path / "in.jsonl", [with_ids, from_text])
    st = kl_estimate.main(KLConfig(input=str(tmp_path / "in.jsonl"), policy=str(policy), reference=str(policy),
                                   output=str(tmp_path / "kl.jsonl")))
    assert (st.samples, st.retokenized, st.retokenized_length_differs) == (3, 1, 1)


def test_kl_response_ids_end_at_the_end_of_turn_only_when_the_response_finished():
    from online_rlhf.stages.kl_estimate import response_token_ids
    from online_rlhf.testing import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    prompt = [{"role": "user", "content": "hi"}]
    _, done = response_token_ids(tok, prompt, "hello there", "stop")
    _, cut = response_token_ids(tok, prompt, "hello there", "length")
    assert done[-1] == tok.eos_token_id and done[:-1] == cut and tok.eos_token_id not in cut


# ----------------------------------------------------------------------------- IFEval prompts

@pytest.mark.skipif(not IFEVAL.is_file(), reason=f"{IFEVAL} absent: run scripts/prepare_default.py")
def test_ifeval_preparation_yields_541_unique_prompts_with_instructions():
    from online_rlhf.records import load_prompts
    from online_rlhf.verifiers import _registry

    rows = read_jsonl(IFEVAL)
    assert len(rows) == 541 and len({r["id"] for r in rows}) == 541
    for r in rows:
        assert set(r) == {"id", "messages", "instruction_id_list", "kwargs"}
        assert [m["role"] for m in r["messages"]] == ["user"] and r["messages"][0]["content"].strip()
        assert len(r["kwargs"]) == len(r["instruction_id_list"]) >= 1
        assert all(v is not None for kw in r["kwargs"] for v in kw.values())
        assert all(i in _registry() for i in r["instruction_id_list"])  # every id has a checker
    first = rows[0]
    assert first["id"] == "1000" and first["kwargs"][2] == {"relation": "at least", "num_words": 300}
    assert sum(len(r["instruction_id_list"]) for r in rows) == 834  # IFEval's instruction count
    src = read_json(IFEVAL.with_name("ifeval.source.json"))
    assert src["license"] == "Apache-2.0" and src["total"] == 541
    assert len(load_prompts(IFEVAL)) == 541


# ----------------------------------------------------------------------------- the loop's stages

@pytest.fixture
def cfg_args(tmp_path):
    # "answer": the field the default reward (verifier) scores by; the plan checks it is there
    write_jsonl(tmp_path / "train.jsonl", [{"id": f"t{i}", "prompt": f"train {i}", "answer": str(i)} for i in range(8)])
    write_jsonl(tmp_path / "eval.jsonl", [{"id": f"e{i}", "prompt": f"eval {i}", "answer": str(i)} for i in range(4)])
    policy = tmp_path / "models" / "start"
    policy.mkdir(parents=True)
    return [f"train_prompts={tmp_path / 'train.jsonl'}", f"eval_prompts={tmp_path / 'eval.jsonl'}",
            f"output_root={tmp_path / 'runs'}", "run_name=t", f"policy={policy}", "iterations=2"]


def _plan_stages(run_dir: Path, i: int) -> list[str]:
    return list(read_json(run_dir / f"iter_{i}" / "plan.json"))


def test_ifeval_when_and_kl_samples_choose_the_planned_stages(cfg_args):
    run_dir = loop.plan(None, cfg_args)
    assert _plan_stages(run_dir, 0)[-2:] == ["ifeval_generate", "ifeval_score"]
    assert "ifeval_score" not in _plan_stages(run_dir, 1) and "ifeval_score" in _plan_stages(run_dir, 2)
    assert {"kl_generate", "kl"} <= set(_plan_stages(run_dir, 1)) and "kl" not in _plan_stages(run_dir, 0)
    run_dir = loop.plan(None, cfg_args + ["ifeval.when=every", "kl_samples=0"])
    assert all("ifeval_score" in _plan_stages(run_dir, i) for i in (0, 1, 2))
    assert not any("kl" in _plan_stages(run_dir, i) for i in (0, 1, 2))
    run_dir = loop.plan(None, cfg_args + ["ifeval.when=never"])
    assert not any("ifeval_score" in _plan_stages(run_dir, i) for i in (0, 1, 2))


def test_ifeval_and_kl_stage_configs(cfg_args):
    import yaml

    run_dir = loop.plan(None, cfg_args + ["ifeval.limit=50", "ifeval.max_tokens=200", "kl_samples=3"])
    y = lambda i, s: yaml.safe_load((run_dir / f"iter_{i}" / "configs" / f"{s}.yaml").read_text())
    gen = y(2, "ifeval_generate")
    assert (gen["limit"], gen["max_tokens"], gen["temperature"], gen["k"]) == (50, 200, 0.0, 1)
    assert gen["prompts"] == str(IFEVAL) and gen["model"] == str(run_dir / "iter_2" / "model")
    assert y(0, "ifeval_generate")["model"] == y(0, "eval_generate")["model"]  # the starting policy
    kg = y(1, "kl_generate")
    assert (kg["k"], kg["temperature"], kg["top_p"]) == (3, 1.0, 1.0)
    assert kg["prompts"] == y(1, "eval_generate")["prompts"] and kg["limit"] == y(1, "eval_generate")["limit"]
    kl = y(1, "kl")
    assert kl["policy"] == str(run_dir / "iter_1" / "model") and kl["reference"] == y(0, "eval_generate")["model"]
    with pytest.raises(loop.ConfigError, match="when"):
        loop.resolve(None, cfg_args + ["ifeval.when=sometimes"])


def _eval_file(path: Path, rewards: list[float], tokens: list[int]) -> None:
    write_jsonl(path, [{"id": f"e{j}", "prompt": [{"role": "user", "content": "q"}], "responses": [f"answer {j} words"],
                        "finish_reasons": ["stop"], "response_tokens": [t], "rewards": [r], "reward_source": "verifier"}
                       for j, (r, t) in enumerate(zip(rewards, tokens))])


def _ifeval_file(path: Path, passes: list[bool]) -> None:
    write_jsonl(path, [{"id": f"f{j}", "strict": [p], "loose": [p], "prompt_strict": p, "prompt_loose": p,
                        "response_tokens": 10, "finish_reason": "stop"} for j, p in enumerate(passes)])


def _stats(it: Path, i: int, kl: float = 0.5) -> None:
    plan = read_json(it / "plan.json")
    example_stats(GenerateStats, prompts_in=4).write(it / "eval_generated.jsonl.stats.json")
    example_stats(RewardStats).write(it / "eval.jsonl.stats.json")
    if "kl" in plan:
        example_stats(GenerateStats).write(it / "kl_generated.jsonl.stats.json")
        example_stats(KLStats, kl_mean=kl).write(it / "kl.jsonl.stats.json")
    if "ifeval_score" in plan:
        example_stats(GenerateStats).write(it / "ifeval_generated.jsonl.stats.json")
        example_stats(IFEvalStats).write(it / "ifeval.jsonl.stats.json")
    if i >= 1:
        example_stats(GenerateStats).write(it / "generated.jsonl.stats.json")
        example_stats(RewardStats).write(it / "rewards.jsonl.stats.json")
        example_stats(PairsStats).write(it / "pairs.jsonl.stats.json")
        example_stats(DPOStats).write(it / "model.stats.json")
        write_jsonl(it / "generated.jsonl", [{"id": "t0", "finish_reasons": ["stop", "stop"]}])
        write_jsonl(it / "pairs.jsonl", [{"id": "t0"}])


def test_metrics_compare_with_iteration_0_and_warn_on_kl(cfg_args, capsys):
    run_dir = loop.plan(None, cfg_args + ["kl_warn=1.0"])
    _eval_file(run_dir / "iter_0" / "eval.jsonl", [0.0, 0.5, 0.5, 1.0], [100, 80, 60, 40])
    _ifeval_file(run_dir / "iter_0" / "ifeval.jsonl", [False] * 10)
    _stats(run_dir / "iter_0", 0)
    row0 = loop.metrics(run_dir, 0)
    assert row0["eval_reward_vs_0"] is None and row0["kl"]["kl_mean"] == 0.0
    assert row0["ifeval"]["prompt_strict"] == 0.5 and row0["eval_median_response_tokens"] == 70
    assert row0["eval_reward_lc"] == pytest.approx(0.5)
    # iteration 1: every reward +0.25 at the same lengths; KL under the threshold
    _eval_file(run_dir / "iter_1" / "eval.jsonl", [0.25, 0.75, 0.75, 1.25], [100, 80, 60, 40])
    _stats(run_dir / "iter_1", 1, kl=0.5)
    row1 = loop.metrics(run_dir, 1)
    assert row1["eval_reward_vs_0"]["diff"] == pytest.approx(0.25) and row1["eval_reward_vs_0"]["ci95"][0] > 0
    assert row1["eval_reward_lc_vs_0"]["diff"] == pytest.approx(0.25)
    assert row1["kl"]["kl_mean"] == 0.5 and not row1["warnings"]
    # iteration 2: the same rewards as iteration 0, IFEval gains 10 of 10 prompts, KL over kl_warn
    _eval_file(run_dir / "iter_2" / "eval.jsonl", [0.0, 0.5, 0.5, 1.0], [100, 80, 60, 40])
    _ifeval_file(run_dir / "iter_2" / "ifeval.jsonl", [True] * 10)
    _stats(run_dir / "iter_2", 2, kl=7.5)
    capsys.readouterr()
    assert loop.main(["metrics", str(run_dir), "2"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: iteration 2: KL(policy || starting policy) = 7.50" in out and "kl_warn=1.0" in out
    assert "vs iteration 0 +0.0000" in out and "KL 7.500 nats" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[2]["eval_reward_vs_0"]["p_value"] == 1.0
    assert rows[2]["ifeval_vs_0"]["new_only"] == 10 and rows[2]["ifeval_vs_0"]["p_value"] == pytest.approx(2 * 0.5 ** 10)
    assert rows[2]["ifeval_vs_0"]["prompt_strict_diff"] == 1.0
    # one length fit over every iteration: rows 0 and 1 were refitted when iteration 2 came in
    assert len({r["eval_length_slope"] for r in rows}) == 1
    assert rows[0]["eval_reward_lc"] == pytest.approx(0.5) and rows[2]["eval_reward_lc"] == pytest.approx(0.5)
    text = loop.report(run_dir).read_text()
    assert "## Against iteration 0 (paired), length and drift" in text and "## IFEval" in text
    assert "+0.2500 (" in text and "exceeds kl_warn=1.0" in text
    assert "| 2 | 2 | 50.0 | 50.0 | 66.7 | 66.7 | – | +100.0 (p=0.00195; 10 gained, 0 lost) |" in text  # example stats (no groups)
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "+0.2500 (+0.2500–+0.2500), p<1e-04" in text
    assert not math.isnan(rows[1]["eval_distinct_1"])


def test_report_shows_what_flipped_and_the_console_ends_with_the_ifeval_verdict(cfg_args, capsys):
    from online_rlhf.loop.report import verdict

    run_dir = loop.plan(None, cfg_args)
    answers = lambda it, tag, n: write_jsonl(run_dir / f"iter_{it}" / "ifeval_generated.jsonl", [  # noqa: E731
        {"id": f"f{j}", "prompt": [{"role": "user", "content": f"prompt {j}"}], "responses": [f"{tag} answer {j} <<t>>"],
         "finish_reasons": ["stop"]} for j in range(n)])
    _eval_file(run_dir / "iter_0" / "eval.jsonl", [0.0, 0.5, 0.5, 1.0], [100, 80, 60, 40])
    _ifeval_file(run_dir / "iter_0" / "ifeval.jsonl", [False] * 10 + [True])
    answers(0, "old", 11)
    _stats(run_dir / "iter_0", 0)
    scored = lambda it, n: example_stats(IFEvalStats, prompt_strict=n / 11, instruction_strict=n / 11,  # noqa: E731
                                         records_scored=11).write(run_dir / f"iter_{it}" / "ifeval.jsonl.stats.json")
    scored(0, 1)
    loop.metrics(run_dir, 0)
    assert verdict(run_dir) == "iteration 0: nothing to compare with iteration 0 yet."
    _eval_file(run_dir / "iter_1" / "eval.jsonl", [0.0, 0.5, 0.5, 1.0], [100, 80, 60, 40])
    _stats(run_dir / "iter_1", 1)
    loop.metrics(run_dir, 1)
    _eval_file(run_dir / "iter_2" / "eval.jsonl", [1.0, 0.5, 0.0, 1.0], [100, 80, 60, 40])
    _ifeval_file(run_dir / "iter_2" / "ifeval.jsonl", [True] * 8 + [False] * 3)  # 8 gained, f10 lost
    answers(2, "new", 11)
    _stats(run_dir / "iter_2", 2)
    scored(2, 8)
    loop.metrics(run_dir, 2)
    capsys.readouterr()
    assert loop.main(["verdict", str(run_dir)]) == 0
    # 1/11 -> 8/11; exact McNemar on 8 gained vs 1 lost: 2 x (1 + 9) / 2^9
    assert capsys.readouterr().out.strip() == (
        "IFEval prompt-level strict 9.1 -> 72.7 at iteration 2 (+63.6 points, up; 8 prompts gained, 1 lost; exact "
        "McNemar p = 0.039: significant at 0.05); instruction-level 9.1 -> 72.7; 11 prompts.")
    text = loop.report(run_dir).read_text()
    assert "## What changed: IFEval prompts that flipped (iteration 0 vs 2)" in text and "8 prompts gained, 1 lost" in text
    assert "| f0 (gained) | prompt 0 |" in text and "| f10 (lost) |" in text and "| f3 (gained)" not in text  # 3 shown
    assert "✗<br>old answer 0 &lt;&lt;t&gt;&gt; | ✓<br>new answer 0 &lt;&lt;t&gt;&gt; |" in text
    assert "## What changed: held-out prompts whose reward moved most (iteration 0 vs 2)" in text
    assert "| e0 (+1.00) | q | 0.00<br>answer 0 words | 1.00<br>answer 0 words |" in text and "| e2 (-0.50) |" in text
    # without IFEval at the last iteration the verdict is the held-out reward's
    (run_dir / "iter_2" / "ifeval.jsonl").unlink()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rows[-1]["ifeval_vs_0"] = None
    write_jsonl(run_dir / "metrics.jsonl", rows)
    assert verdict(run_dir).startswith("held-out reward 0.5000 -> 0.6250 at iteration 2 (+0.1250, paired bootstrap p=")
    # a metrics file the loop did not write, or one with no row yet: a clear error, not a traceback
    from online_rlhf.jsonl import DataError
    write_jsonl(run_dir / "metrics.jsonl", [{"iteration": 0, **{k: v for k, v in rows[0].items() if k != "iteration"}},
                                            {"eval_reward_mean": 0.5}])
    with pytest.raises(DataError, match=r"metrics\.jsonl: row 2 has no iteration number"):
        verdict(run_dir)
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match=r"metrics\.jsonl: empty: the run has not finished an iteration yet"):
        verdict(run_dir)


def test_metrics_line_shows_the_kl_with_its_standard_error():
    from online_rlhf import loop

    row = {"iteration": 1, "eval_reward_mean": 0.5, "eval_reward_ci95": [0.4, 0.6], "eval_prompts": 4,
           "kl": {"kl_mean": -0.167, "kl_se": 0.21, "samples": 8}}
    assert loop.metrics_line(row).endswith(", KL -0.167 nats (se 0.210)")
    row["kl"] = {"kl_mean": 0.5}  # a row without the se (older metrics) still shows the mean
    assert loop.metrics_line(row).endswith(", KL 0.500 nats")
