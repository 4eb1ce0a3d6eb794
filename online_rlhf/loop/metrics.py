"""``loop metrics``: one row of ``metrics.jsonl`` per iteration, from the stages' stats and outputs."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..jsonl import read_json, read_jsonl, write_json, write_jsonl
from ..stage_table import STAGES
from ..stats import DPOStats, GRPOStats, PairsStats, RewardStats, StageStats, stats_path
from .freshness import done_marker, run_config


def mean_ci95(xs: list[float]) -> tuple[float, float, float]:
    """Mean and normal-approximation 95% interval (mean ± 1.96·s/√n); (nan, nan, nan) when empty."""
    if not xs:
        return (math.nan, math.nan, math.nan)
    m = statistics.fmean(xs)
    half = 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return (m, m - half, m + half)


# The stats files of an iteration folder: name -> class. Iteration 0 only evaluates (no train stages).
def iteration_stats(it: Path, i: int) -> dict[str, StageStats]:
    """Every stage's stats of iteration folder ``it`` (iteration ``i``), read through the classes of
    the stage table: ``{name of the stage's first output: stats}`` for the stages of the iteration's
    ``plan.json`` (iteration 0: the held-out evaluation; a stage that runs once before the loop,
    ``schedule="0"`` as SFT, belongs to the run, not to iteration 0, and is left out).

    Raises:
        FileNotFoundError: a stage's stats file is missing (its stage has not run).
        DataError: a stats file is not what its stage writes (names the file and the key).
    """
    entries = read_json(it / "plan.json")
    return {Path(e["outputs"][0]).name: STAGES[name].stats.read(stats_path(e["outputs"][0]))
            for name, e in entries.items() if not STAGES[name].before_the_loop}


def metrics(run_dir: Path, i: int) -> dict:
    """Write (or replace) iteration ``i``'s row of ``metrics.jsonl`` and ``iter_<i>/stats.json``
    (every stage's stats of the iteration); return the row.

    Unscored responses (``null`` rewards) are left out of the held-out means and counted
    (``eval_unscored_responses``). ``warnings`` lists what the loop prints after the row, e.g. most
    train prompts with fewer than 2 distinct responses (``train_prompts_fewer_than_2_distinct``).

    Raises:
        FileNotFoundError: iteration ``i`` is not planned (names the planned ones), ``eval.jsonl`` or a
            stage's stats file is missing (for ``i >= 1`` the
            train stages' too: generated, rewards, pairs, model).
        DataError: a stats file is not what its stage writes (names the file and the key).
    """
    it = run_dir / f"iter_{i}"
    if not (it / "plan.json").is_file():
        planned = sorted(int(p.name[5:]) for p in run_dir.glob("iter_*") if p.name[5:].isdigit()
                         and (p / "plan.json").is_file())
        raise FileNotFoundError(f"{run_dir}: iteration {i} is not planned in this run (planned: "
                                f"{', '.join(map(str, planned)) or 'none'}); give one of those.")
    evals = read_jsonl(it / "eval.jsonl")
    stats = iteration_stats(it, i)
    firsts = [r["rewards"][0] for r in evals]  # held-out: first (greedy) response
    rewards = [float(x) for x in firsts if x is not None]
    all_rewards = [float(x) for r in evals for x in r["rewards"] if x is not None]
    m, lo, hi = mean_ci95(all_rewards if len(all_rewards) > len(rewards) else rewards)
    row: dict[str, Any] = {
        "iteration": i, "eval_reward_mean": m, "eval_reward_ci95": [lo, hi], "eval_prompts": len(evals),
        "eval_mean_response_tokens": _mean([t for r in evals for t in r.get("response_tokens", [])]),
        "eval_truncation_rate": _rate([f for r in evals for f in r["finish_reasons"]]),
        "eval_unscored": stats["eval_generated.jsonl"].prompts_in - len(evals),
        "eval_unscored_responses": sum(x is None for r in evals for x in r["rewards"]),
        "warnings": [],
    }
    if i >= 1:
        row.update(_train_metrics(it, i, stats))
    quality = _eval_quality(run_dir, i, evals, stats)
    row["warnings"] = [*row["warnings"], *quality.pop("warnings")]
    row.update(quality)
    # One stats.json per iteration: every stage's counts.
    write_json(it / "stats.json", {name: st.model_dump(mode="json") for name, st in stats.items()})
    # Markers exist only for stages that ran (no train stages in iteration 0).
    row["stage_seconds"] = {s: read_json(done_marker(run_dir, i, s)).get("seconds") for s in STAGES
                            if done_marker(run_dir, i, s).exists()}
    row["hardware"] = _hardware(stats)
    rows = [r for r in (read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else [])
            if r["iteration"] != i]
    rows = sorted([*rows, row], key=lambda r: r["iteration"])
    _refit_length_control(run_dir, rows)
    write_jsonl(run_dir / "metrics.jsonl", rows)
    return row


def _first_answers(evals: list[dict]) -> dict[str, tuple[float, int]]:
    """``{prompt id: (reward, response tokens)}`` of the first (greedy) held-out answer, scored ones only."""
    return {str(r["id"]): (float(r["rewards"][0]), int((r.get("response_tokens") or [1])[0]))
            for r in evals if r["rewards"] and r["rewards"][0] is not None}


def _eval_quality(run_dir: Path, i: int, evals: list[dict], stats: dict[str, StageStats]) -> dict:
    """Iteration ``i``'s evaluation columns beyond the held-out mean (``online_rlhf.evaluation``):

    - ``eval_median_response_tokens``, ``eval_distinct_1`` / ``eval_distinct_2`` (greedy answers);
    - ``eval_reward_vs_0``: paired bootstrap of the held-out reward against iteration 0, over the
      prompts scored in both (``{diff, ci95, p_value, n, ...}``; None at iteration 0);
    - ``ifeval``: IFEval's four numbers (when ifeval_score ran); ``ifeval_vs_0``: McNemar on
      prompt-level strict pass/fail against iteration 0, plus the difference of that accuracy;
    - ``kl``: KL(policy || starting policy) in nats (``{kl_mean, kl_se, samples}``; 0 at iteration 0
      by construction), with a warning above the run's ``kl_warn``.
    The length-controlled columns are added by :func:`_refit_length_control`.
    """
    from ..evaluation import distinct_n, mcnemar_exact, paired_bootstrap

    firsts = [r["responses"][0] for r in evals if r["responses"]]
    tokens = [int(r["response_tokens"][0]) for r in evals if r.get("response_tokens")]
    out: dict[str, Any] = {"eval_median_response_tokens": statistics.median(tokens) if tokens else None,
                           "eval_distinct_1": _round(distinct_n(firsts, 1)), "eval_distinct_2": _round(distinct_n(firsts, 2)),
                           "eval_reward_vs_0": None, "ifeval": None, "ifeval_vs_0": None, "kl": None, "warnings": []}
    base_file = run_dir / "iter_0" / "eval.jsonl"
    if i >= 1 and base_file.is_file():
        base, now = _first_answers(read_jsonl(base_file)), _first_answers(evals)
        common = sorted(set(base) & set(now))
        if common:
            out["eval_reward_vs_0"] = paired_bootstrap([base[k][0] for k in common], [now[k][0] for k in common])
    if "ifeval.jsonl" in stats:
        st = stats["ifeval.jsonl"]
        out["ifeval"] = {k: getattr(st, k) for k in ("prompt_strict", "prompt_loose", "instruction_strict",
                                                     "instruction_loose", "records_scored", "truncation_rate")}
        length = (st.groups or {}).get("length_constraints")
        out["ifeval"]["length_constraints_strict"] = length["strict"] if length else None
        base_file = run_dir / "iter_0" / "ifeval.jsonl"
        if i >= 1 and base_file.is_file():
            base = {str(r["id"]): r["prompt_strict"] for r in read_jsonl(base_file)}
            now = {str(r["id"]): r["prompt_strict"] for r in read_jsonl(run_dir / f"iter_{i}" / "ifeval.jsonl")}
            common = sorted(set(base) & set(now))
            if common:
                test = mcnemar_exact([base[k] for k in common], [now[k] for k in common])
                test["prompt_strict_diff"] = (sum(now[k] for k in common) - sum(base[k] for k in common)) / len(common)
                out["ifeval_vs_0"] = test
    if i == 0:
        out["kl"] = {"kl_mean": 0.0, "kl_se": 0.0, "samples": 0}  # the starting policy is the reference
    elif "kl.jsonl" in stats:
        st = stats["kl.jsonl"]
        out["kl"] = {"kl_mean": st.kl_mean, "kl_se": st.kl_se, "samples": st.samples}
        warn = run_config(run_dir).get("kl_warn")
        if warn is not None and st.kl_mean is not None and st.kl_mean > warn:
            out["warnings"].append(f"iteration {i}: KL(policy || starting policy) = {st.kl_mean:.2f} nats per response "
                                   f"exceeds kl_warn={warn}: the policy has drifted far from where it started; check "
                                   "the held-out answers (length, repetition) before trusting the reward gain.")
    return out


def _refit_length_control(run_dir: Path, rows: list[dict]) -> None:
    """Set ``eval_reward_lc`` (length-controlled held-out reward) and ``eval_reward_lc_vs_0`` (its
    paired bootstrap against iteration 0) in every row, from one fit over the greedy held-out
    answers of every iteration in ``rows`` (``online_rlhf.evaluation.length_controlled``), so that
    all rows share the same fit. Rows without iteration 0's answers get None."""
    from ..evaluation import length_controlled, paired_bootstrap

    answers = {r["iteration"]: _first_answers(read_jsonl(run_dir / f"iter_{r['iteration']}" / "eval.jsonl"))
               for r in rows if (run_dir / f"iter_{r['iteration']}" / "eval.jsonl").is_file()}
    answers = {i: a for i, a in answers.items() if a}
    for r in rows:
        r["eval_reward_lc"], r["eval_reward_lc_vs_0"] = None, None
    if 0 not in answers:
        return
    keys = {i: sorted(a) for i, a in answers.items()}
    lc = length_controlled({i: ([answers[i][k][0] for k in keys[i]], [answers[i][k][1] for k in keys[i]])
                            for i in answers})
    residual = {i: dict(zip(keys[i], lc["residuals"][i].tolist())) for i in answers}
    for r in rows:
        i = r["iteration"]
        if i not in answers:
            continue
        r["eval_reward_lc"] = lc["lc_mean"][i]
        r["eval_length_slope"] = lc["slope_per_log_token"]
        common = sorted(set(residual[0]) & set(residual[i]))
        if i >= 1 and common:
            r["eval_reward_lc_vs_0"] = paired_bootstrap([residual[0][k] for k in common], [residual[i][k] for k in common])


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _hardware(stats: dict[str, StageStats]) -> dict:
    """``{stage output: {device, dtype, threads, processes, cpu_model, cpu_capability, cpu_native_bf16}}``
    for the stages of one iteration (:func:`iteration_stats`) that recorded what they ran on
    (pairs record nothing; a verifier, remote or judge reward source ran no model here)."""
    out = {}
    for name, st in stats.items():
        hw = getattr(st, "hardware", None)
        if hw:
            out[name.split(".")[0]] = hw
    return out


def _train_metrics(it: Path, i: int, stats: dict[str, StageStats]) -> dict:
    """The train-side columns of iteration ``i``'s metrics row (generation, rewards, pairs, DPO),
    from the generated records, the pairs file and the stages' stats (:func:`iteration_stats`)."""
    from ..pairs import distinct_texts, low_diversity_warning

    gen = read_jsonl(it / "generated.jsonl")
    rewards_stats: RewardStats = stats["rewards.jsonl"]
    sampled = [r for r in gen if len(r.get("responses", [])) >= 2]
    low = sum(distinct_texts(r["responses"]) < 2 for r in sampled)
    warning = low_diversity_warning(len(sampled), low, f"iteration {i}, generated.jsonl")
    if isinstance(stats["model"], GRPOStats):
        return {"train_prompts": len(gen), "rollout_reward_mean": rewards_stats.reward.mean,
                "train_truncation_rate": _rate([f for r in gen for f in r["finish_reasons"]]),
                "train_prompts_fewer_than_2_distinct": low, "grpo": grpo_metrics(stats["model"]),
                "warnings": [warning] if warning else []}
    pairs_stats: PairsStats = stats["pairs.jsonl"]
    dpo: DPOStats = stats["model"]
    return {
        "train_prompts": len(gen),
        # mean reward of this iteration's K rollouts per train prompt (sampled from the policy of
        # iteration i-1, on prompts it has not trained on): the on-policy reward, before DPO.
        "rollout_reward_mean": rewards_stats.reward.mean,
        "train_truncation_rate": _rate([f for r in gen for f in r["finish_reasons"]]),
        "train_prompts_fewer_than_2_distinct": low,
        "pairs": sum(1 for _ in open(it / "pairs.jsonl", encoding="utf-8")),
        "pairs_skipped": pairs_stats.skipped,
        "dpo": {"train_loss_first": dpo.train_loss_first, "train_loss_last": dpo.train_loss_last,
                "rewards_accuracies_last": dpo.rewards_accuracies_last, "steps": dpo.steps},
        "warnings": [warning] if warning else [],
    }


def grpo_metrics(g: GRPOStats) -> dict:
    """The GRPO columns of a metrics row: loss, KL, clip fraction, groups used and skipped, steps, seconds."""
    return {"loss_first": g.loss_first, "loss_last": g.loss_last, "kl_last": g.kl_last,
            "clip_fraction_mean": g.clip_fraction_mean, "reward_mean": g.reward_mean, "groups_used": g.groups_used,
            "groups_skipped": g.groups_skipped, "steps": g.steps, "seconds": g.seconds.total}


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 2) if xs else None


def _rate(reasons: list[str]) -> float | None:
    return round(sum(r == "length" for r in reasons) / len(reasons), 4) if reasons else None

