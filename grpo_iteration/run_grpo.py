"""GRPO stage: group-relative policy optimization of the policy on rewards.jsonl (K scored responses
per prompt); saves an HF checkpoint.

    accelerate launch --config_file configs/accelerate/cpu.yaml grpo_iteration/run_grpo.py \
        --config configs/grpo.yaml policy=default rewards=runs/x/iter_1/rewards.jsonl output_dir=runs/x/iter_1/model

Entry point only: the stage lives in ``online_rlhf/stages/run_grpo.py`` (its docstring has the
details; ``python -m online_rlhf.stages.run_grpo`` runs the same).
"""

from online_rlhf.stages.run_grpo import cli

if __name__ == "__main__":
    cli()
