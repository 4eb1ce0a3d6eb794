"""The IF prompt builder (online_rlhf/if_prompts.py): IFEval registry constraints on other prompts."""

import hashlib
from pathlib import Path

import pytest

from online_rlhf import if_prompts as ifp
from online_rlhf.config import ConfigError
from online_rlhf.jsonl import read_json, read_jsonl, write_jsonl
from online_rlhf.verifiers import ifeval_rewards


def _cfg(tmp_path: Path, **kw) -> ifp.IFPromptsConfig:
    return ifp.IFPromptsConfig(output=str(tmp_path / "out.jsonl"), decontaminate=None, **kw)


def test_every_record_is_scored_by_the_verifier_as_it_stands(tmp_path):
    base = ifp.template_prompts(200)
    texts = {b["id"]: b["prompt"][0]["content"] for b in base}
    recs, stats = ifp.build(base, _cfg(tmp_path, max_constraints=3), None)
    assert len(recs) == 200 and stats["prompts_out"] == 200
    _, conflicts = ifp.registry()
    for r in recs:
        ids = r["instruction_id_list"]
        assert 1 <= len(ids) <= 3 and len(r["kwargs"]) == len(ids) and len(set(ids)) == len(ids)
        # never two ids the registry declares as conflicting
        assert not any(b in conflicts[a] for a in ids for b in ids if a != b), ids
        # the checkers score the record with its own kwargs (an empty answer follows no constraint,
        # except a forbidden-words / letter-frequency one)
        rewards = ifeval_rewards({**r, "prompt": r["messages"]}, ["", "some answer"], "strict", "partial")
        assert all(0.0 <= x <= 1.0 for x in rewards)
        assert r["messages"][-1]["content"].startswith(texts[r["base_id"]] + " ")  # the constraints follow the task
    # every registry id is drawn somewhere in 200 prompts, none of the excluded ones
    assert len(stats["prompts_per_instruction"]) == len(ifp.registry()[0])


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_constraints(tmp_path):
    def digest(seed):
        cfg = _cfg(tmp_path, seed=seed)
        cfg.output = str(tmp_path / f"s{seed}.jsonl")
        ifp.main(cfg)
        return hashlib.sha256(Path(cfg.output).read_bytes()).hexdigest()

    assert digest(3) == digest(3)
    assert digest(3) != digest(4)


def test_repeat_prompt_repeats_the_base_prompt_and_comes_last(tmp_path):
    base = [{"id": f"b{i}", "prompt": [{"role": "user", "content": f"Write about topic number {i}."}]} for i in range(300)]
    recs, _ = ifp.build(base, _cfg(tmp_path, min_constraints=2, max_constraints=2), None)
    rep = [r for r in recs if "combination:repeat_prompt" in r["instruction_id_list"]]
    assert rep
    for r in rep:
        assert r["instruction_id_list"][-1] == "combination:repeat_prompt"
        assert r["kwargs"][-1]["prompt_to_repeat"] == next(b for b in base if b["id"] == r["base_id"])["prompt"][0]["content"]


def test_decontamination_drops_base_prompts_sharing_an_8gram_and_counts_them(tmp_path):
    ifeval = [{"id": "e1", "prompt": [{"role": "user", "content":
                                       "Write a funny haiku about moms in Japanese, all in lowercase letters please."}]}]
    base = [{"id": "dup", "prompt": [{"role": "user", "content": "Please write a funny haiku about moms in Japanese today."}]},
            {"id": "seven", "prompt": [{"role": "user", "content": "a funny haiku about moms in Japanese"}]},  # 7 words
            {"id": "ok", "prompt": [{"role": "user", "content": "Write a limerick about cats."}]},
            {"id": "done", "prompt": [{"role": "user", "content": "x"}], "instruction_id_list": ["punctuation:no_comma"]}]
    recs, stats = ifp.build(base, _cfg(tmp_path), ifeval)
    assert [r["base_id"] for r in recs] == ["seven", "ok"]
    assert stats["skipped"] == {"contaminated": 1, "already_constrained": 1}
    assert stats["skipped_examples"]["contaminated"] == ["dup"]
    assert stats["n"] is None and stats["base_prompts_not_read"] == 0
    # n=1: the first clean prompt is built; the rows after it are counted as not read, not lost silently
    recs, stats = ifp.build(base, _cfg(tmp_path, n=1), ifeval)
    assert [r["base_id"] for r in recs] == ["seven"]
    assert stats["n"] == 1 and stats["base_prompts_not_read"] == 2 and stats["skipped"] == {"contaminated": 1}


