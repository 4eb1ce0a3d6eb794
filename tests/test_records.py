"""Prompt-set normalization and record validation."""

import json

import pytest

from online_rlhf.jsonl import DataError
from online_rlhf.records import load_prompts, validate_pair, validate_rewards


def _write(p, rows):
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return p


def test_prompt_string_and_messages_forms(tmp_path):
    p = _write(tmp_path / "p.jsonl", [
        {"prompt": "hi", "answer": "4"},
        {"id": 7, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": "old answer"}]},
    ])
    a, b = load_prompts(p)
    assert a == {"id": "row-0", "prompt": [{"role": "user", "content": "hi"}], "answer": "4"}
    assert b["id"] == "7" and b["prompt"][-1] == {"role": "user", "content": "q"} and len(b["prompt"]) == 2


def test_prompt_field_for_other_columns(tmp_path):
    p = _write(tmp_path / "g.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    (r,) = load_prompts(p, prompt_field="question")
    assert r["prompt"] == [{"role": "user", "content": "2+2?"}] and r["answer"] == "#### 4"


def test_prompt_field_may_hold_a_message_list(tmp_path):
    """RLHFlow's prompt sets keep the conversation in ``context_messages``."""
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    p = _write(tmp_path / "r.jsonl", [{"context_messages": conv}, {"context_messages": 5}])
    with pytest.raises(DataError, match=r"r\.jsonl:2: column 'context_messages' must be a string or a list"):
        load_prompts(p, prompt_field="context_messages")
    (r,) = load_prompts(p, prompt_field="context_messages", limit=1)
    assert r["prompt"] == conv and "context_messages" not in r


def test_unreachable_hub_prompt_set_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"'nobody-here/no-such-prompts': there is no local file .*could not be "
                                         r"loaded.*local \.jsonl"):
        load_prompts("nobody-here/no-such-prompts")


def test_a_name_without_suffix_says_which_local_file_it_looked_for(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        load_prompts("myprompts")
    assert f"no local file {tmp_path / 'myprompts'}" in str(e.value) and "needs its suffix" in str(e.value)


def test_missing_prompt_column_names_line(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"text": "x"}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: no prompt"):
        load_prompts(p)


def test_empty_user_turn_is_an_error(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"prompt": "   "}])
    with pytest.raises(DataError, match="empty"):
        load_prompts(p)


def test_bad_role_is_an_error(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"messages": [{"role": "human", "content": "x"}]}])
    with pytest.raises(DataError, match="role 'human'"):
        load_prompts(p)


def test_duplicate_ids_are_an_error(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(DataError, match="duplicate id 'a'"):
        load_prompts(p)


def test_generated_ids_do_not_clash_with_explicit_numeric_ids(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"id": "1", "prompt": "b"}, {"id": 0, "prompt": "c"}])
    assert [r["id"] for r in load_prompts(p)] == ["row-0", "1", "0"]


@pytest.mark.parametrize("rows,first,second", [
    ([{"prompt": "a"}, {"id": "row-0", "prompt": "b"}], r"p\.jsonl:1 \(no id: generated\)", r"p\.jsonl:2"),
    ([{"id": "row-1", "prompt": "a"}, {"prompt": "b"}], r"p\.jsonl:1", r"p\.jsonl:2 \(no id: generated\)"),
])
def test_explicit_id_equal_to_a_generated_one_names_both_rows(tmp_path, rows, first, second):
    p = _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=rf"{second}: duplicate id 'row-\d', also the id of \S*{first}\. .*row-<0-based"):
        load_prompts(p)


@pytest.mark.parametrize("bad,match", [([1, 2], "'id' must be a string or a number, got list"),
                                       (True, "'id' must be a string or a number, got bool"), ("  ", "'id' is empty")])
def test_bad_id_value_is_an_error_naming_the_line(tmp_path, bad, match):
    p = _write(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"id": bad, "prompt": "x"}])
    with pytest.raises(DataError, match=rf"p\.jsonl:2: {match}"):
        load_prompts(p)


def test_null_id_counts_as_no_id(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"id": None, "prompt": "a"}, {"id": None, "key": "k", "prompt": "b"}])
    assert [r["id"] for r in load_prompts(p)] == ["row-0", "k"]


def test_empty_prompt_set_is_an_error(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_prompts(p)


def test_parquet_prompts_via_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    p = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]).to_parquet(str(p))
    assert [r["id"] for r in load_prompts(p)] == ["row-0", "row-1"]


def test_limit(tmp_path):
    p = _write(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(5)])
    assert len(load_prompts(p, limit=2)) == 2


def test_validate_rewards_refuses_nan_naming_record():
    rec = {"id": "r1", "prompt": [{"role": "user", "content": "q"}], "responses": ["a", "b"],
           "finish_reasons": ["stop", "stop"], "rewards": [1.0, float("nan")]}
    with pytest.raises(DataError, match="r1.*response 1"):
        validate_rewards(rec, "x.jsonl:1")


def test_validate_pair_refuses_identical():
    m = [{"role": "assistant", "content": "same"}]
    with pytest.raises(DataError, match="chosen == rejected"):
        validate_pair({"prompt": [{"role": "user", "content": "q"}], "chosen": m, "rejected": m}, "p:1")


