"""Check that a checkpoint saved by run_dpo.py loads in vLLM as is and generates (inference env).

    VLLM_CPU_KVCACHE_SPACE=1 .venv-infer/bin/python dpo_iteration/check_vllm_load.py runs/x/iter_1/model

Entry point only: the stage lives in ``online_rlhf/stages/check_vllm_load.py`` (its docstring has the
details; ``python -m online_rlhf.stages.check_vllm_load`` runs the same).
"""

from online_rlhf.stages.check_vllm_load import cli

if __name__ == "__main__":
    cli()
