"""Rejection-sampling SFT data (RAFT): for each prompt, the best scored response, if good enough.

    .venv-train/bin/python sft/build_sft_data.py rewards=runs/x/iter_1/rewards.jsonl \
        output=runs/x/sft/data.jsonl min_reward=1.0

Entry point only: the stage lives in ``online_rlhf/stages/build_sft_data.py`` (its docstring has the
details; ``python -m online_rlhf.stages.build_sft_data`` runs the same).
"""

from online_rlhf.stages.build_sft_data import cli

if __name__ == "__main__":
    cli()
