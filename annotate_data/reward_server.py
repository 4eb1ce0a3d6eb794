"""Serve a local reward model over HTTP (the other end of ``source=remote``).

    python annotate_data/reward_server.py reward_model=DIR [host=127.0.0.1] [port=8000] [batch_size=8]

Entry point only: the stage lives in ``online_rlhf/stages/reward_server.py`` (its docstring has the
details; ``python -m online_rlhf.stages.reward_server`` runs the same).
"""

from online_rlhf.stages.reward_server import cli

if __name__ == "__main__":
    cli()
