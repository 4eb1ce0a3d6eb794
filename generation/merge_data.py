"""Merge the W shard files of the generation stage into one ``generated.jsonl`` (+ one stats JSON).

    .venv-infer/bin/python generation/merge_data.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated.jsonl num_shards=W [shards_dir=runs/x/iter_1/generated]

Entry point only: the stage lives in ``online_rlhf/stages/merge_data.py`` (its docstring has the
details; ``python -m online_rlhf.stages.merge_data`` runs the same).
"""

from online_rlhf.stages.merge_data import cli

if __name__ == "__main__":
    cli()