def test_exclude_and_bad_settings_are_refused_or_honoured(tmp_path):
    recs, stats = ifp.build(ifp.template_prompts(100), _cfg(tmp_path, exclude=["language:response_language"]), None)
    assert "language:response_language" not in stats["prompts_per_instruction"]
    with pytest.raises(ConfigError, match="unknown IFEval instruction id"):
        ifp.build(ifp.template_prompts(5), _cfg(tmp_path, exclude=["no:such_id"]), None)
    with pytest.raises(ConfigError, match="max_constraints=1 is below min_constraints=2"):
        ifp.IFPromptsConfig.from_dict({"output": "x", "min_constraints": 2, "max_constraints": 1})
    with pytest.raises(ConfigError, match="built-in templates make 2000 prompts"):
        ifp.template_prompts(2001)


def test_a_users_prompt_set_keeps_its_fields_and_the_stats_file_is_written(tmp_path):
    src = tmp_path / "mine.jsonl"
    write_jsonl(src, [{"id": "q1", "instruction": "Describe a sunrise.", "source": "me"},
                      {"id": "q2", "instruction": "List three fruits.", "source": "me"}])
    cfg = ifp.IFPromptsConfig(input=str(src), prompt_field="instruction", output=str(tmp_path / "if.jsonl"),
                              decontaminate=None)
    ifp.main(cfg)
    rows = read_jsonl(tmp_path / "if.jsonl")
    assert [r["id"] for r in rows] == ["if-q1", "if-q2"] and all(r["source"] == "me" for r in rows)
    assert rows[0]["messages"][0]["content"].startswith("Describe a sunrise. ")
    assert read_json(tmp_path / "if.jsonl.stats.json")["prompts_out"] == 2


def test_the_default_if_prompts_share_no_8gram_with_ifeval():
    from online_rlhf.paths import default_data_dir
    from online_rlhf.records import load_prompts

    data = default_data_dir()
    if not (data / "if_train.jsonl").is_file():
        pytest.skip("scripts/prepare_default.py has not run")  # run_tests.sh runs it first
    train = read_jsonl(data / "if_train.jsonl")
    assert len(train) >= 1000
    grams = ifp.contamination_index(load_prompts(data / "ifeval.jsonl"), 8)
    bases = {r["base_id"]: r["messages"][-1]["content"] for r in train}
    templates = {r["id"]: r["prompt"][0]["content"] for r in ifp.template_prompts()}
    assert all(not (ifp.word_ngrams(templates[b], 8) & grams) for b in bases)


def test_output_over_the_input_or_a_folder_is_refused_and_a_short_draw_is_counted(tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "a", "prompt": "Describe a sunrise."}])
    for out, msg in ((src, "is the input file"), (tmp_path, "is a folder"), (tmp_path / "o.parquet", "name the file")):
        with pytest.raises(ConfigError, match=msg):
            ifp.main(ifp.IFPromptsConfig(input=str(src), output=str(out), decontaminate=None))
    # 25 ids cannot all be combined: a prompt asked for 20 gets fewer, and the stats count it
    _, stats = ifp.build(ifp.template_prompts(20), _cfg(tmp_path, min_constraints=20, max_constraints=20), None)
    assert stats["prompts_below_min_constraints"] == 20


def test_an_unsatisfiable_draw_is_drawn_again_and_counted(tmp_path):
    # the registry's sampler can ask for "less than 1 sentence", which only an empty answer meets
    assert ifp.unsatisfiable("length_constraints:number_sentences", {"num_sentences": 1, "relation": "less than"})
    assert not ifp.unsatisfiable("length_constraints:number_sentences", {"num_sentences": 1, "relation": "at least"})
    assert not ifp.unsatisfiable("keywords:frequency", {"keyword": "dog", "frequency": 1, "relation": "less than"})
    recs, stats = ifp.build(ifp.template_prompts(2000), _cfg(tmp_path, max_constraints=2), None)
    assert not any(ifp.unsatisfiable(i, kw) for r in recs for i, kw in zip(r["instruction_id_list"], r["kwargs"]))
    assert sum(stats["arguments_redrawn"]["unsatisfiable"].values()) >= 1  # else 3 of these 2,000 could not be met


