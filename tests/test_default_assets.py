"""The embedded default built by scripts/prepare_default.py: policy checkpoint and IFBench split.

Skipped when the assets are not prepared (run ``.venv-train/bin/python scripts/prepare_default.py``).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from online_rlhf.paths import default_data_dir, default_model_dir
from online_rlhf.records import load_prompts

MODEL = default_model_dir()
DATA = default_data_dir()
IM_END_ID = 2

needs_model = pytest.mark.skipif(not (MODEL / "prepare_default.json").is_file(),
                                 reason=f"{MODEL} absent: run scripts/prepare_default.py")
needs_data = pytest.mark.skipif(not (DATA / "split.json").is_file(),
                                reason=f"{DATA}/split.json absent: run scripts/prepare_default.py")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@needs_model
def test_eos_and_pad_are_im_end(tokenizer):
    from transformers import AutoConfig, GenerationConfig

    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == IM_END_ID
    config = AutoConfig.from_pretrained(MODEL)
    assert (config.eos_token_id, config.pad_token_id) == (IM_END_ID, IM_END_ID)
    gen = GenerationConfig.from_pretrained(MODEL)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert IM_END_ID in eos and 1 not in eos  # never <|im_start|>


@needs_model
def test_chat_template_is_chatml(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the template writes no BOS, and encoding adds none either
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


@needs_model
def test_greedy_answer_stops_at_im_end(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    assert model.dtype == torch.float32
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    answer = tokenizer.decode(new, skip_special_tokens=True)
    assert new[-1] == IM_END_ID, f"did not stop at <|im_end|>: {answer!r}"
    assert answer.strip() and "Paris" in answer


@needs_data
def test_split_counts_and_no_overlap():
    split = json.loads((DATA / "split.json").read_text())
    train = load_prompts(DATA / "ifbench_train.jsonl")
    evals = load_prompts(DATA / "ifbench_eval.jsonl")
    assert (len(train), len(evals), split["total"]) == (230, 64, 294)
    assert (split["train"], split["eval"]) == (230, 64)
    train_ids, eval_ids = {r["id"] for r in train}, {r["id"] for r in evals}
    assert len(train_ids) == 230 and len(eval_ids) == 64
    assert not train_ids & eval_ids
    assert sorted(eval_ids) == sorted(split["eval_ids"])


@needs_data
def test_split_is_the_documented_hash_split():
    ids = [r["id"] for name in ("ifbench_train.jsonl", "ifbench_eval.jsonl") for r in load_prompts(DATA / name)]
    held = sorted(ids, key=lambda i: hashlib.sha256(f"ifbench-split-v1:{i}".encode()).hexdigest())[:64]
    assert set(held) == set(json.loads((DATA / "split.json").read_text())["eval_ids"])


@needs_data
def test_prompt_records_have_the_prompt_set_format():
    with open(DATA / "ifbench_train.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        assert set(r) == {"id", "messages", "instruction_id_list", "kwargs"}
        assert isinstance(r["id"], str)
        assert [m["role"] for m in r["messages"]] == ["user"] and r["messages"][0]["content"].strip()
        assert len(r["kwargs"]) == len(r["instruction_id_list"]) >= 1
        assert all(v is not None for kw in r["kwargs"] for v in kw.values())
    first = next(r for r in rows if r["id"] == "0")
    assert first["kwargs"] == [{"keyword1": "kaleidoscope", "keyword2": "nebula", "keyword3": "whisper",
                                "keyword4": "labyrinth", "keyword5": "paradox"}]
