"""Stage: IFEval's four scores (prompt/instruction level, strict/loose) of generated records.

    python annotate_data/ifeval_score.py input=ifeval_generated.jsonl output=ifeval.jsonl

Entry point only: the stage lives in ``online_rlhf/stages/ifeval_score.py``.
"""

from online_rlhf.stages.ifeval_score import cli

if __name__ == "__main__":
    cli()
