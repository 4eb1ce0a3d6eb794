"""GRPO stage: group-relative policy optimization of the policy on rewards.jsonl (K scored responses
per prompt); saves an HF checkpoint.

    accelerate launch --config_file configs/accelerate/cpu.yaml grpo_iteration/run_grpo.py \
        --config configs/grpo.yaml policy=default rewards=runs/x/iter_1/rewards.jsonl output_dir=runs/x/iter_1/model

The recipe is ``main`` of online_rlhf/stages/run_grpo.py (its docstring has the details;
``python -m online_rlhf.stages.run_grpo`` runs the same): one function a step, in this order, and where
each step's work lives:

    dry_run(cfg)               dry_run=true, instead: the set-up, one optimizer step on max_length completions
    construct(cfg)             1. the environment and the process-count check, before anything is read
    setup_data(cfg)            2. the groups, their advantages and the completions' token ids
                                  (online_rlhf/stages/grpo_data.py)
    setup(cfg, data, on_gpu)   3. the models, then the old (and reference) log-probs before any update
                                  (online_rlhf/stages/grpo_objective.py, online_rlhf/stages/dpo_trainer.py)
    train(cfg, ...)            4. the passes over the completions: the clipped objective and the KL term
                                  (online_rlhf/stages/grpo_objective.py)
    data_warnings(...)            what the groups could not train on (online_rlhf/stages/grpo_data.py)
    save(...)                  5. save <output_dir> atomically (online_rlhf/checkpoint.py)
    write_stats(cfg, ...)      6. <output_dir>.stats.json and the summary line (online_rlhf/stats.py: GRPOStats)
"""

from online_rlhf.stages.run_grpo import cli

if __name__ == "__main__":
    cli()
