"""Stage: KL(policy || reference) from responses sampled from the policy.

    python annotate_data/kl_estimate.py input=kl_generated.jsonl policy=DIR reference=DIR output=kl.jsonl

The recipe is ``main`` of online_rlhf/stages/kl_estimate.py (its docstring has the details), in
this order, and where each step's work lives:

    load_generated(cfg.input)  1. the sampled records (online_rlhf/stages/get_rewards.py)
    build_sequences(...)       2. each response's prompt and response token ids
    ...                        3. the log-probs of both models over those ids
    precision(cfg.dtype, ...)     the precision both ran in, and its label for the stats
    precision_label(...)
    kl_summary(...)            4. the estimate with its standard error (online_rlhf/evaluation.py)
    KLStats(...)               5. kl.jsonl's stats (online_rlhf/stats.py)
"""

from online_rlhf.stages.kl_estimate import cli

if __name__ == "__main__":
    cli()
