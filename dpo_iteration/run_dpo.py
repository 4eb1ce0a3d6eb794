"""DPO stage: train the policy on pairs.jsonl with TRL's DPOTrainer and save an HF checkpoint.

    accelerate launch --config_file configs/accelerate/cpu.yaml dpo_iteration/run_dpo.py \
        --config configs/dpo.yaml policy=default pairs=runs/x/iter_1/pairs.jsonl output_dir=runs/x/iter_1/model

The recipe is ``main`` of online_rlhf/stages/run_dpo.py (its docstring has the details;
``python -m online_rlhf.stages.run_dpo`` runs the same): one function a step, in this order, and where
each step's work lives:

    dry_run(cfg)               dry_run=true, instead of 1-6: the set-up, one optimizer step at max_length
    construct(cfg)             1. validate before a weight loads: trl.DPOConfig, LoRA, dtypes, process count
                                  (online_rlhf/dpo_config.py; the load dtypes: online_rlhf/stages/dpo_trainer.py)
    setup_data(run)            2. build the pairs: read, tokenize with the chat template, drop what cannot train
                                  (online_rlhf/stages/dpo_data.py)
    setup(run, data)           3. load policy and reference, build TRL's DPOTrainer on the stage's token ids
                                  (online_rlhf/stages/dpo_trainer.py)
    train(trainer)             4. train: the log-probs (online_rlhf/completion_logps.py) and the loss of each
                                  loss_type (online_rlhf/dpo_loss.py)
    save(run, trainer, ...)    5. save <output_dir> atomically, LoRA merged, the input's tokens kept
                                  (online_rlhf/stages/dpo_trainer.py, online_rlhf/checkpoint.py)
    write_stats(run, ...)      6. <output_dir>.stats.json and the summary line (online_rlhf/stats.py: DPOStats)
"""

from online_rlhf.stages.run_dpo import cli

if __name__ == "__main__":
    cli()
