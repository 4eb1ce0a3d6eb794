"""The GRPO stage's data: read ``rewards.jsonl`` as one group of K scored responses per prompt, the
group-relative advantages, the completions to train on (the sampled token ids, cut to ``max_length``,
masked or dropped by reason, counted) and the warnings the stats carry about what was left out.
"""

from __future__ import annotations

import math
from collections import Counter

from online_rlhf.chat_tokens import ChatTokenError, prompt_response_ids
from online_rlhf.jsonl import DataError, iter_jsonl
from online_rlhf.records import check_messages, sampled_token_ids, validate_rewards


_MAX_EXAMPLES = 5  # skipped-group examples kept per reason in the stats


# ------------------------------------------------------------------------------ 1-3: data

def load_groups(path: str, truncated_penalty: float = 0.0) -> tuple[list[dict], dict]:
    """Read rewards.jsonl: one group per record.

    Returns:
        (groups, info): each group ``{"where": "file:line", "prompt": [messages], "responses": [K str],
        "rewards": [K float | None], "truncated": [K bool], "sampled_ids": [K (prompt ids, response ids)] |
        None}`` (the ids the engine sampled, when the generation stage saved them) with ``truncated_penalty`` already
        subtracted from the reward of each response whose finish_reason is ``length``;
        info = ``{"in": n, "reward_mean_all": mean of the scored rewards (after the penalty) | None,
        "blank_lines": blank lines skipped in the file}``.
    Raises:
        FileNotFoundError: no such file.  DataError: a record that is not a valid rewards record
        (names file:line and the fix).
    """
    groups, scored = [], []
    lines = iter_jsonl(path)
    for lineno, rec in lines:
        where = f"{path}:{lineno}"
        rewards = validate_rewards(rec, where)
        prompt = check_messages(rec["prompt"], where)
        truncated = [f == "length" for f in rec["finish_reasons"]]
        rewards = [None if r is None else r - truncated_penalty * t for r, t in zip(rewards, truncated)]
        scored += [r for r in rewards if r is not None]
        ids = [sampled_token_ids(rec, k, where) for k in range(len(rec["responses"]))]
        groups.append({"where": where, "prompt": prompt, "responses": rec["responses"], "rewards": rewards,
                       "truncated": truncated, "sampled_ids": None if ids and ids[0] is None else ids})
    return groups, {"in": len(groups), "reward_mean_all": sum(scored) / len(scored) if scored else None,
                    "blank_lines": lines.blank_lines}


def group_advantages(rewards, scale_rewards: str = "group"):
    """Group-relative advantages (GRPO: Shao et al. 2024, arXiv 2402.03300, eq. 3 "outcome
    supervision"; Dr. GRPO: Liu et al. 2025, arXiv 2503.20783, without the std).

    ``A[g, k] = r[g, k] - mean_k r[g, :]``, divided by ``std + 1e-4`` for ``scale_rewards=group``
    (each group's std) or ``batch`` (the std of every reward given), not divided for ``none``.
    The std is Bessel-corrected and NaN-aware (TRL's ``nanstd``, as TRL 1.9's GRPOTrainer computes it).

    Args:
        rewards: float tensor (G, K): G groups of K rewards; NaN marks an unscored response.
        scale_rewards: ``group`` | ``batch`` | ``none``.
    Returns:
        (advantages (G, K), NaN where the reward is; usable (G,) bool: the group has >= 2 scored
        rewards and they are not all equal).
    Raises:
        ValueError: an unknown ``scale_rewards``.
    """
    import torch
    from trl.trainer.utils import nanstd

    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected group, batch or none.")
    scored = ~torch.isnan(rewards)  # (G, K)
    mean = torch.nanmean(rewards, dim=1, keepdim=True)  # (G, 1)
    adv = rewards - mean  # (G, K)
    lo = torch.where(scored, rewards, torch.full_like(rewards, math.inf)).amin(dim=1)  # (G,)
    hi = torch.where(scored, rewards, torch.full_like(rewards, -math.inf)).amax(dim=1)  # (G,)
    usable = (scored.sum(dim=1) >= 2) & (hi > lo)  # (G,)
    if scale_rewards == "group":
        adv = adv / (nanstd(rewards, dim=1, keepdim=True) + 1e-4)  # (G, K)
    elif scale_rewards == "batch":
        adv = adv / (nanstd(rewards) + 1e-4)
    return adv, usable


