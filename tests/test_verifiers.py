"""Rule-based rewards (online_rlhf/verifiers.py) on real GSM8K / IFEval / IFBench prompts.

GSM8K and IFEval records come from tests/data (see its README); IFBench prompts from the
default split that scripts/prepare_default.py builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from online_rlhf import verifiers
from online_rlhf.paths import cache_dir, default_data_dir
from online_rlhf.records import normalize_prompt_record
from online_rlhf.stage_configs import RewardConfig

DATA = Path(__file__).resolve().parent / "data"
GSM8K = DATA / "gsm8k_test_first5.jsonl"  # first 5 lines of GSM8K test
IFEVAL = DATA / "ifeval_input_data_4.jsonl"  # IFEval keys 1001, 1019, 1072, 1268


def cfg(**kw) -> RewardConfig:
    return RewardConfig(input="generated.jsonl", output="rewards.jsonl", source="verifier", **kw)


def generated(prompt_rec: dict, responses: list[str]) -> dict:
    return {**prompt_rec, "responses": responses, "finish_reasons": ["stop"] * len(responses)}


def nltk_data_ready() -> bool:
    return (cache_dir() / "nltk_data" / "tokenizers" / "punkt_tab" / "english" / "ortho_context.tab").is_file()


needs_nltk_data = pytest.mark.skipif(not nltk_data_ready(), reason="NLTK data not prepared: run scripts/prepare_default.py")


@pytest.fixture(scope="module")
def gsm8k() -> list[dict]:
    with open(GSM8K) as f:
        return [normalize_prompt_record(json.loads(next(f)), i, "gsm8k", "question") for i in range(5)]


@pytest.fixture(scope="module")
def ifeval() -> dict[str, dict]:
    rows = {}
    with open(IFEVAL) as f:
        for i, line in enumerate(f):
            r = normalize_prompt_record(json.loads(line), i, "ifeval")
            rows[r["id"]] = r
    return rows


# ----------------------------------------------------------------------------- math
def test_math_gsm8k_correct_and_wrong(gsm8k):
    rec = gsm8k[0]  # Janet's ducks: #### 18
    responses = ["She sells 9 eggs at $2, so she makes \\boxed{18} dollars.",
                 "9 * 2 = 18\n#### 18",
                 "The answer is 17.",
                 "I do not know."]
    res = verifiers.score([generated(rec, responses)], cfg())
    rewards, stats = res.rewards, res
    assert rewards == [[1.0, 1.0, 0.0, 0.0]]
    assert stats.source_stats["by_verifier"] == {"math": 1}


def test_math_gold_solution_scores_itself(gsm8k):
    res = verifiers.score([generated(r, [r["answer"]]) for r in gsm8k], cfg(verifier="math"))
    rewards = res.rewards
    assert rewards == [[1.0]] * len(gsm8k)


def test_math_equivalent_latex_forms():
    rec = {"id": "m", "prompt": [{"role": "user", "content": "half?"}], "answer": "\\frac{1}{2}"}
    res = verifiers.score([generated(rec, ["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}", "\\boxed{2}"])], cfg())
    rewards = res.rewards
    assert rewards == [[1.0, 1.0, 0.0]]


def test_gsm8k_gold_with_thousands_separator():
    assert verifiers.gold_answer_text("so 1,000 + 234\n#### 1,234") == "1234"


# ----------------------------------------------------------------------------- IFEval
def test_ifeval_lowercase(ifeval):
    rec = ifeval["1019"]  # change_case:english_lowercase
    good = "what are the two young boys with toy guns and horns going to play in the park this afternoon?"
    res = verifiers.score([generated(rec, [good, good.capitalize()])], cfg(ifeval_mode="strict"))
    rewards = res.rewards
    assert rewards == [[1.0, 0.0]]


def test_ifeval_no_comma(ifeval):
    rec = ifeval["1001"]  # punctuation:no_comma
    res = verifiers.score([generated(rec, ["Day one: Tokyo. Day two: Kyoto.", "Day one: Tokyo, then Kyoto."])], cfg())
    rewards = res.rewards
    assert rewards == [[1.0, 0.0]]


def test_ifeval_word_count(ifeval):
    rec = ifeval["1072"]  # at least 400 words
    res = verifiers.score([generated(rec, ["hammock " * 400, "hammocks are good " * 5])], cfg())
    rewards = res.rewards
    assert rewards == [[1.0, 0.0]]


@needs_nltk_data
def test_ifeval_sentence_count_uses_offline_punkt(ifeval):
    rec = ifeval["1268"]  # fewer than 6 sentences: NLTK punkt sentence tokenizer
    few = "I felt calm today. I walked for an hour. Then I wrote this."
    many = " ".join(f"Sentence number {i} is here." for i in range(8))
    res = verifiers.score([generated(rec, [few, many])], cfg())
    rewards, stats = res.rewards, res
    assert rewards == [[1.0, 0.0]], stats


def test_partial_versus_all(ifeval):
    rec = {**ifeval["1019"], "instruction_id_list": ["change_case:english_lowercase", "punctuation:no_comma"],
           "kwargs": [{}, {}]}
    resp = "what are the boys going to do, and where are they going to play this afternoon in the park?"
    res = verifiers.score([generated(rec, [resp])], cfg(ifeval_score="partial"))
    partial = res.rewards
    res = verifiers.score([generated(rec, [resp])], cfg(ifeval_score="all"))
    all_ = res.rewards
    assert (partial, all_) == ([[0.5]], [[0.0]])


def test_loose_ignores_a_first_line_that_strict_counts(ifeval):
    rec = ifeval["1019"]
    resp = "Sure! Here Is My Question:\nwhat are the two young boys with toy guns and horns going to play in the park?"
    res = verifiers.score([generated(rec, [resp])], cfg(ifeval_mode="strict"))
    strict = res.rewards
    res = verifiers.score([generated(rec, [resp])], cfg(ifeval_mode="loose"))
    loose = res.rewards
    assert (strict, loose) == ([[0.0]], [[1.0]])


def test_a_record_whose_checker_would_draw_an_argument_is_unscorable_naming_it(ifeval):
    # olmo-eval PR #296: with no num_words/relation the checker draws them afresh for every response,
    # so 20 copies of one answer got 8 x 1.0 and 12 x 0.0; such a record is counted, not scored
    rec = {**ifeval["1072"], "kwargs": [{}]}
    res = verifiers.score([generated(rec, [" ".join(["word"] * 50)] * 20)], cfg())
    assert res.rewards == [None] and res.skipped == {"argument_drawn_by_checker": 1}
    assert res.examples == {"argument_drawn_by_checker": ["1072 (length_constraints:number_words: num_words, relation)"]}


def _paragraphs_record(nth: int) -> dict:
    # the builder's old draw (NeMo-Skills PR #1375): "There should be 3 paragraphs ... Paragraph 4 must start with ..."
    return {"id": "if-tpl-39-22", "prompt": [{"role": "user", "content": "Write a poem about the moon."}],
            "instruction_id_list": ["length_constraints:nth_paragraph_first_word"],
            "kwargs": [{"num_paragraphs": 3, "nth_paragraph": nth, "first_word": "ambition"}]}


def test_a_paragraph_past_the_last_is_unscorable_and_one_in_range_scores_the_same_every_time():
    answer = "The moon is bright.\n\nAmbition is a climb.\n\nThe night is long."
    res = verifiers.score([generated(_paragraphs_record(4), [answer] * 8)], cfg())
    assert res.rewards == [None]
    assert res.examples["argument_drawn_by_checker"] == ["if-tpl-39-22 (length_constraints:nth_paragraph_first_word: "
                                                         "nth_paragraph)"]
    res = verifiers.score([generated(_paragraphs_record(2), [answer] * 20)], cfg())
    assert res.rewards == [[1.0] * 20]
    assert verifiers.drawn_arguments(_paragraphs_record(2)) == []


def test_a_span_from_index_0_is_unscorable_because_its_checker_reads_0_as_unset():
    # IFBench's held-out id 286 (repeat:repeat_span, n_start 0): the checker draws another start
    text = "The walls are solid but the stones are cracked and cold. "
    rec = {"id": "286", "prompt": [{"role": "user", "content": text + "Copy the span from index 0 to 7."}],
           "instruction_id_list": ["repeat:repeat_span"], "kwargs": [{"n_start": 0, "n_end": 7, "prompt_to_repeat": text}]}
    assert verifiers.drawn_arguments(rec) == [("repeat:repeat_span", ["n_start"])]
    res = verifiers.score([generated(rec, ["The walls are solid but the stones are", "no"])], cfg())
    assert res.rewards == [None] and res.skipped == {"argument_drawn_by_checker": 1}
    assert verifiers.drawn_arguments({**rec, "kwargs": [{"n_start": 1, "n_end": 7, "prompt_to_repeat": text}]}) == []


IFEVAL_DRAWN = DATA / "ifeval_input_data_1122_1129.jsonl"  # IFEval keys 1122, 1129: letter '#' and '!'


def test_ifevals_own_redrawn_letters_are_drawn_once_per_record_and_kept():
    """The benchmark as shipped: IFEval's checker reads '#' and '!' as no letter and draws one. The
    IFEval scores keep those records; the draw comes from the record's seed, the same on every call."""
    with open(IFEVAL_DRAWN) as f:
        recs = [normalize_prompt_record(json.loads(line), i, "ifeval") for i, line in enumerate(f)]
    assert [(r["id"], verifiers.drawn_arguments(r)) for r in recs] == [
        ("1122", [("keywords:letter_frequency", ["letter"])]), ("1129", [("keywords:letter_frequency", ["letter"])])]
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    for rec in recs:
        letter = rec["instruction_id_list"].index("keywords:letter_frequency")
        strict = {}
        for n in (1, 7):  # the drawn letter appears n times; the records ask for at least 4 and 6
            outcomes = {repr(verifiers.ifeval_instruction_results(rec, alphabet * n)) for _ in range(20)}
            assert len(outcomes) == 1  # the same draw on every call
            strict[n] = verifiers.ifeval_instruction_results(rec, alphabet * n)[0][letter]
        assert strict == {1: False, 7: True}
        # under the training reward the same record is refused, naming the argument
        res = verifiers.score([generated(rec, [alphabet] * 4)], cfg())
        assert res.rewards == [None] and res.examples["argument_drawn_by_checker"][0].endswith("letter)")
    # the ifeval_score stage scores both and lists them in its stats
    from online_rlhf.stages.ifeval_score import score_records

    out, skipped, _, drawn = score_records([generated(r, [alphabet]) for r in recs])
    assert [o["id"] for o in out] == ["1122", "1129"] and not skipped
    assert drawn == {"1122": "keywords:letter_frequency: letter", "1129": "keywords:letter_frequency: letter"}


