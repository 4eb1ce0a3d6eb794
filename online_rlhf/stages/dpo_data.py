"""The DPO stage's data preparation: read and check ``pairs.jsonl``, tokenize each pair once with
the policy's chat template (message contents as text), count special-token strings, and drop
(counted, by reason) the pairs ``max_length`` / ``max_prompt_length`` leave no response token for.
"""

from __future__ import annotations

from collections import Counter

from online_rlhf.chat_tokens import ChatTokenError, messages_have_special_text, prompt_response_ids
from online_rlhf.jsonl import DataError, iter_jsonl
from online_rlhf.records import validate_pair


_MAX_EXAMPLES = 5  # dropped-record examples kept per reason in the stats


def _pair_problem(rec: dict, where: str) -> tuple[str, str] | None:
    """Why a pair cannot be trained on: ``(drop reason, what exactly is wrong)``, or None when it is fine."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
    if missing:
        return "malformed", f"missing {', '.join(missing)}"
    try:
        validate_pair(rec, where)
    except DataError as e:
        if rec.get("chosen") == rec.get("rejected"):
            return "chosen_equals_rejected", "chosen and rejected are the same"
        return "malformed", str(e).removeprefix(f"{where}: ")
    for side in ("chosen", "rejected"):
        msgs = rec[side]
        roles = [m["role"] for m in msgs]
        if any(r != "assistant" for r in roles):
            return "malformed", f"{side} must be assistant messages only, got roles {roles}"
        if not "".join(m["content"] for m in msgs).strip():
            return "empty_response", f"{side} is empty"
    return None


def load_pairs(path: str) -> tuple[list[dict], dict]:
    """Read pairs.jsonl; return the valid pairs (prompt/chosen/rejected only) and drop counts.

    Returns:
        (pairs, info) with info = ``{"in": n, "dropped": {reason: n}, "examples": {reason: ["file:line"]}}``.
        Reasons: ``malformed`` (missing key, bad message list, non-assistant response),
        ``chosen_equals_rejected``, ``empty_response``; each example is ``"file:line (what is wrong)"``.
    Raises:
        FileNotFoundError: no such file.  DataError: a line is not JSON (names file:line).
    """
    pairs, dropped, examples = [], Counter(), {}
    n = 0
    for lineno, rec in iter_jsonl(path):
        n += 1
        where = f"{path}:{lineno}"
        problem = _pair_problem(rec, where)
        if problem:
            reason, why = problem
            dropped[reason] += 1
            examples.setdefault(reason, [])
            if len(examples[reason]) < _MAX_EXAMPLES:
                examples[reason].append(f"{where} ({why})")
            continue
        pairs.append({**{k: [{"role": m["role"], "content": m["content"]} for m in rec[k]]
                         for k in ("prompt", "chosen", "rejected")}, "_where": where})
    return pairs, {"in": n, "dropped": dict(dropped), "examples": examples}


def tokenize_pairs(pairs: list[dict], tokenizer) -> tuple[list[dict], dict]:
    """Token ids of each pair as the trainer will use them; message contents stay text.

    ``online_rlhf.chat_tokens.prompt_response_ids`` with the policy's chat template: ``prompt_ids``
    = the prompt with the generation prompt, BOS exactly once (the ids generation gave the policy);
    ``chosen_ids`` / ``rejected_ids`` = the rest of prompt + response (the response text and the
    template's end-of-turn marker). Only the template's own markers are special ids: a
    ``<|im_end|>`` written inside a response or a prompt is the text's sub-tokens, not an EOS or a
    new turn. (TRL's own tokenization, ``apply_chat_template(tokenize=True)``, parses them as
    special tokens; the trainer here is given these ids instead, see :func:`timed_trainer_class`.)

    Returns:
        (pairs with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` added, info) with info =
        ``{"dropped": {reason: n}, "examples": {reason: ["file:line (why)"]}}``, reason
        ``ChatTokenError.reason``: ``special_text_not_tokenizable`` (a content holds a special-token
        string and the template rewrites contents beyond stripping whitespace),
        ``template_renders_prompt_differently`` (the template writes the prompt differently once a
        response follows) or ``response_not_tokenizable_alone``. A response whose first characters
        merge with the prompt's last token (Qwen2's ``"\\n"`` + ``"\\n"``) is kept: its ids are its
        text tokenized on its own (``prompt_response_ids``).
    """
    out, dropped, examples = [], Counter(), {}
    for p in pairs:
        try:
            prompt_ids, (chosen_ids, rejected_ids) = prompt_response_ids(tokenizer, p["prompt"], p["chosen"],
                                                                         p["rejected"])
        except ChatTokenError as e:
            dropped[e.reason] += 1
            ex = examples.setdefault(e.reason, [])
            if len(ex) < _MAX_EXAMPLES:
                ex.append(f"{p['_where']} ({e})")
            continue
        out.append({**p, "prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids})
    return out, {"dropped": dict(dropped), "examples": examples}


def special_text_counts(pairs: list[dict], tokenizer) -> dict:
    """How many pairs hold a special-token string of the policy's tokenizer in their prompt, chosen, rejected.

    Returns:
        ``{"prompts": n, "chosen": n, "rejected": n}`` (each side counted once per pair).
    """
    return {side: sum(1 for p in pairs if messages_have_special_text(tokenizer, p[key]))
            for side, key in (("prompts", "prompt"), ("chosen", "chosen"), ("rejected", "rejected"))}


def check_lengths(pairs: list[dict], max_length: int | None, max_prompt_length: int | None,
                  truncation_mode: str) -> tuple[list[dict], dict]:
    """Drop pairs whose prompt leaves no response token; count what ``max_length`` will truncate.

    Token counts are the lengths of the ids the trainer gets (:func:`tokenize_pairs`):
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids``.

    A pair is dropped (reason ``prompt_too_long``) when its prompt is longer than
    ``max_prompt_length``, or, with ``keep_start`` truncation, when the prompt alone has
    ``>= max_length`` tokens (TRL would drop it silently; every kept sequence then keeps at least
    one response token). Kept pairs over ``max_length`` lose tokens from the end of the response
    (``keep_start``) or the start of the prompt (``keep_end``); they are counted, not dropped.

    Returns:
        (kept pairs, info) with info holding ``dropped``, ``examples``, ``truncation`` counts and
        ``sequence_tokens`` (the kept pairs' prompt + chosen and prompt + rejected tokens after
        truncation: the tokens one epoch trains on, padding not counted).
    """
    kept, dropped, examples = [], Counter(), {}
    trunc = Counter()
    max_p = max_seq = seq_tokens = 0
    for p in pairs:
        n_p, n_c, n_r = len(p["prompt_ids"]), len(p["chosen_ids"]), len(p["rejected_ids"])
        max_p, max_seq = max(max_p, n_p), max(max_seq, n_p + n_c, n_p + n_r)
        too_long = (max_prompt_length is not None and n_p > max_prompt_length) or (
            max_length is not None and truncation_mode == "keep_start" and n_p >= max_length)
        if too_long:
            dropped["prompt_too_long"] += 1
            ex = examples.setdefault("prompt_too_long", [])
            if len(ex) < _MAX_EXAMPLES:
                ex.append(f"{p['_where']} ({n_p} prompt tokens)")
            continue
        cap = max_length if max_length is not None else n_p + max(n_c, n_r)
        seq_tokens += min(n_p + n_c, cap) + min(n_p + n_r, cap)
        if max_length is not None:
            c_over, r_over = n_p + n_c > max_length, n_p + n_r > max_length
            trunc["chosen_truncated"] += c_over
            trunc["rejected_truncated"] += r_over
            trunc["pairs_truncated"] += c_over or r_over
        kept.append(p)
    info = {"dropped": dict(dropped), "examples": examples, "sequence_tokens": seq_tokens,
            "truncation": {"max_length": max_length, "max_prompt_length": max_prompt_length,
                           "truncation_mode": truncation_mode, "pairs_truncated": trunc["pairs_truncated"],
                           "chosen_truncated": trunc["chosen_truncated"],
                           "rejected_truncated": trunc["rejected_truncated"],
                           "prompt_tokens_max": max_p, "sequence_tokens_max": max_seq}}
    return kept, info
