"""Chosen/rejected pair selection from K scored responses per prompt (pure functions).

Strategies (``PairsConfig.strategy``):

- ``max_min`` (default): the best vs the worst response, as in RLHFlow's online iterative
  RLHF recipe (Dong et al. 2024, "RLHF Workflow", github.com/RLHFlow/Online-RLHF).
- ``max_random``: the best vs a random lower-rewarded response.
- ``random``: a random pair of responses with different rewards, ordered by reward.
- ``best_vs_rest``: several pairs per prompt, the best response against each lower-rewarded one
  (worst first, so the first pair is ``max_min``'s): up to K-1 pairs from K samples instead of
  one (the multi-pair construction of Iterative RPO, Pang et al. 2024, arXiv 2404.19733, and of
  SimPO-style on-policy data, where every response below the best is a rejected one).
- ``all_pairs``: every two responses whose rewards differ (by more than ``min_margin``), the higher
  one chosen, largest margin first: up to K(K-1)/2 pairs.
``max_pairs_per_prompt`` keeps the first N pairs of a prompt in that order. The pairs of one
prompt share its ``id``.

Before choosing, each response is checked: an empty (whitespace-only) response is invalid, and
so is one the reward stage could not score (reward ``null``); a truncated one (``finish_reason ==
"length"``) is kept, excluded, or penalized (its reward minus ``truncated_penalty``) per
``truncated``; responses with the same text (after ``strip()``) count once, with the mean of their
rewards, so a pair never holds one text twice. A prompt is skipped, and counted by reason, when
its two or more non-empty responses are all the same text (``identical_responses``: no
diversity, e.g. a temperature near 0), when fewer than two distinct valid responses remain
otherwise (``fewer_than_2_valid``: the others empty, unscored or excluded as truncated), when
all distinct ones score the same (``tie``), or when the chosen-rejected margin is
``<= min_margin`` (``margin_below_min``).
``chosen_reward``/``rejected_reward`` are the rewards the choice was made on (after the truncation
penalty). When most prompts with two or more responses have fewer than two distinct texts, the
stats carry a warning (:func:`low_diversity_warning`).

Random choices use ``random.Random(f"{seed}:{id}")``: the same pair for a prompt whatever the
order or sharding of the records.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from typing import Iterable, Literal, get_args

from .jsonl import DataError
from .records import validate_rewards

Strategy = Literal["max_min", "max_random", "random", "best_vs_rest", "all_pairs"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
MULTI_PAIR = ("best_vs_rest", "all_pairs")  # the strategies that may give a prompt more than one pair
MAX_EXAMPLES = 5  # example records kept per skip reason in the stats
TRUNCATION = ("keep", "exclude", "penalize")


def valid_responses(responses: list[str], rewards: list[float | None], finish_reasons: list[str],
                    truncated: str = "exclude", truncated_penalty: float = 1.0,
                    counts: Counter | None = None) -> list[tuple[int, str, float]]:
    """The responses a pair may use, as ``(index, stripped text, effective reward)`` in index order.

    Left out: empty text, an unscored response (reward None), a truncated one when ``truncated ==
    "exclude"``. ``counts`` (if given) is incremented per response: ``empty``, ``unscored``,
    ``truncated``, ``truncated_excluded``/``truncated_penalized``.

    Raises:
        ValueError: an unknown ``truncated`` policy.
    """
    if truncated not in TRUNCATION:
        raise ValueError(f"truncated must be one of {TRUNCATION}, got {truncated!r}")
    counts = counts if counts is not None else Counter()
    out = []
    for j, (text, r, fin) in enumerate(zip(responses, rewards, finish_reasons)):
        if not text.strip():
            counts["empty"] += 1
            continue
        if r is None:
            counts["unscored"] += 1
            continue
        if fin == "length":
            counts["truncated"] += 1
            if truncated == "exclude":
                counts["truncated_excluded"] += 1
                continue
            if truncated == "penalize":
                counts["truncated_penalized"] += 1
                r = r - truncated_penalty
        out.append((j, text.strip(), r))
    return out


def candidates(responses: list[str], rewards: list[float | None], finish_reasons: list[str], truncated: str = "exclude",
               truncated_penalty: float = 1.0, counts: Counter | None = None) -> list[tuple[int, float]]:
    """Distinct valid responses as ``(index of first occurrence, effective reward)``, in index order.

    ``counts`` (if given) is incremented per response as in :func:`valid_responses`, plus
    ``duplicate`` for each repeated text (it counts once, with the mean of its rewards).
    """
    counts = counts if counts is not None else Counter()
    by_text: dict[str, list] = {}
    for j, key, r in valid_responses(responses, rewards, finish_reasons, truncated, truncated_penalty, counts):
        if key in by_text:
            counts["duplicate"] += 1
            by_text[key][1].append(r)
        else:
            by_text[key] = [j, [r]]
    return [(j, sum(rs) / len(rs)) for j, rs in by_text.values()]


def distinct_texts(responses: list[str]) -> int:
    """Number of different non-empty responses (compared after ``strip()``, as pairs compare them)."""
    return len({r.strip() for r in responses if r.strip()})


def low_diversity_warning(n_prompts: int, n_low: int, where: str) -> str | None:
    """A warning when most of ``n_prompts`` prompts (those sampled with K >= 2) have fewer than 2
    distinct responses (``n_low``); None otherwise.

    Such prompts give no pair: sampling is (nearly) deterministic, e.g. a temperature near 0 or a
    policy that has collapsed to one answer.
    """
    if n_prompts == 0 or 2 * n_low <= n_prompts:
        return None
    return (f"{where}: {n_low} of {n_prompts} prompts have fewer than 2 distinct responses, so they give no "
            "chosen/rejected pair. Sampling is (nearly) deterministic: raise generation.temperature (or top_p), "
            "or check the policy for collapse.")


def choose(cands: list[tuple[int, float]], strategy: str = "max_min", min_margin: float = 0.0,
           rng: random.Random | None = None) -> list[tuple[int, int]] | str:
    """Pick ``[(chosen index, rejected index), ...]`` from :func:`candidates`, or return the skip reason.

    One pair for ``max_min``, ``max_random`` and ``random``; for ``best_vs_rest`` the best against
    every candidate more than ``min_margin`` below it, worst first; for ``all_pairs`` every two
    candidates more than ``min_margin`` apart, largest margin first (then by index). Ties between
    equal best (or worst) rewards go to the lowest index. Reasons: ``fewer_than_2_valid``, ``tie``
    (no two rewards differ), ``margin_below_min``.

    Raises:
        ValueError: an unknown ``strategy``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if len(cands) < 2:
        return "fewer_than_2_valid"
    rng = rng or random.Random(0)
    best = max(cands, key=lambda c: (c[1], -c[0]))
    worst = min(cands, key=lambda c: (c[1], c[0]))
    if best[1] == worst[1]:
        return "tie"
    if best[1] - worst[1] <= min_margin:
        return "margin_below_min"
    if strategy == "max_min":
        return [(best[0], worst[0])]
    lower = sorted((c for c in cands if best[1] - c[1] > min_margin), key=lambda c: (c[1], c[0]))
    if strategy == "max_random":
        return [(best[0], rng.choice(lower)[0])]
    if strategy == "best_vs_rest":
        return [(best[0], c[0]) for c in lower]
    # random / all_pairs: the pairs whose rewards differ by more than min_margin, ordered by reward
    pairs = [(a, b) for a in cands for b in cands if a[1] - b[1] > min_margin]
    if strategy == "random":
        a, b = rng.choice(pairs)
        return [(a[0], b[0])]
    pairs.sort(key=lambda ab: (-(ab[0][1] - ab[1][1]), ab[0][0], ab[1][0]))
    return [(a[0], b[0]) for a, b in pairs]


