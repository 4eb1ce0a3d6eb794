"""DPO stage: train the policy on pairs.jsonl with TRL's DPOTrainer and save an HF checkpoint.

    accelerate launch --config_file configs/accelerate/cpu.yaml dpo_iteration/run_dpo.py \
        --config configs/dpo.yaml policy=default pairs=runs/x/iter_1/pairs.jsonl output_dir=runs/x/iter_1/model

Entry point only: the stage lives in ``online_rlhf/stages/run_dpo.py`` (its docstring has the
details; ``python -m online_rlhf.stages.run_dpo`` runs the same).
"""

from online_rlhf.stages.run_dpo import cli

if __name__ == "__main__":
    cli()