def test_prompt_field_only_applies_to_sets_without_prompt_columns(tmp_path, capsys):
    p = _write(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    (r,) = load_prompts(p, prompt_field="question")
    assert r["prompt"] == [{"role": "user", "content": "hi"}]
    # a prompt_field no row has (a typo?) is said, naming the file and the columns there are
    err = capsys.readouterr().err
    assert "no row has the column prompt_field='question'" in err and "p.jsonl" in err and "messages" in err
    q = _write(tmp_path / "q.jsonl", [{"question": "hi?"}, {"messages": [{"role": "user", "content": "hi"}]}])
    rows = load_prompts(q, prompt_field="question")
    assert [r["prompt"][0]["content"] for r in rows] == ["hi?", "hi"]
    # used by some rows only: the others are counted and the first named, not taken silently
    err = capsys.readouterr().err
    assert "1 of 2 row(s) have no column prompt_field='question'" in err and "q.jsonl:2" in err


def test_prompt_column_faults_name_the_column(tmp_path, capsys):
    p = _write(tmp_path / "p.jsonl", [{"prompt": 5}])
    with pytest.raises(DataError, match=r"p.jsonl:1: column 'prompt' must be a string or a list .* got int 5"):
        load_prompts(p)
    p = _write(tmp_path / "p.jsonl", [{"prompt": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"p.jsonl:1, column 'prompt': message 0"):
        load_prompts(p)
    # both columns: messages wins, and the unused prompt column is said, with the way to choose it
    both = {"messages": [{"role": "user", "content": "from messages"}], "prompt": "from prompt"}
    p = _write(tmp_path / "p.jsonl", [both, {"prompt": "only"}])
    (r, _) = load_prompts(p)
    assert r["prompt"][0]["content"] == "from messages"
    err = capsys.readouterr().err
    assert "1 row(s) have both 'messages' and 'prompt' (first: " in err and "p.jsonl:1" in err
    assert "prompt_field=prompt" in err
    (r, _) = load_prompts(p, prompt_field="prompt")
    assert r["prompt"][0]["content"] == "from prompt" and "both" not in capsys.readouterr().err


def test_missing_local_model_dir_is_a_clear_error(tmp_path):
    from online_rlhf.paths import resolve_model

    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "nope_model"))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_resolve_model_expands_home(tmp_path, monkeypatch):
    from online_rlhf.paths import resolve_model

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    assert resolve_model("~/ckpt") == str(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="~/gone"):
        resolve_model("~/gone")


def test_trailing_assistant_turns_are_removed_counted_and_noted(tmp_path, capsys):
    from online_rlhf.records import load_prompt_set

    user = {"role": "user", "content": "q"}
    p = _write(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "plain"},
        {"id": "b", "messages": [user, {"role": "assistant", "content": "old"}]},
        {"id": "c", "messages": [user, {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ])
    rows, counts = load_prompt_set(p)
    assert [r["prompt"][-1] for r in rows[1:]] == [user, user]  # removed, as before: the policy answers the user turn
    assert counts.assistant_turns_removed == 2 and counts.first_assistant_removed == f"{p}:2 (id='b')"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"note: {p}: removed the trailing assistant turn(s) of 2 prompt(s) (first: {p}:2 (id='b'))" in err
    assert load_prompt_set(p, limit=1)[1].assistant_turns_removed == 0 and capsys.readouterr().err == ""


def test_blank_lines_of_a_prompt_file_are_counted(tmp_path, capsys):
    from online_rlhf.records import load_prompt_set

    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n\n{"prompt": "c"}\n')
    rows, counts = load_prompt_set(p)
    assert [r["id"] for r in rows] == ["row-0", "row-1", "row-2"] and counts.blank_lines == 2
    assert capsys.readouterr().err == f"note: skipped 2 blank line(s) in {p} (line 2, 4)\n"
    rows, counts = load_prompt_set(p, limit=1)  # stopped before the end of the file: still said
    assert len(rows) == 1 and counts.blank_lines == 1
    assert capsys.readouterr().err == f"note: skipped 1 blank line(s) in {p} (line 2), in the rows read up to limit=1\n"


@pytest.mark.parametrize("name, model, data, ifeval", [
    ("owner/name", False, False, False),  # a Hub id, whatever it names
    ("gsm8k", False, False, True),  # a bare name: a Hub dataset, but IFEval's prompts take owner/name ids only
    ("default", False, False, True),
    ("data.jsonl", False, True, True),  # a data file is known by its suffix
    ("owner/data.parquet", False, True, True),
    ("a/b/c", True, True, True),  # two slashes: a path
    ("./model", True, True, True),
    ("../x/y", True, True, True),
    ("/abs/model", True, True, True),
    ("~/model", True, False, False),  # ~ marks a model folder; a data file is known by its suffix
    ("here/mine", True, False, False),  # here/ is a folder in the current directory: a model folder
])
def test_local_path_or_hub_id_is_decided_in_one_place(tmp_path, monkeypatch, name, model, data, ifeval):
    """online_rlhf.paths decides whether a missing name is a local path or a Hub id, for models
    (resolve_model and the plan's checks), prompt files (load_prompts and the plan's checks) and
    IFEval's prompts (the plan's check); the differences between them are these, on purpose."""
    from online_rlhf.paths import is_local_data, is_local_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert (is_local_model(name), is_local_data(name), is_local_data(name, bare_name_is_hub=False)) == \
        (model, data, ifeval)


@pytest.mark.parametrize("bad", [["a", "b"], {"k": 1}, True])
def test_a_generated_record_whose_id_is_not_a_plain_value_is_refused_naming_the_line(bad):
    from online_rlhf.records import validate_generated, validate_rewards

    rec = {"id": bad, "prompt": [{"role": "user", "content": "q"}], "responses": ["a"], "finish_reasons": ["stop"]}
    # get_rewards and build_sft_data keyed a dict on the id: a list id was a TypeError traceback
    with pytest.raises(DataError, match=r"gen\.jsonl:3: 'id' must be a string or a number"):
        validate_generated(rec, "gen.jsonl:3")
    with pytest.raises(DataError, match=r"rewards\.jsonl:2: 'id' must be a string or a number"):
        validate_rewards({**rec, "rewards": [1.0]}, "rewards.jsonl:2")
