"""Stage: IFEval's four scores (prompt/instruction level, strict/loose) of generated records.

    python annotate_data/ifeval_score.py input=ifeval_generated.jsonl output=ifeval.jsonl

The recipe is ``main`` of online_rlhf/stages/ifeval_score.py (its docstring has the details), in
this order, and where each step's work lives:

    load_generated(cfg.input)  1. the generated records (online_rlhf/stages/get_rewards.py)
    score_records(records)     2. each prompt's instructions, strict and loose (online_rlhf/verifiers.py)
    ifeval_scores(...)         3. IFEval's four scores and the instruction groups (online_rlhf/evaluation.py)
    IFEvalStats(...)           4. ifeval.jsonl's stats (online_rlhf/stats.py)
"""

from online_rlhf.stages.ifeval_score import cli

if __name__ == "__main__":
    cli()
