"""Stage: score every response of generated.jsonl -> rewards.jsonl (+ stats JSON).

    python annotate_data/get_rewards.py input=generated.jsonl output=rewards.jsonl source=verifier
    python annotate_data/get_rewards.py --config cfg.yaml source=reward_model reward_model=DIR batch_size=16
    # reward model, data-parallel on N processes (GPUs; on CPU add ACCELERATE_USE_CPU=true and --multi_gpu):
    accelerate launch --num_processes N annotate_data/get_rewards.py source=reward_model reward_model=DIR ...
    python annotate_data/get_rewards.py source=remote url=http://127.0.0.1:8000 ...    # annotate_data/reward_server.py
    python annotate_data/get_rewards.py source=judge url=http://127.0.0.1:8001/v1 judge_model=NAME ...

The recipe is ``main`` of online_rlhf/stages/get_rewards.py (its docstring has the details;
``python -m online_rlhf.stages.get_rewards`` runs the same), in this order, and where each step's work
lives:

    dry_run(cfg)               dry_run=true, instead: one max-length batch of the reward model
    construct(cfg)             1. the environment and the process-count check
    read_input(cfg)            2. the generated records and what of them can be scored
    ...                        3. score them with the source's module (SOURCES: online_rlhf/reward_model.py,
                                  online_rlhf/verifiers.py, online_rlhf/remote.py, online_rlhf/judge.py)
    collect(cfg, ...)          4. rewards and reward_source on each record; the unscored by cause
    write_stats(cfg, ...)      5. rewards.jsonl's stats and the summary line (online_rlhf/stats.py: RewardStats)
"""

from online_rlhf.stages.get_rewards import cli

if __name__ == "__main__":
    cli()
