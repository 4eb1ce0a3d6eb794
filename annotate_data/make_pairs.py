"""Stage: rewards.jsonl -> pairs.jsonl (chosen/rejected per prompt) + stats JSON.

    python annotate_data/make_pairs.py input=runs/x/iter_1/rewards.jsonl output=runs/x/iter_1/pairs.jsonl \
        [strategy=max_min|max_random|random] [min_margin=0.0] [truncated=exclude|keep|penalize] \
        [truncated_penalty=1.0] [seed=42] [--config FILE]

The recipe is ``main`` of online_rlhf/stages/make_pairs.py (its docstring has the details;
``python -m online_rlhf.stages.make_pairs`` runs the same), in this order, and where each step's work
lives:

    build_pairs(records, ...)  1. each prompt's chosen and rejected by the pair rule (online_rlhf/pairs.py)
    write_jsonl(...)           2. pairs.jsonl, atomically (online_rlhf/jsonl.py)
    PairsStats(...)            3. its stats, then 0 pairs is an error naming why (online_rlhf/stats.py)
"""

from online_rlhf.stages.make_pairs import cli

if __name__ == "__main__":
    cli()
