"""Responses whose first characters merge with the prompt's last token (issue 24, item 1; after TRL #2054).

Under Qwen2's pre-tokenizer the generation prompt's trailing ``"\\n"`` and a response's leading
``"\\n"`` are one piece, one token ``ĊĊ``: the ids of prompt + response do not start with the
prompt's. Every tokenizing stage (DPO, GRPO, reward-model scoring, KL) must keep such a response,
with the prompt ids of the chat template's generation prompt and the response tokenized on its own,
followed by the template's end-of-turn. The tokenizer is built here like Qwen2's
(``online_rlhf.testing.make_qwen2_style_tokenizer``), no hub.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from online_rlhf import chat_tokens  # noqa: E402
from online_rlhf.testing import make_qwen2_style_tokenizer, make_tiny_reward_model  # noqa: E402

# The minimal input (kept as in the report).
PROMPT = [{"role": "user", "content": "Say hi"}]
CHOSEN, REJECTED = "\nHi there", "Hi"


@pytest.fixture(scope="module")
def tok():
    return make_qwen2_style_tokenizer()


def _text(tok, t: str) -> list[int]:
    return list(tok(t, add_special_tokens=False)["input_ids"])


def _expected(tok, response: str, finished: bool = True) -> tuple[list[int], list[int]]:
    """Prompt ids of the template's generation prompt; the response alone + ``<|im_end|>`` + ``"\\n"``."""
    prompt = _text(tok, tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True))
    tail = [tok.convert_tokens_to_ids("<|im_end|>")] + _text(tok, "\n") if finished else []
    return prompt, _text(tok, response) + tail


def test_the_tokenizer_merges_across_the_boundary(tok):
    """The premise: the plain tokenization of prompt + response does not start with the prompt's ids."""
    prompt, _ = _expected(tok, CHOSEN)
    full = _text(tok, tok.apply_chat_template(PROMPT + [{"role": "assistant", "content": CHOSEN}], tokenize=False))
    assert full[:len(prompt)] != prompt
    assert tok.convert_ids_to_tokens(full[len(prompt) - 1]) == "ĊĊ"


def _dpo(tok, response):
    from online_rlhf.stages import dpo_data

    pair = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": response}],
            "rejected": [{"role": "assistant", "content": REJECTED}], "_where": "pairs.jsonl:1"}
    kept, info = dpo_data.tokenize_pairs([pair], tok)
    assert info["dropped"] == {} and len(kept) == 1
    return kept[0]["prompt_ids"], kept[0]["chosen_ids"]


def _grpo(tok, response):
    from online_rlhf.stages import grpo_data

    group = {"where": "rewards.jsonl:1", "prompt": PROMPT, "responses": [response, REJECTED], "rewards": [1.0, 0.0],
             "truncated": [False, False], "sampled_ids": None}
    adv, usable = grpo_data.group_advantages(torch.tensor([group["rewards"]]))
    comps, info = grpo_data.build_completions([group], adv, usable, tok, max_length=None, mask_truncated=False)
    assert info["skipped"] == {} and len(comps) == 2
    return comps[0]["prompt_ids"], comps[0]["completion_ids"]


def _kl(tok, response):
    from online_rlhf.stages.kl_estimate import response_token_ids

    # a finished response is cut after the template's end-of-turn (<|im_end|>, not the eos <|endoftext|>)
    prompt_ids, ids = response_token_ids(tok, PROMPT, response, "stop")
    return prompt_ids, ids + _text(tok, "\n")


def _rm(tok, response, tmp_path):
    from online_rlhf.reward_model import RewardModel

    rm = RewardModel(str(make_tiny_reward_model(tmp_path / "rm", tokenizer=tok)), dtype="float32", device="cpu")
    ids, info = rm.encode(PROMPT, response)
    n = len(_expected(tok, response)[0])
    rewards, stats = rm.score([PROMPT], [response])
    assert rewards[0] is not None and stats["skipped_items"] == {}
    return ids[:n], ids[n:]


@pytest.mark.parametrize("stage", ["dpo", "grpo", "kl", "reward_model"])
@pytest.mark.parametrize("response", [CHOSEN, "\n\nTwo newlines first", "No newline"])
def test_every_tokenizing_stage_keeps_the_response_with_the_same_ids(tok, stage, response, tmp_path):
    got = {"dpo": _dpo, "grpo": _grpo, "kl": _kl}.get(stage, lambda t, r: _rm(t, r, tmp_path))(tok, response)
    assert got == _expected(tok, response)


def test_truncated_grpo_response_has_no_end_of_turn(tok):
    from online_rlhf.stages import grpo_data

    group = {"where": "rewards.jsonl:1", "prompt": PROMPT, "responses": [CHOSEN, REJECTED], "rewards": [1.0, 0.0],
             "truncated": [True, False], "sampled_ids": None}
    adv, usable = grpo_data.group_advantages(torch.tensor([group["rewards"]]))
    comps, _ = grpo_data.build_completions([group], adv, usable, tok, max_length=None, mask_truncated=False)
    assert (comps[0]["prompt_ids"], comps[0]["completion_ids"]) == _expected(tok, CHOSEN, finished=False)


def test_turn_terminator_is_read_from_the_template(tok):
    from online_rlhf.testing import make_tiny_tokenizer

    assert tok.eos_token == "<|endoftext|>" and chat_tokens.turn_terminator(tok) == "<|im_end|>"
    llama3 = make_tiny_tokenizer()
    llama3.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|unk|>\n\n' }}{% endfor %}"
    assert chat_tokens.turn_terminator(llama3) == "<|unk|>"
    llama3.chat_template = "{% for m in messages %}{{ m['content'] + ' end' }}{% endfor %}"
    assert chat_tokens.turn_terminator(llama3) is None


def test_a_template_that_writes_the_prompt_differently_is_refused_with_its_own_reason(tok):
    """The reason counted is the true one, not special_text_not_tokenizable (the pair has no special text)."""
    from online_rlhf.stages import dpo_data

    other = make_qwen2_style_tokenizer()
    other.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")
    pair = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": CHOSEN}],
            "rejected": [{"role": "assistant", "content": REJECTED}], "_where": "pairs.jsonl:1"}
    kept, info = dpo_data.tokenize_pairs([pair], other)
    assert kept == [] and info["dropped"] == {"template_renders_prompt_differently": 1}
    assert info["examples"]["template_renders_prompt_differently"][0].startswith("pairs.jsonl:1 (")
