"""SFT stage: supervised fine-tuning with Axolotl, run once before the loop; saves an HF checkpoint.

    .venv-train/bin/python sft/run_sft.py --config configs/sft.yaml \
        base_model=default dataset=runs/x/sft/data.jsonl output_dir=runs/x/sft/model

Entry point only: the stage lives in ``online_rlhf/stages/run_sft.py`` (its docstring has the
details; ``python -m online_rlhf.stages.run_sft`` runs the same).
"""

from online_rlhf.stages.run_sft import cli

if __name__ == "__main__":
    cli()