def test_no_record_of_ten_seeds_leaves_an_argument_for_its_checker_to_draw(tmp_path):
    """NeMo-Skills PR #1375: the registry's sampler asks for paragraph N+1 of N once in N+1 draws
    (119 of 399 nth_paragraph_first_word prompts over seeds 0-2 before), which the checker reads as
    unset and draws again at every scoring. Over seeds 0-9 of the built-in templates: none is left."""
    from online_rlhf.verifiers import drawn_arguments

    checkers, _ = ifp.registry()
    nth = "length_constraints:nth_paragraph_first_word"
    assert ifp.argument_problem(checkers[nth], nth, {"num_paragraphs": 3, "nth_paragraph": 4, "first_word": "a"}) \
        == "argument_drawn_by_checker"
    assert ifp.argument_problem(checkers[nth], nth, {"num_paragraphs": 3, "nth_paragraph": 3, "first_word": "a"}) is None
    # a value the checker changes on the way in (it lower-cases the word) would not say what it checks
    assert ifp.argument_problem(checkers[nth], nth, {"num_paragraphs": 3, "nth_paragraph": 3, "first_word": "A"}) \
        == "arguments_not_round_trip"
    redrawn = 0
    for seed in range(10):
        recs, stats = ifp.build(ifp.template_prompts(seed=seed), _cfg(tmp_path, seed=seed), None)
        assert len(recs) == 2000 and stats["constraints_dropped"] == {}
        assert [r["id"] for r in recs if drawn_arguments({**r, "prompt": r["messages"]})] == []
        for r in recs:
            for iid, kw in zip(r["instruction_id_list"], r["kwargs"]):
                assert iid != nth or 1 <= kw["nth_paragraph"] <= kw["num_paragraphs"], r["id"]
        redrawn += stats["arguments_redrawn"]["argument_drawn_by_checker"][nth]
    assert redrawn > 100  # the draws the builder refused


def test_a_prepared_default_from_before_the_redraw_is_rebuilt(tmp_path):
    import importlib.util

    from online_rlhf.jsonl import write_json
    from online_rlhf.paths import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location("prepare_default", PROJECT_ROOT / "scripts" / "prepare_default.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    write_jsonl(tmp_path / prep.IF_TRAIN, [{"id": "x"}])
    stats = {"prompts_out": prep.EXPECTED_IF_TRAIN, **prep.IF_TRAIN_SETTINGS}
    write_json(tmp_path / f"{prep.IF_TRAIN}.stats.json", stats)
    assert not prep.if_train_ready(tmp_path)  # an older build: its stats lack the redraw count
    write_json(tmp_path / f"{prep.IF_TRAIN}.stats.json", {**stats, "unsatisfiable_redrawn": {}})
    assert not prep.if_train_ready(tmp_path)  # one from before every draw was checked against its checker
    write_json(tmp_path / f"{prep.IF_TRAIN}.stats.json", {**stats, "arguments_redrawn": {}})
    assert prep.if_train_ready(tmp_path)


def test_a_base_row_with_its_own_kwargs_is_skipped_and_a_base_id_column_is_replaced_counted(tmp_path):
    base = [{"id": "g", "prompt": [{"role": "user", "content": "Write a limerick about cats."}],
             "kwargs": [{"num_words": 5}]},
            {"id": "h", "prompt": [{"role": "user", "content": "Write a limerick about dogs."}], "base_id": "zzz",
             "topic": "dogs"}]
    recs, stats = ifp.build(base, _cfg(tmp_path), None)
    # a row with constraint arguments of its own is a constrained prompt: its kwargs would not match the text
    assert stats["skipped"] == {"already_constrained": 1} and stats["skipped_examples"]["already_constrained"] == ["g"]
    assert [r["base_id"] for r in recs] == ["h"] and recs[0]["topic"] == "dogs"
    assert stats["input_fields_replaced"] == {"base_id": 1}


def test_a_task_without_final_punctuation_ends_its_sentence_before_the_constraints(tmp_path):
    base = [{"id": "t", "prompt": [{"role": "user", "content": "Tell me about the line to the throne"}],
             "instruction_id_list": None}]  # null: no constraints of its own, so it is built
    recs, stats = ifp.build(base, _cfg(tmp_path), None)
    assert stats["skipped"] == {} and recs[0]["messages"][-1]["content"].startswith("Tell me about the line to the throne. ")
