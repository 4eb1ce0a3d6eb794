"""Statistics of the loop's evaluation: paired tests against iteration 0, a length-controlled
reward, IFEval's four scores and a fluency proxy. numpy/scipy only; importable without torch.

Every iteration answers the same held-out prompts, so iteration i is compared with iteration 0
prompt by prompt (paired), which removes the between-prompt variance that dominates an
unpaired interval:

- :func:`paired_bootstrap`: 95% interval and two-sided p-value of the mean difference of a
  per-prompt score (Efron & Tibshirani 1993, *An Introduction to the Bootstrap*, ch. 13 and 16:
  percentile interval; p-value by inverting the percentile interval);
- :func:`mcnemar_exact`: McNemar's test on paired pass/fail (McNemar 1947), exact form: the
  discordant pairs under H0 are Binomial(b + c, 1/2) (``scipy.stats.binomtest``);
- :func:`length_controlled`: the reward with its linear dependence on log response length taken
  out, the idea behind AlpacaEval's length-controlled win rate (Dubois et al. 2024,
  arXiv 2404.04475), here as one OLS fit pooled over every iteration's held-out answers;
- :func:`ifeval_scores`: IFEval's prompt-level and instruction-level accuracy, strict and loose
  (Zhou et al. 2023, arXiv 2311.07911, section 3);
- :func:`distinct_n`: distinct-n, unique n-grams / all n-grams over a set of responses (Li et al.
  2016, arXiv 1510.03055), a repetition proxy.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def paired_bootstrap(base: Sequence[float], new: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> dict:
    """Paired bootstrap of the mean difference ``new - base`` over the same prompts.

    Prompts are resampled with replacement ``resamples`` times (numpy ``default_rng(seed)``); the
    interval is the 2.5 and 97.5 percentiles of the resampled mean differences; the two-sided
    p-value is ``min(1, 2 * min(P*(d <= 0), P*(d >= 0)))`` over the resampled means (the smallest
    level at which the percentile interval excludes 0; Efron & Tibshirani 1993, section 16.4).
    Identical inputs give difference 0 and p = 1.

    Args:
        base, new: one score per prompt, aligned (same length N >= 1, same prompt order).
    Returns:
        ``{"diff": mean(new - base), "ci95": [lo, hi], "p_value": p, "n": N, "resamples", "seed"}``.
    Raises:
        ValueError: lengths differ, or no prompt.
    """
    a, b = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired_bootstrap: base has {a.shape} scores, new {b.shape}; they must be aligned per prompt.")
    if a.size == 0:
        raise ValueError("paired_bootstrap: no prompt to compare.")
    d = b - a  # (N,)
    idx = np.random.default_rng(seed).integers(0, d.size, size=(resamples, d.size))  # (R, N)
    means = d[idx].mean(axis=1)  # (R,)
    lo, hi = np.percentile(means, [2.5, 97.5])
    p = min(1.0, 2.0 * min(float(np.mean(means <= 0)), float(np.mean(means >= 0))))
    return {"diff": float(d.mean()), "ci95": [float(lo), float(hi)], "p_value": p, "n": int(d.size),
            "resamples": resamples, "seed": seed}


def mcnemar_exact(base: Sequence[bool], new: Sequence[bool]) -> dict:
    """Exact McNemar test of paired pass/fail (same prompts, two iterations).

    ``b`` = prompts passed by base only, ``c`` = passed by new only; under H0 (same pass rate)
    ``c ~ Binomial(b + c, 1/2)``; the two-sided p-value is ``scipy.stats.binomtest(c, b + c)``
    (1.0 when there is no discordant prompt).

    Returns:
        ``{"base_only": b, "new_only": c, "n": N, "p_value": p}``.
    Raises:
        ValueError: the two lists differ in length.
    """
    from scipy.stats import binomtest

    if len(base) != len(new):
        raise ValueError(f"mcnemar_exact: {len(base)} base and {len(new)} new outcomes; they must be aligned per prompt.")
    b = sum(1 for x, y in zip(base, new) if x and not y)
    c = sum(1 for x, y in zip(base, new) if y and not x)
    p = 1.0 if b + c == 0 else float(binomtest(c, b + c, 0.5).pvalue)
    return {"base_only": b, "new_only": c, "n": len(base), "p_value": p}


def length_fit(rewards: Sequence[float], tokens: Sequence[int]) -> tuple[float, float]:
    """OLS fit ``reward = a + b * log(tokens)`` (tokens clipped to >= 1).

    Returns:
        ``(a, b)``; ``b = 0`` when all lengths are equal (nothing to control for).
    Raises:
        ValueError: lengths differ, or no answer.
    """
    r, x = np.asarray(rewards, dtype=float), np.log(np.maximum(np.asarray(tokens, dtype=float), 1.0))
    if r.shape != x.shape or r.size == 0:
        raise ValueError(f"length_fit: {r.size} rewards for {x.size} lengths; need one length per reward, at least one.")
    if np.ptp(x) == 0.0:  # one length only (np.var can be a rounding residue > 0 there)
        return float(r.mean()), 0.0
    var = float(np.var(x))
    b = float(np.mean((x - x.mean()) * (r - r.mean())) / var)
    return float(r.mean() - b * x.mean()), b


def length_residuals(rewards: Sequence[float], tokens: Sequence[int], fit: tuple[float, float]) -> np.ndarray:
    """``reward - (a + b * log(tokens))`` per answer, for a fit of :func:`length_fit`. Shape (N,)."""
    a, b = fit
    x = np.log(np.maximum(np.asarray(tokens, dtype=float), 1.0))
    return np.asarray(rewards, dtype=float) - (a + b * x)


def length_controlled(groups: dict[int, tuple[Sequence[float], Sequence[int]]], base: int = 0) -> dict:
    """Length-controlled mean reward per iteration.

    One OLS fit ``reward = a + b * log(response tokens)`` over the answers of every iteration
    together (:func:`length_fit`); each iteration's LC reward is the mean of its residuals plus the
    mean reward of iteration ``base``, so ``base``'s LC reward is its plain mean and a later
    iteration gains only what its length does not explain. A reward fully explained by length
    gives every iteration the base's mean (LC gain 0). Unlike AlpacaEval's LC win rate (Dubois
    et al. 2024), which fits a GLM with per-model terms, this pooled fit credits to length any
    reward change that comes with a length change: a conservative estimate.

    Args:
        groups: iteration -> (rewards, response tokens), aligned.
        base: the iteration the others are compared with (its mean is added back).
    Returns:
        ``{"slope_per_log_token": b, "intercept": a, "lc_mean": {iteration: value},
        "residuals": {iteration: np.ndarray (N_i,)}}``.
    Raises:
        ValueError: ``base`` not in ``groups``, or a group whose lists differ in length.
    """
    if base not in groups:
        raise ValueError(f"length_controlled: base iteration {base} has no answers.")
    all_r = [x for r, _ in groups.values() for x in r]
    all_t = [t for _, ts in groups.values() for t in ts]
    for i, (r, t) in groups.items():
        if len(r) != len(t):
            raise ValueError(f"length_controlled: iteration {i} has {len(r)} rewards for {len(t)} lengths.")
    fit = length_fit(all_r, all_t)
    base_mean = float(np.mean(groups[base][0]))
    res = {i: length_residuals(r, t, fit) for i, (r, t) in groups.items()}
    base_res = float(res[base].mean())
    return {"intercept": fit[0], "slope_per_log_token": fit[1],
            "lc_mean": {i: float(v.mean()) - base_res + base_mean for i, v in res.items()}, "residuals": res}


def ifeval_scores(strict: Sequence[Sequence[bool]], loose: Sequence[Sequence[bool]]) -> dict:
    """IFEval's four numbers from per-instruction outcomes (one list of booleans per prompt).

    Prompt-level: the share of prompts whose every instruction is followed; instruction-level:
    the share of all instructions followed (Zhou et al. 2023, section 3). Strict checks the
    response as is, loose also variants without the first/last line or markdown ``*``.

    Returns:
        ``{"prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose"}`` in [0, 1]
        (None each when there is no prompt).
    """
    def level(rows: Sequence[Sequence[bool]]) -> tuple[float | None, float | None]:
        n_inst = sum(len(r) for r in rows)
        if not rows or not n_inst:
            return None, None
        return sum(all(r) for r in rows) / len(rows), sum(sum(r) for r in rows) / n_inst

    ps, is_ = level(strict)
    pl, il = level(loose)
    return {"prompt_strict": ps, "prompt_loose": pl, "instruction_strict": is_, "instruction_loose": il}


def instruction_groups(ids: Sequence[Sequence[str]], strict: Sequence[Sequence[bool]],
                       loose: Sequence[Sequence[bool]]) -> dict[str, dict]:
    """Instruction-level pass rates per instruction group (the id's part before ``:``, e.g.
    ``length_constraints`` for ``length_constraints:number_words``), IFEval's own grouping.

    Args:
        ids, strict, loose: per prompt, its instruction ids and their strict / loose outcomes
            (aligned lists).
    Returns:
        ``{group: {"instructions": n, "strict": rate, "loose": rate}}`` with rates in [0, 1],
        groups in sorted order.
    """
    acc: dict[str, list[int]] = {}
    for p_ids, p_s, p_l in zip(ids, strict, loose):
        for iid, s, lo in zip(p_ids, p_s, p_l):
            a = acc.setdefault(iid.split(":", 1)[0], [0, 0, 0])
            a[0], a[1], a[2] = a[0] + 1, a[1] + bool(s), a[2] + bool(lo)
    return {g: {"instructions": n, "strict": s / n, "loose": lo / n} for g, (n, s, lo) in sorted(acc.items())}


def distinct_n(texts: Sequence[str], n: int) -> float | None:
    """Distinct-n over ``texts``: unique word n-grams / all word n-grams (whitespace words, lower
    case), pooled over the texts (Li et al. 2016). 1.0 = no n-gram repeats; None when no text
    has n words."""
    grams = [tuple(w[j:j + n]) for t in texts for w in [t.lower().split()] for j in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def kl_summary(per_sample: Sequence[float]) -> dict:
    """Mean and standard error of per-sample ``log p_policy(y|x) - log p_ref(y|x)`` (nats), the
    Monte Carlo estimate of KL(policy || reference) from responses sampled from the policy.

    Returns:
        ``{"kl_mean", "kl_se", "samples"}`` (None values when there is no sample; se None for one).
    """
    xs = np.asarray(per_sample, dtype=float)
    if xs.size == 0:
        return {"kl_mean": None, "kl_se": None, "samples": 0}
    se = float(xs.std(ddof=1) / math.sqrt(xs.size)) if xs.size > 1 else None
    return {"kl_mean": float(xs.mean()), "kl_se": se, "samples": int(xs.size)}
