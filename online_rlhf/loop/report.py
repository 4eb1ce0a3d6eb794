"""``loop report`` and the live ``metrics`` line: ``report.md``, ``report.png`` and the wandb log
of a run's ``metrics.jsonl``."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import yaml

from ..jsonl import DataError, atomic_open, read_jsonl
from ..stage_table import STAGES


def report(run_dir: Path) -> Path:
    """Write ``report.md`` (a table per iteration, the prompts whose outcome flipped between
    iteration 0 and the last) and ``report.png`` (held-out reward with 95% intervals, its paired
    change, IFEval per iteration, stage seconds per iteration); log the rows to wandb when the
    config asks."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    lines = [f"# Run `{run_dir.name}`", "",
             f"Policy `{cfg['policy']}`, reward `{cfg['reward'].get('source', 'verifier')}`, "
             f"{cfg['iterations']} iteration{'s' * (cfg['iterations'] != 1)}, reference `{cfg['ref_model']}`.", "",
             "| iteration | held-out reward (95% CI) | n | rollout reward | pairs | train trunc. | eval tokens | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["eval_reward_ci95"]
        secs = sum(v for v in r["stage_seconds"].values() if v)
        rollout = r.get("rollout_reward_mean")
        lines.append(f"| {r['iteration']} | {r['eval_reward_mean']:.4f} ({lo:.4f}–{hi:.4f}) | {r['eval_prompts']} | "
                     f"{'–' if rollout is None else f'{rollout:.4f}'} | {r.get('pairs', '–')} | {r.get('train_truncation_rate', '–')} | "
                     f"{r['eval_mean_response_tokens']} | {secs:.0f} |")
    lines += ["", f"Held-out: greedy responses to the eval prompts after the iteration's {cfg.get('algorithm', 'dpo').upper()}. Rollout: mean reward "
              "of the iteration's K samples per train prompt, drawn from the previous iteration's policy."]
    lines += _quality_lines(rows, cfg)
    lines += _flip_lines(run_dir, rows)
    lines += ["", "Stage seconds per iteration:", ""]
    for r in rows:
        lines.append(f"- iteration {r['iteration']}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items() if v))
    lines += _grpo_lines(rows)
    lines += _hardware_lines(rows)
    lines += ["", "![report](report.png)", ""]
    with atomic_open(run_dir / "report.md") as f:
        f.write("\n".join(lines))
    _plot(rows, run_dir / "report.png")
    if cfg.get("wandb"):
        _log_wandb(rows, run_dir, cfg)
    return run_dir / "report.md"


def verdict(run_dir: Path) -> str:
    """The run's answer in one line, for the console's last line: IFEval prompt-level strict at the
    last iteration against iteration 0 (points, gained/lost, the exact McNemar p, and whether that is
    significant at 0.05), or, when IFEval did not score the last iteration, the held-out reward's
    paired difference and bootstrap p.

    Raises:
        FileNotFoundError / DataError: no ``metrics.jsonl``, an empty one (the run has not finished an
            iteration), or a row without its iteration number.
    """
    path = run_dir / "metrics.jsonl"
    rows = read_jsonl(path)
    if not rows:
        raise DataError(f"{path}: empty: the run has not finished an iteration yet (rerun bash run_loop.sh with its "
                        "config to resume it).")
    bad = next((i for i, r in enumerate(rows, 1) if not isinstance(r.get("iteration"), int)), None)
    if bad is not None:
        raise DataError(f"{path}: row {bad} has no iteration number: not a metrics file the loop wrote (one row per "
                        "finished iteration, each with its number). Give the run directory the loop wrote.")
    first, last = rows[0], rows[-1]
    n = last["iteration"]
    t, f0, fn = last.get("ifeval_vs_0"), first.get("ifeval"), last.get("ifeval")
    if (n >= 1 and t and f0 and fn and f0.get("prompt_strict") is not None and fn.get("prompt_strict") is not None
            and t.get("p_value") is not None):
        diff, p = 100 * t["prompt_strict_diff"], t["p_value"]
        word = "up" if diff > 0 else "down" if diff < 0 else "unchanged"
        sig = "significant" if p < 0.05 else "not significant"
        return (f"IFEval prompt-level strict {100 * f0['prompt_strict']:.1f} -> {100 * fn['prompt_strict']:.1f} at iteration "
                f"{n} ({diff:+.1f} points, {word}; {t['new_only']} prompts gained, {t['base_only']} lost; exact McNemar "
                f"p = {p:.2g}: {sig} at 0.05); instruction-level {100 * f0['instruction_strict']:.1f} -> "
                f"{100 * fn['instruction_strict']:.1f}; {fn['records_scored']} prompts.")
    h = last.get("eval_reward_vs_0")
    if n >= 1 and h:
        sig = "significant" if h["p_value"] < 0.05 else "not significant"
        return (f"held-out reward {first['eval_reward_mean']:.4f} -> {last['eval_reward_mean']:.4f} at iteration {n} "
                f"({h['diff']:+.4f}, paired bootstrap {_p(h)}: {sig} at 0.05); IFEval did not score iteration {n}.")
    return f"iteration {n}: nothing to compare with iteration 0 yet."


def metrics_line(row: dict) -> str:
    """The loop's live line after an iteration's ``metrics`` (one row of ``metrics.jsonl``): held-out
    reward, rollout reward, what the update trained on (DPO: pairs; GRPO: groups used of all, the
    skipped ones by reason; iteration 0: nothing), then :func:`_quality_summary`."""
    lo, hi = row["eval_reward_ci95"]
    parts = [f"iteration {row['iteration']}: held-out reward {row['eval_reward_mean']:.4f} "
             f"(95% CI {lo:.4f}..{hi:.4f}, n={row['eval_prompts']})"]
    if row.get("rollout_reward_mean") is not None:
        parts.append(f"rollout reward {row['rollout_reward_mean']:.4f}")
    g = row.get("grpo")
    if g:
        skipped = g.get("groups_skipped") or {}
        total = g["groups_used"] + sum(skipped.values())
        parts.append(f"grpo groups used {g['groups_used']}/{total}"
                     + (f" (skipped: {', '.join(f'{k} {v}' for k, v in skipped.items())})" if skipped else "")
                     + f", {g['steps']} steps")
    elif "pairs" in row:
        parts.append(f"pairs {row['pairs']}")
    return ", ".join(parts) + _quality_summary(row)


def _quality_summary(row: dict) -> str:
    """The evaluation part of the loop's live ``metrics`` line (empty parts left out)."""
    parts = []
    t = row.get("eval_reward_vs_0")
    if t:
        parts.append(f"vs iteration 0 {t['diff']:+.4f} (95% CI {t['ci95'][0]:+.4f}..{t['ci95'][1]:+.4f}, {_p(t)})")
    if row.get("eval_median_response_tokens") is not None:
        parts.append(f"median tokens {row['eval_median_response_tokens']}")
    kl, kl_se = (row.get("kl") or {}).get("kl_mean"), (row.get("kl") or {}).get("kl_se")
    if kl is not None and row["iteration"] >= 1:  # k1 estimate: unbiased, can be negative on few samples
        parts.append(f"KL {kl:.3f} nats" + (f" (se {kl_se:.3f})" if kl_se is not None else ""))
    f = row.get("ifeval")
    if f and f.get("prompt_strict") is not None:
        parts.append(f"IFEval prompt/instruction strict {100 * f['prompt_strict']:.1f}/{100 * f['instruction_strict']:.1f}"
                     + ("" if f.get("length_constraints_strict") is None
                        else f" (length_constraints {100 * f['length_constraints_strict']:.1f})"))
    return "".join(", " + p for p in parts)


def _fmt(x: Any, nd: int = 4, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"


def _paired_cell(t: dict | None) -> str:
    """``+0.0312 (−0.0100–+0.0700), p=0.14`` for a paired test result; – when there is none."""
    if not t:
        return "–"
    lo, hi = t["ci95"]
    return f"{_fmt(t['diff'], signed=True)} ({_fmt(lo, signed=True)}–{_fmt(hi, signed=True)}), {_p(t)}"


def _p(t: dict) -> str:
    """A bootstrap p-value; 0 resamples on the other side of 0 reads p < 1/resamples."""
    return f"p<{1 / t['resamples']:.0e}" if t["p_value"] == 0 else f"p={t['p_value']:.3g}"


def _quality_lines(rows: list[dict], cfg: dict) -> list[str]:
    """The report's tables of paired comparisons with iteration 0, length and drift, and IFEval."""
    lines = ["", "## Against iteration 0 (paired), length and drift", "",
             "| iteration | Δ held-out reward (95% CI), p | LC reward | Δ LC reward (95% CI), p | tokens mean / median | "
             "trunc. | distinct-1 / -2 | KL nats (se) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = r.get("kl") or {}
        lines.append(f"| {r['iteration']} | {_paired_cell(r.get('eval_reward_vs_0'))} | {_fmt(r.get('eval_reward_lc'))} | "
                     f"{_paired_cell(r.get('eval_reward_lc_vs_0'))} | {r.get('eval_mean_response_tokens')} / "
                     f"{r.get('eval_median_response_tokens', '–')} | {r.get('eval_truncation_rate')} | "
                     f"{_fmt(r.get('eval_distinct_1'), 3)} / {_fmt(r.get('eval_distinct_2'), 3)} | "
                     f"{_fmt(kl.get('kl_mean'), 3)} ({_fmt(kl.get('kl_se'), 3)}) |")
    slope = next((r.get("eval_length_slope") for r in rows if r.get("eval_length_slope") is not None), None)
    lines += ["", "Δ: paired bootstrap over the held-out prompts scored in both iterations (10,000 resamples, seed 0; "
              "95% percentile interval, two-sided p). LC reward: length-controlled, the mean residual of one OLS fit "
              f"reward = a + b·log(response tokens) over every iteration's greedy held-out answers (b = {_fmt(slope)}) "
              "plus iteration 0's mean (after AlpacaEval's length-controlled win rate, Dubois et al. 2024, "
              "arXiv 2404.04475). KL: mean over responses sampled from the iteration's policy (temperature 1) of "
              "log p_policy − log p_start, summed over response tokens (0 at iteration 0 by construction)."]
    if any(r.get("ifeval") for r in rows):
        lines += ["", "## IFEval", "",
                  "| iteration | prompts | prompt strict | prompt loose | instruction strict | instruction loose | "
                  "length_constraints strict | Δ prompt strict vs 0 (McNemar p) | trunc. |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            f = r.get("ifeval")
            if not f:
                continue
            t = r.get("ifeval_vs_0")
            vs = f"{100 * t['prompt_strict_diff']:+.1f} (p={t['p_value']:.3g}; {t['new_only']} gained, {t['base_only']} lost)" if t else "–"
            pct = {k: "–" if f.get(k) is None else f"{100 * f[k]:.1f}" for k in
                   ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose", "length_constraints_strict")}
            lines.append(f"| {r['iteration']} | {f['records_scored']} | {pct['prompt_strict']} | {pct['prompt_loose']} | "
                         f"{pct['instruction_strict']} | {pct['instruction_loose']} | {pct['length_constraints_strict']} | "
                         f"{vs} | {f.get('truncation_rate')} |")
        ifeval = cfg.get("ifeval") or {}
        lines += ["", f"IFEval (Zhou et al. 2023): greedy answers, max_tokens {ifeval.get('max_tokens')}, "
                  f"{'all prompts' if not ifeval.get('limit') else 'the first %s prompts' % ifeval.get('limit')}, scored "
                  "with the if-verifiable checkers; percentages. McNemar: exact test on prompt-level strict pass/fail."]
    warned = [w for r in rows for w in r.get("warnings", []) if "kl_warn" in w]
    if warned:
        lines += ["", "**Warnings**", "", *[f"- {w}" for w in warned]]
    return lines


FLIPS_SHOWN = (3, 2)  # prompts shown that improved, and that got worse, per evaluation
ANSWER_CHARS = 600  # characters of an answer shown in report.md


def _cell(text: str, limit: int = ANSWER_CHARS) -> str:
    """Text for one markdown table cell: cut to ``limit`` characters, HTML-escaped (an answer's
    ``<<title>>`` is text), pipes escaped, newlines as <br>."""
    import html

    text = text if len(text) <= limit else text[:limit].rstrip() + " …"
    return html.escape(text, quote=False).replace("|", "\\|").replace("\r", "").replace("\n", "<br>") or "(empty)"


def _last_user(prompt: list[dict]) -> str:
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


def _flip_lines(run_dir: Path, rows: list[dict]) -> list[str]:
    """report.md's "What changed" section: a few IFEval prompts whose prompt-level strict outcome
    flipped between iteration 0 and the last (gained first, then lost), and the held-out prompts whose
    reward rose and fell most, each with both answers side by side. Empty when the files are not there
    (e.g. IFEval did not score the last iteration)."""
    n = rows[-1]["iteration"]
    if n < 1:
        return []
    it0, itn = run_dir / "iter_0", run_dir / f"iter_{n}"
    out: list[str] = []
    if all((d / f).is_file() for d in (it0, itn) for f in ("ifeval.jsonl", "ifeval_generated.jsonl")):
        outcome = [{str(r["id"]): r for r in read_jsonl(d / "ifeval.jsonl")} for d in (it0, itn)]
        answers = [{str(r["id"]): r for r in read_jsonl(d / "ifeval_generated.jsonl")} for d in (it0, itn)]
        common = [k for k in outcome[0] if k in outcome[1] and k in answers[0] and k in answers[1]]
        gained = [k for k in common if not outcome[0][k]["prompt_strict"] and outcome[1][k]["prompt_strict"]]
        lost = [k for k in common if outcome[0][k]["prompt_strict"] and not outcome[1][k]["prompt_strict"]]
        shown = [("gained", k) for k in gained[:FLIPS_SHOWN[0]]] + [("lost", k) for k in lost[:FLIPS_SHOWN[1]]]
        if shown:
            out += ["", f"## What changed: IFEval prompts that flipped (iteration 0 vs {n})", "",
                    f"{len(gained)} prompts gained, {len(lost)} lost (prompt-level strict); the first "
                    f"{FLIPS_SHOWN[0]} and {FLIPS_SHOWN[1]} in file order, answers cut at {ANSWER_CHARS} characters. "
                    "Per instruction: strict pass (✓) or fail (✗).", "",
                    "| id | prompt | instructions | iteration 0 | iteration %d |" % n, "|---|---|---|---|---|"]
            for how, k in shown:
                marks = [" ".join("✓" if x else "✗" for x in o[k]["strict"]) for o in outcome]
                out.append(f"| {k} ({how}) | {_cell(_last_user(answers[1][k]['prompt']), 300)} | "
                           f"{_cell(', '.join(outcome[1][k].get('instruction_id_list') or []))} | "
                           f"{marks[0]}<br>{_cell(answers[0][k]['responses'][0])} | "
                           f"{marks[1]}<br>{_cell(answers[1][k]['responses'][0])} |")
    if (it0 / "eval.jsonl").is_file() and (itn / "eval.jsonl").is_file():
        recs = [{str(r["id"]): r for r in read_jsonl(d / "eval.jsonl") if r.get("rewards") and r["rewards"][0] is not None}
                for d in (it0, itn)]
        deltas = sorted(((recs[1][k]["rewards"][0] - recs[0][k]["rewards"][0], k) for k in recs[0] if k in recs[1]),
                        key=lambda dk: (-dk[0], dk[1]))
        up = [dk for dk in deltas if dk[0] > 0][:FLIPS_SHOWN[0]]
        down = [dk for dk in reversed(deltas) if dk[0] < 0][:FLIPS_SHOWN[1]]
        if up or down:
            out += ["", f"## What changed: held-out prompts whose reward moved most (iteration 0 vs {n})", "",
                    "| id | prompt | iteration 0 (reward) | iteration %d (reward) |" % n, "|---|---|---|---|"]
            for d, k in up + down:
                a, b = recs[0][k], recs[1][k]
                out.append(f"| {k} ({d:+.2f}) | {_cell(_last_user(b['prompt']), 300)} | "
                           f"{a['rewards'][0]:.2f}<br>{_cell(a['responses'][0])} | "
                           f"{b['rewards'][0]:.2f}<br>{_cell(b['responses'][0])} |")
    return out


def _grpo_lines(rows: list[dict]) -> list[str]:
    """Report lines of the GRPO iterations (none for DPO runs)."""
    lines = []
    for r in rows:
        g = r.get("grpo")
        if g:
            skipped = ", ".join(f"{k} {v}" for k, v in g["groups_skipped"].items()) or "none"
            kl = "" if g["kl_last"] is None else f", KL {g['kl_last']:.4f}"
            loss = "no step" if g["loss_first"] is None else f"loss {g['loss_first']:.4f} -> {g['loss_last']:.4f}"
            lines.append(f"- iteration {r['iteration']}: {g['groups_used']} groups used (skipped: {skipped}), "
                         f"{g['steps']} steps, {loss}{kl}, clip fraction {g['clip_fraction_mean'] or 0:.3f}")
    return ["", "GRPO per iteration:", "", *lines] if lines else []


def _hardware_lines(rows: list[dict]) -> list[str]:
    """Report lines: the CPU once, then each stage's device, dtype and threads (last iteration's)."""
    seen = {}
    for r in rows:
        seen.update(r.get("hardware") or {})
    if not seen:
        return []
    first = next(iter(seen.values()))
    lines = ["", f"Hardware: {first.get('cpu_model')} (torch capability {first.get('cpu_capability')}, "
                 f"native bf16: {'yes' if first.get('cpu_native_bf16') else 'no'}).", ""]
    lines += [f"- {stage}: {hw.get('device')} {hw.get('dtype')}, "
              f"{str(hw['processes']) + ' processes x ' if hw.get('processes', 1) > 1 else ''}{hw.get('threads')} thread(s)"
              for stage, hw in seen.items()]
    return lines


def _plot(rows: list[dict], out: Path) -> None:
    """report.png, four panels: the held-out reward per iteration (95% CI); its paired change against
    iteration 0 (raw and length-controlled); IFEval prompt- and instruction-level strict per iteration,
    each later point labelled with its change, gained/lost prompts and McNemar p against iteration 0;
    and the stage seconds per iteration (stacked; the legend beside the axes, the axis up to the
    tallest bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in rows]
    means = [r["eval_reward_mean"] for r in rows]
    err = [[m - r["eval_reward_ci95"][0] for m, r in zip(means, rows)],
           [r["eval_reward_ci95"][1] - m for m, r in zip(means, rows)]]
    fig, ((a, c), (f, b)) = plt.subplots(2, 2, figsize=(15, 9))
    a.errorbar(its, means, yerr=err, marker="o", capsize=4)
    a.set_xticks(its)
    a.set_xlabel("iteration (0 = starting policy)")
    a.set_ylabel("held-out reward (mean, 95% CI)")
    a.set_title("Held-out reward per iteration")
    for key, label, shift in (("eval_reward_vs_0", "held-out reward", -0.05), ("eval_reward_lc_vs_0", "length-controlled", 0.05)):
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key)]
        if pts:
            c.errorbar([i + shift for i, _ in pts], [t["diff"] for _, t in pts], capsize=4, marker="o", label=label,
                       yerr=[[t["diff"] - t["ci95"][0] for _, t in pts], [t["ci95"][1] - t["diff"] for _, t in pts]])
    c.axhline(0.0, color="grey", lw=0.8)
    c.set_xticks(its)
    c.set_xlabel("iteration")
    c.set_ylabel("difference vs iteration 0 (paired 95% CI)")
    c.set_title("Held-out reward: paired change vs the starting policy")
    if any(r.get("eval_reward_vs_0") for r in rows):
        c.legend(fontsize=8)
    _plot_ifeval(f, rows)
    stages = [s for s in STAGES if any(r["stage_seconds"].get(s) for r in rows)]
    bottom = [0.0] * len(rows)
    for s in stages:
        vals = [r["stage_seconds"].get(s) or 0.0 for r in rows]
        b.bar(its, vals, bottom=bottom, label=s)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_xticks(its)
    b.set_xlabel("iteration")
    b.set_ylabel("seconds")
    b.set_ylim(0, 1.08 * max(bottom + [1.0]))
    b.set_title(f"Stage wall time ({sum(bottom):.0f} s in all)")
    if stages:
        b.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    with atomic_open(out, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100)
    plt.close(fig)


def _plot_ifeval(ax, rows: list[dict]) -> None:
    """The IFEval panel: prompt- and instruction-level strict (percent) at each iteration IFEval scored,
    later points labelled ``+x.x (g/l, p=...)`` from the McNemar test against iteration 0."""
    pts = [(r["iteration"], r["ifeval"], r.get("ifeval_vs_0")) for r in rows
           if r.get("ifeval") and r["ifeval"].get("prompt_strict") is not None]
    ax.set_title("IFEval strict (greedy) per iteration")
    ax.set_xlabel("iteration")
    ax.set_ylabel("percent")
    ax.set_xticks([r["iteration"] for r in rows])
    ax.set_xlim(rows[0]["iteration"] - 0.4, rows[-1]["iteration"] + 0.4)  # room for the last point's label
    if not pts:
        ax.text(0.5, 0.5, "IFEval not run (ifeval.when=never)", ha="center", va="center", transform=ax.transAxes)
        return
    x = [i for i, _, _ in pts]
    prompt = [100 * f["prompt_strict"] for _, f, _ in pts]
    instr = [100 * f["instruction_strict"] for _, f, _ in pts]
    ax.plot(x, prompt, marker="o", label="prompt-level strict")
    ax.plot(x, instr, marker="s", label="instruction-level strict")
    for i, f, t in pts:
        if t:
            sig = "*" if t["p_value"] < 0.05 else ""
            ax.annotate(f"{100 * t['prompt_strict_diff']:+.1f}{sig} ({t['new_only']}/{t['base_only']}, p={t['p_value']:.2g})",
                        (i, 100 * f["prompt_strict"]), textcoords="offset points", xytext=(0, -16), ha="center", fontsize=8)
    lo, hi = min(prompt + instr), max(prompt + instr)
    ax.set_ylim(max(0.0, lo - 6), min(100.0, hi + 6))
    ax.legend(fontsize=8, loc="upper left")
    ax.text(0.99, 0.02, f"{pts[-1][1]['records_scored']} prompts; labels: Δ prompt strict vs 0 (gained/lost, exact "
            "McNemar p; * p<0.05)", ha="right", va="bottom", transform=ax.transAxes, fontsize=7, color="grey")


def _log_wandb(rows: list[dict], run_dir: Path, cfg: dict) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    import wandb

    run = wandb.init(project="online-rlhf", name=run_dir.name, id=f"loop-{run_dir.name}", resume="allow",
                     config=cfg, dir=str(run_dir))
    for r in rows:
        rollout = {"train/rollout_reward_mean": r["rollout_reward_mean"]} if r.get("rollout_reward_mean") is not None else {}
        grpo = {f"train/grpo_{k}": v for k, v in (r.get("grpo") or {}).items() if isinstance(v, (int, float))}
        quality = {f"eval/{k}": v for k, v in (("reward_lc", r.get("eval_reward_lc")),
                                                   ("kl", (r.get("kl") or {}).get("kl_mean")),
                                                   ("ifeval_prompt_strict", (r.get("ifeval") or {}).get("prompt_strict")))
                   if v is not None}
        run.log({"eval/reward_mean": r["eval_reward_mean"], "train/pairs": r.get("pairs", 0), **rollout, **grpo, **quality,
                 **{f"time/{k}": v for k, v in r["stage_seconds"].items() if v}}, step=r["iteration"])
    run.finish()

