"""Stage: IFEval's four scores of one greedy response per prompt -> ifeval.jsonl (+ stats JSON).

    python annotate_data/ifeval_score.py input=iter_0/ifeval_generated.jsonl output=iter_0/ifeval.jsonl

1. read the generated records (``online_rlhf.stages.get_rewards.load_generated``: checked, ids unique);
2. check each record's first response against each of its instructions with the ``if-verifiable``
   checkers (``online_rlhf.verifiers.ifeval_instruction_results``), strict and loose;
3. write one outcome per prompt ``{id, instruction_id_list, strict: [bool per instruction], loose:
   [...], prompt_strict, prompt_loose, response_tokens, finish_reason}`` and the stats
   (:class:`~online_rlhf.stats.IFEvalStats`): prompt-level and instruction-level accuracy, strict
   and loose (``online_rlhf.evaluation.ifeval_scores``; Zhou et al. 2023, arXiv 2311.07911), and
   the instruction-level rates per instruction group (``groups``, e.g. ``length_constraints``).

A record the checkers cannot score (e.g. ``checker_error:LookupError`` when NLTK data is missing)
is left out of the scores and counted by reason in ``skipped`` with up to 5 ids. A record whose
checker draws an argument at random is the benchmark as shipped (IFEval 1122 and 1129: letter ``#``
and ``!``, which its checker reads as no letter): it is scored, the draw taken from the record's
own seed, and listed in ``arguments_drawn``. Config:
``IFEvalScoreConfig`` (online_rlhf/stage_configs.py).
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from online_rlhf.config import run_main
from online_rlhf.evaluation import ifeval_scores, instruction_groups
from online_rlhf.jsonl import DataError, write_jsonl
from online_rlhf.paths import setup_cache_env
from online_rlhf.stage_configs import IFEvalScoreConfig
from online_rlhf.stages.get_rewards import load_generated
from online_rlhf.stats import IFEvalStats, stats_path

MAX_EXAMPLES = 5


def score_records(records: list[dict]) -> tuple[list[dict], Counter, dict[str, list[str]], dict[str, str]]:
    """Per-prompt IFEval outcomes of the first response of each record.

    Returns:
        ``(outcomes, skipped by reason, reason -> up to 5 ids, scored records whose checker draws an
        argument: id -> "instruction id: arguments")``.
    """
    from online_rlhf.verifiers import Unscorable, drawn_arguments, drawn_text, ifeval_instruction_results

    out, skipped, examples, drawn = [], Counter(), {}, {}
    for rec in records:
        try:
            if not rec["responses"]:
                raise Unscorable("no_responses")
            strict, loose = ifeval_instruction_results(rec, rec["responses"][0])
            if d := drawn_arguments(rec):
                drawn[str(rec["id"])] = drawn_text(d)
        except Unscorable as e:
            skipped[e.reason] += 1
            ids = examples.setdefault(e.reason, [])
            if len(ids) < MAX_EXAMPLES:
                ids.append(str(rec["id"]))
            continue
        tokens = rec.get("response_tokens") or [None]
        out.append({"id": rec["id"], "instruction_id_list": list(rec["instruction_id_list"]), "strict": strict, "loose": loose, "prompt_strict": all(strict),
                    "prompt_loose": all(loose), "response_tokens": tokens[0], "finish_reason": rec["finish_reasons"][0]})
    return out, skipped, examples, drawn


def main(cfg: IFEvalScoreConfig) -> IFEvalStats:
    """Score ``cfg.input`` into ``cfg.output`` and write the stats to ``<output>.stats.json``.

    Raises:
        DataError: a malformed input record, a record with more than one response, or records none of
            which could be scored.
    """
    setup_cache_env()
    t0 = time.time()
    records = load_generated(cfg.input)
    many = [r for r in records if len(r["responses"]) > 1]
    if many:  # IFEval is one greedy answer per prompt: scoring the first of K would hide the rest
        raise DataError(f"{cfg.input}: {len(many)} record(s) hold more than one response (the first, id "
                        f"{many[0]['id']!r}, has {len(many[0]['responses'])}); IFEval scores one greedy answer per "
                        "prompt. Generate with k=1 and temperature 0 (as the loop's ifeval_generate does), or score "
                        "K samples per prompt with annotate_data/get_rewards.py source=verifier.")
    out, skipped, examples, drawn = score_records(records)
    if records and not out:
        raise DataError(f"{cfg.input}: no record could be scored by the IFEval checkers (skipped: {dict(skipped)}; "
                        f"e.g. {examples}). Check that the prompts carry instruction_id_list and kwargs.")
    write_jsonl(cfg.output, out)
    scores = ifeval_scores([r["strict"] for r in out], [r["loose"] for r in out])
    tokens = [r["response_tokens"] for r in out if r["response_tokens"] is not None]
    stats = IFEvalStats(
        stage="ifeval_score", input=cfg.input, output=cfg.output, records_in=len(records), records_scored=len(out),
        skipped=dict(skipped), skipped_ids=examples, instructions=sum(len(r["strict"]) for r in out), **scores,
        mean_response_tokens=round(sum(tokens) / len(tokens), 2) if tokens else None,
        truncation_rate=round(sum(r["finish_reason"] == "length" for r in out) / len(out), 4) if out else None,
        groups={g: {k: round(v, 6) for k, v in d.items()} for g, d in instruction_groups(
            [r["instruction_id_list"] for r in out], [r["strict"] for r in out], [r["loose"] for r in out]).items()},
        arguments_drawn=drawn, seconds=round(time.time() - t0, 2))
    stats.write(stats_path(cfg.output))
    fmt = {k: None if v is None else round(100 * v, 1) for k, v in scores.items()}
    print(f"ifeval_score: {len(out)}/{len(records)} prompts scored (skipped {dict(skipped) or 0}): {fmt} -> {cfg.output}",
          file=sys.stderr)
    return stats


def cli() -> None:
    """Command-line entry point (annotate_data/ifeval_score.py calls this)."""
    run_main(main, IFEvalScoreConfig)


if __name__ == "__main__":
    cli()
