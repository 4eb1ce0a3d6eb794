"""Stage: rewards.jsonl -> pairs.jsonl (chosen/rejected per prompt) + stats JSON.

    python annotate_data/make_pairs.py input=runs/x/iter_1/rewards.jsonl output=runs/x/iter_1/pairs.jsonl \
        [strategy=max_min|max_random|random] [min_margin=0.0] [truncated=exclude|keep|penalize] \
        [truncated_penalty=1.0] [seed=42] [--config FILE]

Entry point only: the stage lives in ``online_rlhf/stages/make_pairs.py`` (its docstring has the
details; ``python -m online_rlhf.stages.make_pairs`` runs the same).
"""

from online_rlhf.stages.make_pairs import cli

if __name__ == "__main__":
    cli()