def test_twenty_identical_answers_get_one_reward(ifeval):
    rec = ifeval["1072"]  # number_words at least 400, its arguments set
    resp = " ".join(["word"] * 420)
    assert set(verifiers.score([generated(rec, [resp] * 20)], cfg()).rewards[0]) == {1.0}


@needs_nltk_data
def test_nltk_follows_the_cache_in_force_when_scoring(tmp_path, ifeval):
    """A process that scored once with another cache (a test pointing ONLINE_RLHF_CACHE at a temporary
    folder, then setup_cache_env) finds NLTK's data again once the cache is back: the search path is
    set at every scoring, not at the first one. Run in a fresh process, where nothing is loaded yet."""
    import os
    import subprocess
    import sys

    from online_rlhf.paths import PROJECT_ROOT

    code = f"""
import json, os
from online_rlhf import verifiers
from online_rlhf.paths import setup_cache_env
from online_rlhf.records import normalize_prompt_record
from online_rlhf.stage_configs import RewardConfig
cfg = RewardConfig(input="g.jsonl", output="r.jsonl", source="verifier")
rec = {{**{json.dumps(ifeval["1268"])}, "responses": ["I felt calm. I walked."], "finish_reasons": ["stop"]}}
real = os.environ.get("ONLINE_RLHF_CACHE")
os.environ["ONLINE_RLHF_CACHE"] = {str(tmp_path / "cache")!r}
setup_cache_env()  # sets NLTK_DATA into the temporary cache, as a stage's main does
first = verifiers.score([rec], cfg)
if real is None:
    del os.environ["ONLINE_RLHF_CACHE"]
else:
    os.environ["ONLINE_RLHF_CACHE"] = real
again = verifiers.score([rec], cfg)
print(json.dumps([first.rewards, dict(first.skipped), again.rewards, dict(again.skipped)]))
"""
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, first_skipped, again, again_skipped = json.loads(out.stdout.strip().splitlines()[-1])
    assert (first, first_skipped) == ([None], {"checker_error:LookupError": 1})
    assert (again, again_skipped) == ([[1.0]], {})


