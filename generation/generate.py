"""Generation stage, one shard: K sampled responses per prompt from the policy, with vLLM.

    .venv-infer/bin/python generation/generate.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated/shard_00.jsonl shard_index=0 num_shards=1 k=4 ...

Entry point only: the stage lives in ``online_rlhf/stages/generate.py`` (its docstring has the
details; ``python -m online_rlhf.stages.generate`` runs the same).
"""

from online_rlhf.stages.generate import cli

if __name__ == "__main__":
    cli()
