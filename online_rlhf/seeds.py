"""A recipe over several seeds, and one table that says whether it made the model better.

    .venv-train/bin/python -m online_rlhf.seeds configs/if_dpo.yaml --seeds 1 2 3
    .venv-train/bin/python -m online_rlhf.seeds configs/if_dpo.yaml dpo.training.beta=0.05 --seeds 1 2 3   # runs if_dpo_<hash>_seedS
    .venv-train/bin/python -m online_rlhf.seeds configs/if_dpo.yaml --seeds 1 2 3 --table-only

Runs ``bash run_loop.sh CONFIG seed=S run_name=<run_name>_seed<S> [overrides]`` for each seed in
turn (a finished run resumes as done; ``--table-only`` runs nothing), then reads each run's
``metrics.jsonl`` and ``iter_<i>/ifeval.jsonl`` and writes ``<output_root>/<run_name>_seeds/seeds.md``
and ``seeds.json``:

- per seed, at the last iteration against iteration 0 (the same prompts, paired): IFEval prompt-
  and instruction-level strict and their differences, the exact McNemar test on prompt-level strict
  (``online_rlhf.evaluation.mcnemar_exact``), the ``length_constraints`` instructions' strict pass
  rate, the held-out reward difference with its paired-bootstrap p, median held-out answer tokens,
  KL from the starting policy and wall time;
- pooled over seeds: the mean difference with a 95% t-interval across seeds (n - 1 degrees of
  freedom; ``scipy.stats.t``), and one exact binomial test on all discordant IFEval prompts of all
  seeds together (gained vs lost, ``scipy.stats.binomtest``; each seed's prompts are paired with its
  own iteration 0).

One run proves little either way: the same recipe gave held-out p from 0.003 to 0.18 between draws.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .config import ConfigError
from .jsonl import DataError, read_jsonl, write_json
from .loop_config import PATH_KEYS
from .paths import PROJECT_ROOT


# Overrides that say where a run lives, what it reports to or how it schedules work that gives the same
# outputs (co_decode), not what it trains: left out of the name.
LOCATION_KEYS = ("output_root", "wandb", "eval_cache", "co_decode")


def recipe_name(base: str, overrides: list[str] = ()) -> str:
    """The recipe's name: ``base`` (the config's run_name), plus ``_<8 hex of sha256>`` of the sorted
    overrides when there are any, so that a variant never reuses or overwrites another recipe's runs.
    Overrides of :data:`LOCATION_KEYS` (``output_root=...``) do not make a variant."""
    import hashlib

    overrides = [o for o in overrides if o.split("=", 1)[0].strip() not in LOCATION_KEYS]
    if not overrides:
        return base
    return f"{base}_{hashlib.sha256(' '.join(sorted(overrides)).encode()).hexdigest()[:8]}"


def run_name_of(base: str, seed: int) -> str:
    """``<base>_seed<seed>``: the run directory name of one seed (``base`` from :func:`recipe_name`)."""
    return f"{base}_seed{seed}"


def mean_ci95(xs: list[float]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """Mean and 95% t-interval of ``xs`` across seeds: ``(mean, lo, hi)``; the interval is None for
    fewer than 2 values (Student's t with n - 1 degrees of freedom, ``scipy.stats.t.ppf(0.975, n - 1)``)."""
    from scipy.stats import t

    if not xs:
        return None, None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    h = float(t.ppf(0.975, len(xs) - 1)) * sd / math.sqrt(len(xs))
    return m, m - h, m + h


def _ifeval_rows(run_dir: Path, i: int) -> dict[str, dict]:
    path = run_dir / f"iter_{i}" / "ifeval.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: missing; the run has no IFEval result for iteration {i} (ifeval.when=never?). "
                        "Run the recipe with ifeval.when=ends or every.")
    return {str(r["id"]): r for r in read_jsonl(path)}


def _instruction_rate(rows: dict[str, dict], ids: list[str], group: str | None = None) -> Optional[float]:
    """Strict instruction-level pass rate over the prompts ``ids`` (only the instructions of
    ``group``, e.g. ``length_constraints``, when given; those need ``instruction_id_list`` in the rows)."""
    passed = total = 0
    for k in ids:
        r = rows[k]
        names = r.get("instruction_id_list") or [None] * len(r["strict"])
        for name, ok in zip(names, r["strict"]):
            if group is None or (name or "").split(":", 1)[0] == group:
                total += 1
                passed += bool(ok)
    return passed / total if total else None