# ----------------------------------------------------------------------------- IFBench default prompts
@pytest.fixture(scope="module")
def ifbench() -> list[dict]:
    d = default_data_dir()
    if not (d / "split.json").is_file():
        pytest.skip("default prompts not prepared: run scripts/prepare_default.py")
    rows = []
    for name in ("ifbench_train.jsonl", "ifbench_eval.jsonl"):
        with open(d / name) as f:
            rows += [normalize_prompt_record(json.loads(line), i, name) for i, line in enumerate(f)]
    return rows


def test_ifbench_keyword_prompt_scores(ifbench):
    rec = next(r for r in ifbench if r["id"] == "0")  # kaleidoscope 1, nebula 2, whisper 3, labyrinth 5, paradox 7
    good = ("kaleidoscope " + "nebula " * 2 + "whisper " * 3 + "labyrinth " * 5 + "paradox " * 7).strip() + "."
    res = verifiers.score([generated(rec, [good, "No keywords at all."])], cfg())
    rewards, stats = res.rewards, res
    assert rewards == [[1.0, 0.0]], stats


@needs_nltk_data
def test_ifbench_default_prompts_scorable(ifbench):
    recs = [generated(r, ["This is a short answer. It has two sentences."]) for r in ifbench]
    res = verifiers.score(recs, cfg())
    rewards, stats = res.rewards, res
    assert len(ifbench) == 294
    # all but the words:start_verb prompts (NLTK's POS tagger data is not on PyPI) and id 286 (repeat_span
    # from index 0, which its checker reads as unset and draws again) are scorable
    start_verb = sum("words:start_verb" in r["instruction_id_list"] for r in ifbench)
    assert stats.source_stats["scored"] == 294 - start_verb - 1, stats
    assert stats.skipped == {"checker_error:LookupError": start_verb, "argument_drawn_by_checker": 1}
    assert stats.examples["argument_drawn_by_checker"] == ["286 (repeat:repeat_span: n_start)"]
    assert all(r is None or all(0.0 <= x <= 1.0 for x in r) for r in rewards)


