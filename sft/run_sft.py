"""SFT stage: supervised fine-tuning with Axolotl, run once before the loop; saves an HF checkpoint.

    .venv-train/bin/python sft/run_sft.py --config configs/sft.yaml \
        base_model=default dataset=runs/x/sft/data.jsonl output_dir=runs/x/sft/model

The recipe is ``main`` of online_rlhf/stages/run_sft.py (its docstring has the details;
``python -m online_rlhf.stages.run_sft`` runs the same): one function a step, in this order, and where
each step's work lives:

    dry_run(cfg)               dry_run=true, instead: one step with transformers at Axolotl's shapes
    construct(cfg)             1. validate: the Axolotl keys against its schema, every row of the data set
                                  (online_rlhf/sft_dataset.py, online_rlhf/trl_args.py)
    setup(run)                 2. the base model's tokens, then the resolved Axolotl config
                                  (online_rlhf/stages/sft_axolotl_config.py)
    write_axolotl_config(...)     <output_dir>.axolotl.yaml
    train(run)                 3. Axolotl trains into <output_dir>.tmp (online_rlhf/stages/axolotl_train.py)
    save(run, ax, eos)         4. a clean HF checkpoint, renamed to <output_dir>
    write_stats(run, ...)      5. <output_dir>.stats.json and the summary line (online_rlhf/stats.py: SFTStats)
"""

from online_rlhf.stages.run_sft import cli

if __name__ == "__main__":
    cli()
