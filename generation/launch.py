"""Run the generation stage as W shard processes, then merge them into one ``generated.jsonl``.

    .venv-infer/bin/python generation/launch.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated.jsonl num_shards=W [shards_dir=runs/x/iter_1/generated] ...

The recipe is ``main`` of online_rlhf/stages/launch.py (its docstring has the details;
``python -m online_rlhf.stages.launch`` runs the same), in this order, and where each step's work lives:

    dry_run(cfg)               dry_run=true, instead: shard 0's engine and one max-length batch
    run_shards(cfg)            1. this machine's shard processes, one per device: each is generation/generate.py
                                  (online_rlhf/stages/generate.py; its engine: online_rlhf/stages/vllm_engine.py)
    machine_shards(...)           (machine k > 0 of several: its shards are done; machine 0 merges)
    wait_for_shards(cfg)       2. machine 0 of several: every machine's shard files
    merge_shards(cfg)          3. one generated.jsonl and its stats (online_rlhf/stages/merge_data.py)
"""

from online_rlhf.stages.launch import cli

if __name__ == "__main__":
    cli()