# ----------------------------------------------------------------------------- unscorable and offline
def test_unscorable_records_counted():
    p = [{"role": "user", "content": "hi"}]
    recs = [generated({"id": "a", "prompt": p}, ["x"]),
            generated({"id": "b", "prompt": p, "instruction_id_list": ["no:such_instruction"], "kwargs": [{}]}, ["x"]),
            generated({"id": "c", "prompt": p, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, ["x"]),
            generated({"id": "d", "prompt": p, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}, ["x"])]
    res = verifiers.score(recs, cfg())
    rewards, stats = res.rewards, res
    assert rewards == [None, None, None, [1.0]]
    assert stats.skipped == {"missing_field": 1, "unknown_instruction:no:such_instruction": 1, "bad_field:kwargs": 1}
    assert stats.source_stats["scored"] == 1
    # each reason names its records (the stats' examples), not only the reasons that carry a detail
    assert [stats.examples[k][0].split()[0] for k in ("missing_field", "unknown_instruction:no:such_instruction",
                                                      "bad_field:kwargs")] == ["a", "b", "c"]


def test_math_verifier_without_answer_is_unscorable():
    rec = generated({"id": "a", "prompt": [{"role": "user", "content": "2+2?"}]}, ["4"])
    res = verifiers.score([rec], cfg(verifier="math"))
    rewards, stats = res.rewards, res
    assert rewards == [None] and stats.skipped == {"missing_field:answer": 1}


def test_math_verifier_gold_without_math_is_unscorable():
    recs = [generated({"id": i, "prompt": [{"role": "user", "content": "?"}], "answer": a}, ["???", "7"])
            for i, a in (("a", "???"), ("b", ""), ("c", "#### 7"))]
    res = verifiers.score(recs, cfg(verifier="math"))
    rewards, stats = res.rewards, res
    assert rewards == [None, None, [0.0, 1.0]]
    assert stats.skipped == {"gold_unparsable": 1, "missing_field:answer": 1}


def test_nltk_never_downloads():
    import nltk

    verifiers._registry()
    assert nltk.download is verifiers._refuse_download
    assert nltk.download("punkt") is False


def test_get_rewards_warns_when_over_a_tenth_of_the_responses_are_unscored(tmp_path, monkeypatch, capsys):
    from collections import Counter

    from online_rlhf.jsonl import write_jsonl
    from online_rlhf.stages import get_rewards
    from online_rlhf.stats import ScoreResult

    prompt = [{"role": "user", "content": "Say hi."}]
    recs = [{"id": f"p{i}", "prompt": prompt, "responses": ["a", "b", "c", "d", "e"], "finish_reasons": ["stop"] * 5}
            for i in range(2)]
    write_jsonl(tmp_path / "generated.jsonl", recs)
    cfg = RewardConfig(input=str(tmp_path / "generated.jsonl"), output=str(tmp_path / "rewards.jsonl"))

    def fake(n_none):  # the first n_none responses of p0 unscored
        rewards = [[None] * n_none + [1.0, 2.0, 3.0, 4.0, 5.0][n_none:], [1.0, 2.0, 3.0, 4.0, 5.0]]
        res = ScoreResult(rewards=rewards, responses_unscored=Counter({"no_instruction_ids": n_none} if n_none else {}))
        return lambda cfg, scorable: (res, True, 1)

    monkeypatch.setattr(get_rewards, "_score", fake(1))  # 1 of 10: at the threshold, no warning
    assert get_rewards.main(cfg).warnings == []
    monkeypatch.setattr(get_rewards, "_score", fake(2))  # 2 of 10
    stats = get_rewards.main(cfg)
    assert len(stats.warnings) == 1
    w = stats.warnings[0]
    assert "2 of 10 responses (20%) have no reward from source=verifier" in w
    assert "{'no_instruction_ids': 2}" in w and "instruction_id_list" in w and "rewards.jsonl.stats.json" in w
    assert f"WARNING: {w}" in capsys.readouterr().err


def test_get_rewards_counts_the_blank_lines_of_its_input(tmp_path, capsys):
    from online_rlhf.jsonl import write_jsonl
    from online_rlhf.stages import get_rewards

    prompt = [{"role": "user", "content": "What is 2+2?"}]
    src = tmp_path / "generated.jsonl"
    write_jsonl(src, [{"id": "p0", "prompt": prompt, "responses": ["4", "5"], "finish_reasons": ["stop"] * 2,
                       "answer": "4"}])
    src.write_text("\n" + src.read_text() + "  \n")
    stats = get_rewards.main(RewardConfig(input=str(src), output=str(tmp_path / "rewards.jsonl"), verifier="math"))
    assert stats.records_scored == 1 and stats.input_blank_lines == 2
    assert f"note: skipped 2 blank line(s) in {src} (line 1, 3)" in capsys.readouterr().err


_P = [{"role": "user", "content": "Answer in lowercase: what is 2+2?"}]


@pytest.mark.parametrize("verifier,fields", [
    ("auto", {}), ("auto", {"answer": "4"}), ("auto", {"answer": ""}), ("auto", {"instruction_id_list": []}),
    ("auto", {"instruction_id_list": ["change_case:english_lowercase"]}),
    ("auto", {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}, {}]}),
    ("auto", {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": [None], "answer": "4"}),
    ("math", {"instruction_id_list": ["change_case:english_lowercase"]}), ("math", {"answer": "#### 4"}),
    ("ifeval", {"answer": "4"}), ("ifeval", {"instruction_id_list": ["change_case:english_lowercase"], "kwargs": "x"}),
])
def test_missing_fields_agrees_with_what_score_cannot_score(verifier, fields):
    """The plan's check (missing_fields) refuses exactly the records the stage would skip for a missing/bad field."""
    rec = {"id": "r", "prompt": _P, "responses": ["four", "4"], "finish_reasons": ["stop"] * 2, **fields}
    skipped = verifiers.score([rec], cfg(verifier=verifier)).skipped
    field_reasons = [r for r in skipped if r.startswith(("missing_field", "bad_field"))]
    assert (verifiers.missing_fields(rec, verifier) is None) == (not field_reasons), (skipped, fields)
