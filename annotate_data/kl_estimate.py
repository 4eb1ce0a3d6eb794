"""Stage: KL(policy || reference) from responses sampled from the policy.

    python annotate_data/kl_estimate.py input=kl_generated.jsonl policy=DIR reference=DIR output=kl.jsonl

Entry point only: the stage lives in ``online_rlhf/stages/kl_estimate.py``.
"""

from online_rlhf.stages.kl_estimate import cli

if __name__ == "__main__":
    cli()
