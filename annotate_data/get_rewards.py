"""Stage: score every response of generated.jsonl -> rewards.jsonl (+ stats JSON).

    python annotate_data/get_rewards.py input=generated.jsonl output=rewards.jsonl source=verifier
    python annotate_data/get_rewards.py --config cfg.yaml source=reward_model reward_model=DIR batch_size=16
    # reward model, data-parallel on N processes (GPUs; on CPU add ACCELERATE_USE_CPU=true and --multi_gpu):
    accelerate launch --num_processes N annotate_data/get_rewards.py source=reward_model reward_model=DIR ...
    python annotate_data/get_rewards.py source=remote url=http://127.0.0.1:8000 ...    # annotate_data/reward_server.py
    python annotate_data/get_rewards.py source=judge url=http://127.0.0.1:8001/v1 judge_model=NAME ...

Entry point only: the stage lives in ``online_rlhf/stages/get_rewards.py`` (its docstring has the
details; ``python -m online_rlhf.stages.get_rewards`` runs the same).
"""

from online_rlhf.stages.get_rewards import cli

if __name__ == "__main__":
    cli()
