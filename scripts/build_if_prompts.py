"""Instruction-following training prompts: 1..N IFEval constraints per prompt (Tulu 3's recipe).

    .venv-train/bin/python scripts/build_if_prompts.py input=my_prompts.jsonl output=if_prompts.jsonl
    .venv-train/bin/python scripts/build_if_prompts.py output=if_prompts.jsonl n=1200 max_constraints=2
    .venv-train/bin/python scripts/build_if_prompts.py -h      # every key with its default

Entry point only: the builder lives in ``online_rlhf/if_prompts.py``.
"""

from online_rlhf.if_prompts import cli

if __name__ == "__main__":
    cli()
