"""Stage: rewards.jsonl -> pairs.jsonl (chosen/rejected per prompt) + stats JSON.

    python annotate_data/make_pairs.py input=runs/x/iter_1/rewards.jsonl output=runs/x/iter_1/pairs.jsonl \
        [strategy=max_min|max_random|random|best_vs_rest|all_pairs] [min_margin=0.0] [max_pairs_per_prompt=N] [truncated=exclude|keep|penalize] \
        [truncated_penalty=1.0] [seed=42] [--config FILE]

Reads rewards records ``{id, prompt, responses: [K], finish_reasons: [K], rewards: [K], ...}``;
writes pairs ``{id, prompt, chosen: [assistant message], rejected: [assistant message],
chosen_reward, rejected_reward}``, TRL's conversational preference format (DPOTrainer loads it
as is). Every skipped prompt and dropped response is counted in the stats by reason, with example
records per reason (see ``online_rlhf/pairs.py``); a ``null`` reward (unscored response) is left
out and counted. A NaN/inf reward stops the stage with the record named. When most prompts have
fewer than 2 distinct responses, or no pair comes out of a non-empty input, the stage warns
(stderr and ``warnings`` in the stats; the latter names the skip reasons and what to change).
"""

from __future__ import annotations

import sys
import time


from online_rlhf.config import run_main
from online_rlhf.jsonl import DataError, iter_jsonl, write_jsonl
from online_rlhf.pairs import build_pairs
from online_rlhf.paths import setup_cache_env
from online_rlhf.stage_configs import PairsConfig
from online_rlhf.stats import PairsStats, stats_path


def main(cfg: PairsConfig) -> PairsStats:
    """Build the pairs of ``cfg.input`` into ``cfg.output`` and write the stats
    (:class:`~online_rlhf.stats.PairsStats`) to ``<output>.stats.json``; returns them.
    Warnings (e.g. most prompts have fewer than 2 distinct responses) go to stderr and the stats.

    Raises:
        DataError: a malformed record, a NaN/inf or non-number reward, or an id seen twice; or no pair
            at all (after writing the empty output and the stats: why, and which keys to change).
    """
    setup_cache_env()
    t0 = time.time()
    lines = iter_jsonl(cfg.input)
    records = ((f"{cfg.input}:{ln}", rec) for ln, rec in lines)
    pairs, stats = build_pairs(records, strategy=cfg.strategy, min_margin=cfg.min_margin, truncated=cfg.truncated,
                               truncated_penalty=cfg.truncated_penalty, seed=cfg.seed,
                               max_pairs_per_prompt=cfg.max_pairs_per_prompt)
    # the loop's stage YAML holds every key, so "set" means "not the default" here
    if cfg.truncated_penalty != type(cfg).model_fields["truncated_penalty"].default and cfg.truncated != "penalize":
        stats["warnings"].append(f"truncated_penalty={cfg.truncated_penalty} is not used with truncated={cfg.truncated} "
                                 "(only truncated=penalize subtracts it)")
    write_jsonl(cfg.output, pairs)
    stats = PairsStats(stage="make_pairs", input=cfg.input, output=cfg.output, **stats,
                       seconds=round(time.time() - t0, 3), input_blank_lines=lines.blank_lines)
    stats.write(stats_path(cfg.output))
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(stats.skipped.items())) or "none"
    per = f" from {stats.prompts_with_pairs} prompts" if stats.pairs_out != stats.prompts_with_pairs else ""
    print(f"make_pairs: {stats.records_in} prompts -> {stats.pairs_out} pairs{per} (skipped: {skipped}) -> {cfg.output}")
    for w in stats.warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    if stats.pairs_out == 0:  # an empty result is a failure (exit 2), not a success DPO then trips over
        causes, fixes = stats.no_pair_causes()
        why = "; ".join(causes) if stats.records_in else "the rewards file has no records"
        fix = "; ".join(fixes) if stats.records_in else "more train prompts (prompts_per_iteration, train_prompts)"
        raise DataError(f"{cfg.input}: 0 pairs from {stats.records_in} prompts (written: {cfg.output} and its stats "
                        f"{stats_path(cfg.output)}). Why: {why or 'see skipped_examples in the stats'}. Change: "
                        f"{fix or 'see skipped_examples in the stats'}.")
    return stats


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(main, PairsConfig)


if __name__ == "__main__":
    cli()