def seed_summary(run_dir: Path) -> dict[str, Any]:
    """One seed's row: the last iteration of ``run_dir`` against its iteration 0.

    Returns:
        ``{run_dir, seed, iteration, prompts, ifeval_prompt_strict: [it0, last], ifeval_prompt_strict_diff,
        ifeval_instruction_strict: [...], ifeval_instruction_strict_diff, gained, lost, mcnemar_p,
        length_constraints_strict: [...], heldout_reward: [...], heldout_diff, heldout_p,
        median_tokens: [...], kl, stage_seconds}`` (fractions in [0, 1]).
    Raises:
        DataError: no metrics, or a missing IFEval result at iteration 0 or the last (names the file).
    """
    from .evaluation import mcnemar_exact

    mpath = run_dir / "metrics.jsonl"
    if not mpath.is_file():
        raise DataError(f"{mpath}: missing; the run has not finished an iteration. Run it (without --table-only).")
    rows = {r["iteration"]: r for r in read_jsonl(mpath)}
    last = max(rows)
    if last == 0:
        raise DataError(f"{mpath}: only iteration 0 is there; the run has not finished a training iteration.")
    base, now = _ifeval_rows(run_dir, 0), _ifeval_rows(run_dir, last)
    common = sorted(set(base) & set(now))
    if not common:
        raise DataError(f"{run_dir}: iteration 0 and {last} scored no IFEval prompt in common.")
    b = [bool(base[k]["prompt_strict"]) for k in common]
    n = [bool(now[k]["prompt_strict"]) for k in common]
    test = mcnemar_exact(b, n)
    ps = [sum(b) / len(b), sum(n) / len(n)]
    ins = [_instruction_rate(base, common), _instruction_rate(now, common)]
    length = [_instruction_rate(base, common, "length_constraints"), _instruction_rate(now, common, "length_constraints")]
    vs0 = rows[last].get("eval_reward_vs_0") or {}
    lc0 = rows[last].get("eval_reward_lc_vs_0") or {}
    kl = (rows[last].get("kl") or {}).get("kl_mean")
    seconds = sum(v or 0.0 for r in rows.values() for v in (r.get("stage_seconds") or {}).values())
    trained = [r.get("pairs", (r.get("grpo") or {}).get("groups_used")) for i, r in rows.items() if i >= 1]
    pairs = None if not trained or None in trained else sum(trained)
    diff_points = 100 * (ps[1] - ps[0])
    return {"run_dir": str(run_dir), "seed": None, "iteration": last, "prompts": len(common),
            "ifeval_prompt_strict": ps, "ifeval_prompt_strict_diff": ps[1] - ps[0],
            "ifeval_instruction_strict": ins, "ifeval_instruction_strict_diff": ins[1] - ins[0],
            "gained": test["new_only"], "lost": test["base_only"], "mcnemar_p": test["p_value"],
            "length_constraints_strict": length,
            "heldout_reward": [rows[0].get("eval_reward_mean"), rows[last].get("eval_reward_mean")],
            "heldout_diff": vs0.get("diff"), "heldout_p": vs0.get("p_value"),
            "heldout_lc_diff": lc0.get("diff"), "heldout_lc_p": lc0.get("p_value"),
            "median_tokens": [rows[0].get("eval_median_response_tokens"), rows[last].get("eval_median_response_tokens")],
            "kl": kl, "stage_seconds": round(seconds, 1), "iteration_0_reused": _iteration_0_reused(run_dir),
            "pairs": pairs,
            "pairs_per_minute": None if pairs is None or not seconds else round(pairs / (seconds / 60), 2),
            "points_per_100_pairs": None if not pairs else round(diff_points / pairs * 100, 3),
            "points_per_stage_hour": None if not seconds else round(diff_points / (seconds / 3600), 3)}


def _iteration_0_reused(run_dir: Path) -> bool:
    """Whether iteration 0's evaluation answers came from the evaluation cache (its stage seconds are
    then not in the run's), read from the ``reused_from`` of its generation stats."""
    from .jsonl import read_json

    for name in ("eval_generated.jsonl.stats.json", "ifeval_generated.jsonl.stats.json"):
        path = run_dir / "iter_0" / name
        if path.is_file() and read_json(path).get("reused_from"):
            return True
    return False