def build_completions(groups: list[dict], advantages, usable, tokenizer, max_length: int | None,
                      mask_truncated: bool) -> tuple[list[dict], dict]:
    """One training completion per scored response of each usable group.

    Token ids: the ones the engine sampled when the records hold them (the loop's generation stage
    saves them for ``algorithm: grpo``: ``save_token_ids``); otherwise as the DPO stage trains on
    them (``online_rlhf.chat_tokens.prompt_response_ids``):
    ``prompt_ids`` = the prompt with the generation prompt; ``completion_ids`` = the response text
    and the template's end-of-turn marker, or the text alone for a response cut at max_tokens (it
    never ended). ``max_length`` cuts completions to ``max_length - len(prompt_ids)`` tokens.

    Returns:
        (completions ``{prompt_ids, completion_ids, advantage, group}``, info with ``skipped``
        (reason -> groups), ``examples``, ``masked`` ({truncated, unscored} -> responses left out),
        ``cut`` (completions shortened by max_length), ``reward_mean`` of the used groups).
    """
    out, skipped, examples, masked = [], Counter(), {}, Counter()
    cut, used_rewards, longest = 0, [], 0

    def skip(reason: str, g: dict, why: str = "") -> None:
        skipped[reason] += 1
        ex = examples.setdefault(reason, [])
        if len(ex) < _MAX_EXAMPLES:
            ex.append(g["where"] + (f" ({why})" if why else ""))

    for gi, g in enumerate(groups):
        scored = [k for k, r in enumerate(g["rewards"]) if r is not None]
        if not bool(usable[gi]):
            skip("fewer_than_2_scored" if len(scored) < 2 else "all_equal", g)
            continue
        if g.get("sampled_ids"):  # the ids the engine sampled: nothing to re-tokenize
            prompt_ids, resp_ids = g["sampled_ids"][scored[0]][0], [g["sampled_ids"][k][1] for k in scored]
            if max(max(prompt_ids), *(max(r) for r in resp_ids)) >= len(tokenizer):
                raise DataError(f"{g['where']}: a token id is outside the policy's vocabulary ({len(tokenizer)} ids); "
                                "the rollouts were generated by another model than `policy`.")
        else:
            try:
                prompt_ids, resp_ids = prompt_response_ids(
                    tokenizer, g["prompt"], *[[{"role": "assistant", "content": g["responses"][k]}] for k in scored])
            except ChatTokenError as e:
                skip(e.reason, g, str(e))
                continue
        if max_length is not None and len(prompt_ids) >= max_length:
            skip("prompt_too_long", g, f"{len(prompt_ids)} prompt tokens")
            continue
        masked["unscored"] += len(g["rewards"]) - len(scored)
        used_rewards += [g["rewards"][k] for k in scored]
        for k, ids in zip(scored, resp_ids):
            if g["truncated"][k]:
                if mask_truncated:
                    masked["truncated"] += 1
                    continue
                if not g.get("sampled_ids"):  # (sampled ids of a cut response have no end-of-turn)
                    text_ids = tokenizer.encode(g["responses"][k], add_special_tokens=False)
                    if ids[:len(text_ids)] == text_ids:
                        ids = text_ids  # no end-of-turn after a response that was cut off
            longest = max(longest, len(prompt_ids) + len(ids))
            if max_length is not None and len(prompt_ids) + len(ids) > max_length:
                ids, cut = ids[:max_length - len(prompt_ids)], cut + 1
            if ids:
                out.append({"prompt_ids": prompt_ids, "completion_ids": ids, "advantage": float(advantages[gi, k]),
                            "group": gi})
    info = {"skipped": dict(skipped), "examples": examples, "masked": {k: v for k, v in masked.items() if v},
            "cut": cut, "longest": longest,
            "reward_mean": sum(used_rewards) / len(used_rewards) if used_rewards else None,
            "groups_used": len({c["group"] for c in out})}
    return out, info


# What to change when groups are skipped, per reason (the stage's keys named as the loop's).
_SKIP_ADVICE = {
    "all_equal": "more samples (generation.k) or prompts, or a higher generation.temperature, give groups whose "
                 "rewards differ",
    "fewer_than_2_scored": "the reward source left most responses unscored (null): see rewards.jsonl.stats.json",
    "prompt_too_long": "raise grpo.max_length (now {max_length}) above the longest prompt + generation.max_tokens, "
                       "or shorten the prompts",
    "special_text_not_tokenizable": "the texts hold chat-template markers that cannot be tokenized as text: save the "
                                    "sampled token ids (generation.save_token_ids, on by default for grpo)",
    "template_renders_prompt_differently": "the policy's chat template writes the prompt differently once a response "
                                           "follows: save the sampled token ids (generation.save_token_ids, on by "
                                           "default for grpo) or use another chat template",
    "response_not_tokenizable_alone": "the responses' first characters merge with the prompt's last token and do "
                                      "not re-tokenize on their own: save the sampled token ids "
                                      "(generation.save_token_ids, on by default for grpo)",
}


def data_warnings(info: dict, groups_in: int, completions: int, max_length: int | None, rewards: str) -> list[str]:
    """The stage's warnings about what it could not train on, each with the advice that fits its reason.

    Args:
        info: :func:`build_completions`'s info (``skipped``, ``cut``, ``longest``, ``groups_used``).
        groups_in: groups read; completions: completions used; max_length: the stage's ``max_length``;
        rewards: the rewards file, for the message.
    Returns:
        one line per problem: no group used (the policy is saved unchanged), groups dropped because
        the prompt fills ``max_length``, completions cut by ``max_length``.
    """
    out = []
    skipped = info["skipped"]
    advice = "; ".join(_SKIP_ADVICE.get(r, r).format(max_length=max_length) for r in skipped)
    if not completions:
        out.append(f"grpo: none of the {groups_in} groups of {rewards} is used (skipped: {skipped or 'none'}); the "
                   f"policy is saved unchanged. {advice[:1].upper() + advice[1:]}.")
    elif skipped.get("prompt_too_long"):
        out.append(f"grpo: {skipped['prompt_too_long']} of {groups_in} groups dropped: the prompt alone fills "
                   f"max_length={max_length} tokens; {_SKIP_ADVICE['prompt_too_long'].format(max_length=max_length)}.")
    if info.get("cut"):
        out.append(f"grpo: {info['cut']} of {completions} completions cut to max_length={max_length} tokens (prompt + "
                   f"completion; the longest is {info.get('longest')}): their last tokens are not trained on. Raise "
                   f"grpo.max_length to at least {info.get('longest')}, or lower generation.max_tokens.")
    return out
