"""Rejection-sampling SFT data (RAFT): for each prompt, the best scored response, if good enough.

    .venv-train/bin/python sft/build_sft_data.py rewards=runs/x/iter_1/rewards.jsonl \
        output=runs/x/sft/data.jsonl min_reward=1.0

Recipe: RAFT (Dong et al., 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model
Alignment"): sample K responses per prompt, rank them by reward, fine-tune on the best one. Here a
prompt is kept when its best eligible response has ``reward >= min_reward``.

Reads one rewards file (generated records + ``rewards``, docs/run-directory.md), writes one SFT JSONL
in the conversational format sft/run_sft.py and Axolotl's ``chat_template`` loader read:

    {"id": ..., "messages": [...prompt, {"role": "assistant", "content": best}], "reward": r}

and ``<output>.stats.json``: prompts in, kept, dropped by reason (``no_eligible_response``,
``below_min_reward``; up to 5 example records each in ``dropped_examples``), responses excluded
by reason (``empty``, ``unscored``: reward ``null``, ``truncated``), reward of the kept
responses. Ties for the best reward go to the first such response (sampling order).
Responses are copied as text; sft/run_sft.py counts (and warns about) rows holding special-token
strings such as ``<|im_end|>``, which Axolotl tokenizes as special tokens.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter


from online_rlhf.config import run_main
from online_rlhf.jsonl import DataError, iter_jsonl, write_jsonl
from online_rlhf.records import validate_rewards
from online_rlhf.stage_configs import SFTDataConfig
from online_rlhf.stats import SFTDataStats, stats_path

MAX_EXAMPLES = 5  # example records kept per drop reason in the stats


def best_response(rec: dict, rewards: list[float | None], truncated: str, excluded: Counter) -> tuple[int, float] | None:
    """Index and reward of the best eligible response of one record, or None when none is eligible.

    Eligible: non-empty after stripping whitespace, scored (reward not ``None``), and not cut at
    max_tokens (``finish_reason == 'length'``) unless ``truncated == 'keep'``. Each excluded
    response is counted in ``excluded`` (``empty``, ``unscored``, ``truncated``).
    Ties: the lowest index wins.
    """
    best = None
    for j, (text, reason, r) in enumerate(zip(rec["responses"], rec["finish_reasons"], rewards)):
        if not text.strip():
            excluded["empty"] += 1
            continue
        if r is None:
            excluded["unscored"] += 1
            continue
        if reason == "length" and truncated == "exclude":
            excluded["truncated"] += 1
            continue
        if best is None or r > best[1]:
            best = (j, r)
    return best


def main(cfg: SFTDataConfig) -> SFTDataStats:
    """Write the SFT rows of ``cfg.rewards`` to ``cfg.output`` and the stats
    (:class:`~online_rlhf.stats.SFTDataStats`) to ``<output>.stats.json``; returns them.

    Raises:
        DataError: a malformed record, a NaN/inf reward, a duplicate id, or an empty rewards file.
    """
    out_rows, dropped, excluded, examples = [], Counter(), Counter(), {}
    prompts_in = 0
    seen: dict = {}
    lines = iter_jsonl(cfg.rewards)
    for lineno, rec in lines:
        where = f"{cfg.rewards}:{lineno}"
        rewards = validate_rewards(rec, where)
        if rec["id"] in seen:
            raise DataError(f"{where}: duplicate id {rec['id']!r} (first at line {seen[rec['id']]}).")
        seen[rec["id"]] = lineno
        prompts_in += 1
        best = best_response(rec, rewards, cfg.truncated, excluded)
        reason = "no_eligible_response" if best is None else "below_min_reward" if best[1] < cfg.min_reward else None
        if reason:
            dropped[reason] += 1
            if len(examples.setdefault(reason, [])) < MAX_EXAMPLES:
                examples[reason].append(f"{where} (id={rec['id']!r})")
            continue
        j, r = best
        messages = [{"role": m["role"], "content": m["content"]} for m in rec["prompt"]]
        out_rows.append({"id": rec["id"], "messages": [*messages, {"role": "assistant", "content": rec["responses"][j]}],
                         "reward": r})
    if prompts_in == 0:
        raise DataError(f"{cfg.rewards}: no records.")
    write_jsonl(cfg.output, out_rows)
    kept_rewards = [row["reward"] for row in out_rows]
    stats = SFTDataStats(stage="build_sft_data", rewards=str(cfg.rewards), output=str(cfg.output),
                         min_reward=cfg.min_reward, truncated=cfg.truncated, prompts_in=prompts_in,
                         kept=len(out_rows), dropped=dict(dropped), dropped_examples=examples,
                         responses_excluded=dict(excluded),
                         kept_reward_mean=statistics.fmean(kept_rewards) if kept_rewards else None,
                         input_blank_lines=lines.blank_lines)
    stats.write(stats_path(cfg.output))
    print(f"[build_sft_data] {len(out_rows)}/{prompts_in} prompts kept -> {cfg.output}; dropped {dict(dropped)}; "
          f"responses excluded {dict(excluded)}")
    if not out_rows:
        print(f"warning: no prompt reached min_reward={cfg.min_reward}; {cfg.output} is empty and run_sft.py will refuse it. "
              "Lower min_reward or sample more responses per prompt.", file=sys.stderr)
    return stats


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(main, SFTDataConfig)


if __name__ == "__main__":
    cli()