def pooled(summaries: list[dict]) -> dict[str, Any]:
    """Across seeds: mean differences with 95% t-intervals, and one exact binomial test on every
    discordant IFEval prompt of every seed (gained ~ Binomial(gained + lost, 1/2) under no change).

    Returns:
        ``{seeds, ifeval_prompt_strict_diff: {mean, lo, hi}, ifeval_instruction_strict_diff: {...},
        heldout_diff: {...}, gained, lost, exact_p, seeds_up, length_constraints_diff: {...}}``.
    """
    from scipy.stats import binomtest

    def ci(key: str) -> dict:
        xs = [s[key] for s in summaries if s.get(key) is not None]
        m, lo, hi = mean_ci95(xs)
        return {"mean": m, "lo": lo, "hi": hi}

    for s in summaries:
        lc = s["length_constraints_strict"]
        s["length_constraints_diff"] = None if None in lc else lc[1] - lc[0]
    gained, lost = sum(s["gained"] for s in summaries), sum(s["lost"] for s in summaries)
    p = 1.0 if gained + lost == 0 else float(binomtest(gained, gained + lost, 0.5).pvalue)
    return {"seeds": len(summaries), "ifeval_prompt_strict_diff": ci("ifeval_prompt_strict_diff"),
            "ifeval_instruction_strict_diff": ci("ifeval_instruction_strict_diff"), "heldout_diff": ci("heldout_diff"),
            "heldout_lc_diff": ci("heldout_lc_diff"),
            "length_constraints_diff": ci("length_constraints_diff"), "gained": gained, "lost": lost, "exact_p": p,
            "seeds_up": sum(s["ifeval_prompt_strict_diff"] > 0 for s in summaries),
            "stage_seconds": ci("stage_seconds"), "pairs": ci("pairs"), "pairs_per_minute": ci("pairs_per_minute"),
            "points_per_100_pairs": ci("points_per_100_pairs"), "points_per_stage_hour": ci("points_per_stage_hour")}