def prompt_pairs(rec: dict, where: str, strategy: str = "max_min", min_margin: float = 0.0, truncated: str = "exclude",
                 truncated_penalty: float = 1.0, seed: int = 42, counts: Counter | None = None,
                 max_pairs_per_prompt: int | None = None) -> list[dict] | str:
    """One rewards record -> its pairs ``[{id, prompt, chosen, rejected, chosen_reward, rejected_reward}]``
    (one for ``max_min``/``max_random``/``random``; up to ``max_pairs_per_prompt`` for the multi-pair
    strategies, all with the record's ``id``) or a skip reason (``identical_responses``,
    ``fewer_than_2_valid``, ``tie``, ``margin_below_min``: see the module docstring).

    ``chosen``/``rejected`` are one-message lists ``[{"role": "assistant", "content": ...}]`` (TRL's
    conversational preference format).

    Raises:
        DataError: the record is malformed or a reward is NaN/inf (names ``where`` and the id).
    """
    rewards = validate_rewards(rec, where)
    cands = candidates(rec["responses"], rewards, rec["finish_reasons"], truncated, truncated_penalty, counts)
    if len(cands) < 2:
        nonempty = [r for r in rec["responses"] if r.strip()]
        return "identical_responses" if len(nonempty) >= 2 and distinct_texts(nonempty) == 1 else "fewer_than_2_valid"
    picked = choose(cands, strategy, min_margin, random.Random(f"{seed}:{rec['id']}"))
    if isinstance(picked, str):
        return picked
    eff = dict(cands)
    return [{"id": rec["id"], "prompt": rec["prompt"],
             "chosen": [{"role": "assistant", "content": rec["responses"][c]}],
             "rejected": [{"role": "assistant", "content": rec["responses"][r]}],
             "chosen_reward": eff[c], "rejected_reward": eff[r]}
            for c, r in picked[:max_pairs_per_prompt]]


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None}
    # pstdev works in exact fractions, _mean divides first: no overflow for huge (finite) rewards such as +-1e308
    return {"mean": _mean(xs), "std": statistics.pstdev(xs), "min": min(xs), "max": max(xs)}


