"""Run the generation stage as W shard processes, then merge them into one ``generated.jsonl``.

    .venv-infer/bin/python generation/launch.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated.jsonl num_shards=W [shards_dir=runs/x/iter_1/generated] ...

Entry point only: the stage lives in ``online_rlhf/stages/launch.py`` (its docstring has the
details; ``python -m online_rlhf.stages.launch`` runs the same).
"""

from online_rlhf.stages.launch import cli

if __name__ == "__main__":
    cli()