def _pct(x: Optional[float], signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _num(x: Optional[float], fmt: str = ".3g") -> str:
    return "–" if x is None else format(x, fmt)


def table(summaries: list[dict], pool: dict, title: str) -> str:
    """The markdown of ``seeds.md``: one row per seed, then the pooled row and its tests."""
    lines = [f"# {title}", "",
             "IFEval: all prompts the runs scored, greedy, if-verifiable's checkers as shipped; strict. Δ: last "
             "iteration minus iteration 0 of the same seed (paired). Held-out: the loop's held-out reward "
             "(paired bootstrap p).", "",
             "| seed | it. | IFEval prompt strict 0 → N (Δ) | gained / lost (McNemar p) | instr. strict 0 → N (Δ) | "
             "length_constraints 0 → N | held-out Δ (p) | length-controlled Δ (p) | median tokens 0 → N | KL nats | "
             "stage s | pairs | pairs / min | points / 100 pairs | points / stage-hour |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        ps, ins, lc, mt = s["ifeval_prompt_strict"], s["ifeval_instruction_strict"], s["length_constraints_strict"], s["median_tokens"]
        cached = " (iteration 0 cached)" if s.get("iteration_0_reused") else ""
        lines.append(f"| {s['seed']} | {s['iteration']} | {_pct(ps[0])} → {_pct(ps[1])} ({_pct(s['ifeval_prompt_strict_diff'], True)}) | "
                     f"{s['gained']} / {s['lost']} ({_num(s['mcnemar_p'])}) | {_pct(ins[0])} → {_pct(ins[1])} "
                     f"({_pct(s['ifeval_instruction_strict_diff'], True)}) | {_pct(lc[0])} → {_pct(lc[1])} | "
                     f"{_num(s['heldout_diff'], '+.3f')} ({_num(s['heldout_p'])}) | "
                     f"{_num(s.get('heldout_lc_diff'), '+.3f')} ({_num(s.get('heldout_lc_p'))}) | {mt[0]} → {mt[1]} | "
                     f"{_num(s['kl'], '.2f')} | {s['stage_seconds']:.0f}{cached} | {_num(s.get('pairs'), 'd')} | "
                     f"{_num(s.get('pairs_per_minute'), '.2f')} | {_num(s.get('points_per_100_pairs'), '+.2f')} | "
                     f"{_num(s.get('points_per_stage_hour'), '+.2f')} |")

    def ci(d: dict, scale: float = 100, fmt: str = "+.1f") -> str:
        if d["mean"] is None:
            return "–"
        inner = "" if d["lo"] is None else f" (95% CI {format(scale * d['lo'], fmt)}..{format(scale * d['hi'], fmt)})"
        return format(scale * d["mean"], fmt) + inner

    lines += ["", f"**Pooled over {pool['seeds']} seeds**: IFEval prompt strict Δ {ci(pool['ifeval_prompt_strict_diff'])} "
              f"points; instruction strict Δ {ci(pool['ifeval_instruction_strict_diff'])}; length_constraints strict Δ "
              f"{ci(pool['length_constraints_diff'])}; held-out reward Δ {ci(pool['heldout_diff'], 1, '+.3f')}, "
              f"length-controlled {ci(pool['heldout_lc_diff'], 1, '+.3f')}. Per seed, mean: {ci(pool['pairs'], 1, '.0f')} "
              f"pairs in {ci(pool['stage_seconds'], 1, '.0f')} stage s; {ci(pool['pairs_per_minute'], 1, '.2f')} pairs / min; "
              f"IFEval {ci(pool['points_per_100_pairs'], 1, '+.2f')} points / 100 pairs, "
              f"{ci(pool['points_per_stage_hour'], 1, '+.2f')} points / stage-hour. "
              f"Exact test on all discordant IFEval prompts: {pool['gained']} gained, {pool['lost']} lost, "
              f"p = {pool['exact_p']:.3g}. IFEval up in {pool['seeds_up']} of {pool['seeds']} seeds."]
    return "\n".join(lines) + "\n"


def check_run_config(run_dir: Path, config: str, seed: int, overrides: list[str]) -> None:
    """Check that ``run_dir`` is this recipe's run of ``seed``: its ``config.yaml`` (the loop config it
    was planned with) equals ``config`` resolved with ``seed=S run_name=<dir name>`` and ``overrides``,
    but for where the run lives and what it reports to (:data:`LOCATION_KEYS`).

    Raises:
        DataError: no ``config.yaml``, or a key that differs (names the run, up to five keys with the
            run's value and the recipe's, and the fix).
    """
    import yaml

    from .loop import resolve
    from .loop.plan import run_config_dict
    from .loop.freshness import UNSET, config_differences

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise DataError(f"{path}: missing, so {run_dir.name} cannot be checked against {config}; run the seed "
                        "(without --table-only) or remove the folder.")
    have = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    want = run_config_dict(resolve(config, list(overrides) + [f"seed={seed}", f"run_name={run_dir.name}"]))
    skip = set(LOCATION_KEYS) | {"run_name"}
    from pydantic import BaseModel

    from .loop_config import LoopConfig

    def default(k: str):  # a key newer than the run's config.yaml: its value when the run was planned
        d = LoopConfig.model_fields[k].get_default(call_default_factory=True)
        return d.model_dump(mode="json", exclude_unset=True) if isinstance(d, BaseModel) else d

    diff = sorted(k for k in set(have) | set(want) if k not in skip and have.get(k) != want.get(k)
                  and not (k not in have and k in LoopConfig.model_fields and want.get(k) == default(k)))
    if diff:
        leaves = config_differences({k: have.get(k) for k in diff}, {k: want.get(k) for k in diff})
        shown = "; ".join(f"{k}: run {None if a is UNSET else a!r}, recipe {None if b is UNSET else b!r}"
                          for k, a, b in leaves[:5])
        raise DataError(f"{path}: this run was planned with other settings than {config} "
                        f"{' '.join(overrides + [f'seed={seed}'])} ({len(leaves)} key(s) differ: {shown}); its "
                        "results are not this recipe's. Run the seeds command without --table-only to replan and "
                        "rerun what changed, or give the overrides the run was made with.")


def _as_run_loop_takes(override: str) -> str:
    """``key=value`` with a relative path made absolute as ``run_loop.sh`` makes it (the keys of
    :data:`online_rlhf.loop_config.PATH_KEYS`, also under ``per_iteration.<i>.``; ``output_root=``
    always), so that the run's
    ``config.yaml`` and the recipe resolved here (:func:`check_run_config`) hold the same path."""
    import re

    key, _, val = override.partition("=")
    leaf = re.sub(r"^per_iteration\.\d+\.", "", key.strip())
    if Path(val).is_absolute():
        return override
    if leaf == "output_root" and key.strip() == "output_root":
        return f"{key}={Path.cwd() / val}"
    if leaf in PATH_KEYS and val and (Path.cwd() / val).exists():
        return f"{key}={Path.cwd() / val}"
    return override


def run_seed(config: str, seed: int, base: str, overrides: list[str]) -> float:
    """Run one seed with ``bash run_loop.sh`` (output streamed); returns its wall seconds.

    Raises:
        RuntimeError: the run failed (names the seed, the exit code and how to resume).
    """
    cmd = ["bash", str(PROJECT_ROOT / "run_loop.sh"), config, f"seed={seed}", f"run_name={run_name_of(base, seed)}",
           *overrides]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd)
    if rc != 0:
        raise RuntimeError(f"seed {seed}: run_loop.sh exited {rc}; fix the cause and rerun the same command "
                           "(finished seeds and stages are skipped).")
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m online_rlhf.seeds", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)  # --seed is not --seeds
    ap.add_argument("config", help="the recipe's loop YAML (e.g. configs/if_dpo.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every seed (not seed= or run_name=); a "
                    "recipe with overrides gets its own run names: <run_name>_<hash of the overrides>_seed<S>")
    ap.add_argument("--seeds", nargs="+", default=["1", "2", "3"], help="seeds to run (default 1 2 3)")
    ap.add_argument("--table-only", action="store_true", help="run nothing; tabulate the given seeds' finished runs "
                    "into <run_name>_seeds/seeds.md and seeds.json (replacing the table there)")
    args, rest = ap.parse_known_args(argv)
    # key=value words given after --seeds or after --table-only are overrides too
    extra = [w for w in rest if "=" in w and not w.startswith("-")]
    if len(extra) != len(rest):
        ap.error(f"unrecognized arguments: {' '.join(w for w in rest if w not in extra)} (the options are "
                 "--seeds and --table-only; settings are key=value)")
    args.overrides += [w for w in args.seeds if "=" in w] + extra
    try:
        bad = [w for w in args.seeds if "=" not in w and not w.lstrip("-").isdigit()]
        if bad:
            raise ConfigError(f"--seeds {' '.join(bad)}: seeds are whole numbers.")
        args.seeds = [int(w) for w in args.seeds if "=" not in w]
        from .loop import resolve

        for o in args.overrides:
            if "=" not in o:
                raise ConfigError(f"{o!r}: overrides are key=value.")
            if o.split("=", 1)[0] in ("seed", "run_name"):
                raise ConfigError(f"{o}: the seeds command sets seed= and run_name= itself (one run per --seeds value).")
        if not Path(args.config).is_file() and not (PROJECT_ROOT / args.config).is_file():
            raise ConfigError(f"{args.config}: no such recipe file (give the loop YAML, e.g. configs/if_dpo.yaml).")
        if len(set(args.seeds)) != len(args.seeds):
            raise ConfigError(f"--seeds {' '.join(map(str, args.seeds))}: a seed is given twice.")
        from .stage_configs import SEED_MAX

        if any(not 0 <= s <= SEED_MAX for s in args.seeds):
            raise ConfigError(f"--seeds {' '.join(map(str, args.seeds))}: a seed is a whole number from 0 to {SEED_MAX} "
                              "(numpy, which vLLM and transformers seed, refuses negative seeds).")
        # paths as run_loop.sh takes them: the config from here (else the project root), output_root=
        # from here; the config file's own output_root from the project root
        if not Path(args.config).is_file() and (PROJECT_ROOT / args.config).is_file():
            args.config = str(PROJECT_ROOT / args.config)
        given = list(args.overrides)  # the recipe's name is the overrides as written, wherever it runs from
        args.overrides = [_as_run_loop_takes(o) for o in args.overrides]
        cfg = resolve(args.config, args.overrides)
        root = Path(cfg.output_root) if Path(cfg.output_root).is_absolute() else PROJECT_ROOT / cfg.output_root
        name = recipe_name(cfg.run_name, given)
        walls: dict[int, float] = {}
        if not args.table_only:
            for s in args.seeds:
                walls[s] = run_seed(args.config, s, name, args.overrides)
        summaries, problems = [], []
        for s in args.seeds:  # every seed's problem at once, not only the first
            run = root / run_name_of(name, s)
            try:
                if (run / ".lock").is_file() and not (run / "report.md").is_file():
                    raise DataError(f"{run}: seed {s} has not finished (no report.md yet); wait for it or run it, "
                                    "then tabulate again.")
                row = seed_summary(run)
                check_run_config(run, args.config, s, args.overrides)
            except (DataError, FileNotFoundError) as e:
                problems.append(str(e))
                continue
            row["seed"] = s
            row["wall_s"] = round(walls[s], 1) if s in walls else None
            summaries.append(row)
        if problems:
            raise DataError("\n".join(problems) if len(problems) == 1 else
                            f"{len(problems)} of {len(args.seeds)} seeds cannot be tabulated:\n  " + "\n  ".join(problems))
    except (ConfigError, DataError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pool = pooled(summaries)
    out = root / f"{name}_seeds"
    title = f"{name}: {len(summaries)} seeds ({args.config}{' ' + ' '.join(args.overrides) if args.overrides else ''})"
    text = table(summaries, pool, title)
    out.mkdir(parents=True, exist_ok=True)
    from .jsonl import atomic_open

    with atomic_open(out / "seeds.md") as f:
        f.write(text)
    write_json(out / "seeds.json", {"config": args.config, "overrides": args.overrides, "seeds": summaries, "pooled": pool})
    print(text)
    print(f"wrote {out / 'seeds.md'} and {out / 'seeds.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