def _mean(xs: list[float]) -> float:
    """The mean of finite floats without overflow (fmean's running sum overflows past ~1.8e308)."""
    return math.fsum(x / len(xs) for x in xs)


def _check_unique(seen: dict, rec: dict, where: str) -> None:
    rid = rec.get("id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool):
        if rid in seen:
            raise DataError(f"{where}: id {rid!r} was already used at {seen[rid]}; each prompt must appear once "
                            "(merge its responses into one record, or give the records distinct ids).")
        seen[rid] = where


# skip reason / response count -> what to change when it explains an empty pair set
_NO_PAIRS_FIXES = {
    "truncated_excluded": "truncated=exclude dropped {n} truncated responses: use truncated=penalize (or keep), or "
                          "raise generation.max_tokens",
    "unscored": "{n} records or responses have no reward: check the reward stage's stats (responses_unscored)",
    "tie": "{n} prompts had all rewards equal: a reward with more resolution, or more responses per prompt "
           "(generation.k)",
    "margin_below_min": "{n} prompts had a best-worst margin under min_margin={min_margin}: lower min_margin",
    "identical_responses": "{n} prompts had one text K times: raise generation.temperature",
    "fewer_than_2_valid": "{n} prompts had fewer than 2 usable responses: raise generation.k or max_tokens",
    "empty": "{n} responses were empty: check the stop strings and the chat template",
}


def no_pairs_warning(n_in: int, n_pairs: int, skipped: Counter, resp_counts: Counter, truncated: str,
                     min_margin: float) -> str | None:
    """The warning for 0 pairs from a non-empty input: the skip reasons and what to change for each
    (e.g. ``truncated=exclude`` that dropped every response); None when there are pairs or no input."""
    if not n_in or n_pairs:
        return None
    counts = {**{k: v for k, v in resp_counts.items() if k != "total"}, **skipped}
    fixes = [_NO_PAIRS_FIXES[k].format(n=v, min_margin=min_margin) for k, v in counts.items()
             if v and k in _NO_PAIRS_FIXES and (k != "truncated_excluded" or truncated == "exclude")]
    return (f"make_pairs: 0 pairs from {n_in} prompts (skipped: {dict(skipped)}; responses: {dict(resp_counts)}); "
            f"the update has nothing to learn from. Fix: {'; '.join(fixes) or 'see skipped_examples in the stats'}.")


def build_pairs(records: Iterable[tuple[str, dict]], strategy: str = "max_min", min_margin: float = 0.0,
                truncated: str = "exclude", truncated_penalty: float = 1.0, seed: int = 42,
                max_pairs_per_prompt: int | None = None) -> tuple[list[dict], dict]:
    """Pairs from ``(where, rewards record)`` items, and the stats of the selection.

    Records whose ``rewards`` is ``null`` (the reward stage could not score them) are skipped as
    ``unscored``; ``null`` entries inside ``rewards`` are unscored responses (left out, counted).

    Returns:
        ``(pairs, stats)``; stats hold records in, pairs out, the prompts that gave a pair, skipped
        by reason with up to
        ``MAX_EXAMPLES`` ``"<where> (id=...)"`` per reason (``skipped_examples``), per-response
        counts, prompts with fewer than 2 distinct responses, ``warnings`` (low diversity; no pair
        from a non-empty input, with the skip reasons and their fixes), the
        truncation policy, the input reward mean/std/min/max, and the chosen/rejected reward and
        margin means.
    Raises:
        DataError: a malformed record, a NaN/inf or non-number reward, or an id seen twice (names the record).
    """
    pairs: list[dict] = []
    skipped, resp_counts = Counter(), Counter()
    examples: dict[str, list[str]] = {}
    all_rewards: list[float] = []
    n_in = sampled = low = with_pairs = 0
    seen: dict = {}  # id -> where it was first seen
    for where, rec in records:
        n_in += 1
        _check_unique(seen, rec, where)
        out = "unscored"
        if rec.get("rewards", ...) is not None:
            all_rewards.extend(x for x in validate_rewards(rec, where) if x is not None)
            resp_counts["total"] += len(rec["responses"])
            sampled += len(rec["responses"]) >= 2
            low += len(rec["responses"]) >= 2 and distinct_texts(rec["responses"]) < 2
            out = prompt_pairs(rec, where, strategy, min_margin, truncated, truncated_penalty, seed, resp_counts,
                               max_pairs_per_prompt)
        if isinstance(out, str):
            skipped[out] += 1
            if len(examples.setdefault(out, [])) < MAX_EXAMPLES:
                examples[out].append(f"{where} (id={rec.get('id')!r})")
        else:
            pairs.extend(out)
            with_pairs += 1
    warnings = [w for w in (low_diversity_warning(sampled, low, "make_pairs"),
                            no_pairs_warning(n_in, len(pairs), skipped, resp_counts, truncated, min_margin)) if w]
    stats = {"records_in": n_in, "pairs_out": len(pairs), "prompts_with_pairs": with_pairs,
             "skipped": dict(skipped), "skipped_examples": examples,
             "responses": dict(resp_counts), "prompts_fewer_than_2_distinct": low,
             "warnings": warnings, **_selection_stats(pairs, all_rewards),
             "strategy": strategy, "min_margin": min_margin, "max_pairs_per_prompt": max_pairs_per_prompt,
             "truncation": {"policy": truncated, "penalty": truncated_penalty if truncated == "penalize" else None},
             "seed": seed}
    return pairs, stats


def _selection_stats(pairs: list[dict], all_rewards: list[float]) -> dict:
    chosen = [p["chosen_reward"] for p in pairs]
    rejected = [p["rejected_reward"] for p in pairs]
    mean = lambda xs: _mean(xs) if xs else None  # noqa: E731
    margins = [c - r for c, r in zip(chosen, rejected)]  # inf when huge finite rewards of both signs overflow
    return {"reward": _summary(all_rewards), "chosen_reward_mean": mean(chosen), "rejected_reward_mean": mean(rejected),
            "margin_mean": mean(margins) if all(math.isfinite(m) for m in margins) else None}
