"""The command that runs one stage of the stage table on its resolved config (:func:`launch_command`):
the same for ``loop exec`` (``run_loop.sh``), for the comment on top of each stage YAML, and for a
user reproducing the stage by hand. How it starts follows the row (``Stage.env``,
``Stage.entry``, ``Stage.launch_with``, ``Stage.every_machine``), the config's process and machine
keys, and the loop's ``launcher`` (``local``, or ``slurm``: ``srun`` over the allocation's nodes).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .config import ConfigError
from .paths import PROJECT_ROOT
from .stage_configs import RewardConfig
from .stage_table import Stage


# SLURM sets this in each task of `srun`: the node's index in the step (0 .. num_machines - 1).
SLURM_RANK = "$SLURM_NODEID"


def stage_machines(stage: Stage, d: dict[str, Any]) -> int:
    """How many machines the stage of resolved config ``d`` runs on: its ``num_machines`` when its
    row runs it on every machine (:attr:`Stage.every_machine`), else 1 (machine 0 only)."""
    return int(d.get("num_machines") or 1) if stage.every_machine(d) else 1


def launch_command(stage: Stage, config_path: str, d: dict[str, Any], root: Path = PROJECT_ROOT,
                   machine_rank: int | str = 0, launcher: str = "local", extra: tuple[str, ...] | list[str] = ()
                   ) -> tuple[list[str], dict[str, str]]:
    """The command that runs ``stage`` on its resolved config file, and the environment variables
    it adds: ``(argv, env)``, the same for ``run_loop.sh`` and for a user reproducing the stage.

    - ``python``: ``<env>/bin/python <entry> --config <file>``.
    - ``accelerate``: ``accelerate launch`` with the config's ``num_processes``: on the ``cpu``
      profile, N > 1 plain processes over gloo (``--multi_gpu`` with ``ACCELERATE_USE_CPU=true``);
      on ``zero2``/``zero3``, ``--config_file configs/accelerate/<profile>.yaml``. One process on
      the ``cpu`` profile runs as plain python for a reward model, and through
      ``configs/accelerate/cpu.yaml`` for DPO.
    - Several machines (the config's ``num_machines`` M > 1): ``accelerate launch`` gets
      ``--num_machines M --machine_rank R --main_process_ip IP --main_process_port P``
      (``num_processes`` counts all machines' processes); the generation launcher gets
      ``machine_rank=R`` (it runs shards r with r % M == R; machine 0 merges).
    - ``launcher="slurm"`` and M > 1: the command is wrapped to run once per node of the allocation,
      ``srun --nodes=M --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '<command>'``, with each node's
      rank from ``$SLURM_NODEID`` (``machine_rank`` is then ignored).

    Args:
        stage: the stage's row of :data:`STAGES`.
        config_path: the stage's resolved YAML, as the command should name it.
        d: that YAML's values.
        root: the project root the venv paths are built from (``Path(".")`` for the plan's comments).
        machine_rank: this machine's rank, 0 .. M-1 (per machine, never in the YAML).
        launcher: ``local`` or ``slurm`` (the loop's ``launcher`` key).
        extra: ``key=value`` overrides appended to the stage's own arguments (inside the srun
            wrapper too), e.g. ``dry_run=true``.
    Raises:
        ConfigError: ``machine_rank`` outside 0 .. M-1, a rank > 0 for a stage that runs on machine 0
            only, or an unknown ``launcher``.
    """
    if launcher not in ("local", "slurm"):
        raise ConfigError(f"launcher={launcher!r}: expected local or slurm.")
    m = stage_machines(stage, d)
    slurm = launcher == "slurm" and m > 1
    rank = SLURM_RANK if slurm else machine_rank
    if not slurm:
        if not isinstance(rank, int) or not 0 <= rank < m:
            if m == 1:
                raise ConfigError(f"stage {stage.name} runs on machine 0 only (its config says num_machines=1); "
                                  f"machine_rank={machine_rank} has nothing to run.")
            raise ConfigError(f"machine_rank={machine_rank} must be in 0..{m - 1} (num_machines={m}).")
    argv, env = _single_machine_command(stage, config_path, d, root)
    if m > 1:
        if stage.launch_with == "python":  # the generation launcher: this machine's shards
            argv = [*argv, f"machine_rank={rank}"]
        else:
            at = argv.index("launch") + 1
            argv[at:at] = ["--num_machines", str(m), "--machine_rank", str(rank),
                           "--main_process_ip", str(d.get("main_process_ip")),
                           "--main_process_port", str(d.get("main_process_port") or 29500)]
    argv = [*argv, *extra]
    if slurm:
        inner = " ".join(_slurm_word(a) for a in argv)
        argv = ["srun", f"--nodes={m}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c", inner]
    return argv, env


def is_module_entry(entry: str) -> bool:
    """Whether a row's ``entry`` names a module (``online_rlhf.stages.NAME``, run with ``-m``: the stage
    module is its own entry point) rather than an entry script (``dpo_iteration/run_dpo.py``)."""
    return not entry.endswith(".py")


def _slurm_word(a: str) -> str:
    """One word of the command run by ``bash -c`` on each node: quoted, except the rank placeholder,
    which that shell expands to the node's ``$SLURM_NODEID``."""
    if a == SLURM_RANK:
        return '"$SLURM_NODEID"'
    if a == f"machine_rank={SLURM_RANK}":
        return 'machine_rank="$SLURM_NODEID"'
    return shlex.quote(a)


def _single_machine_command(stage: Stage, config_path: str, d: dict[str, Any], root: Path
                            ) -> tuple[list[str], dict[str, str]]:
    py = str(root / f".venv-{stage.env}" / "bin" / "python")
    # an entry script (generation/launch.py), or a stage module run as ``-m`` (online_rlhf.stages.NAME)
    tail = [*(("-m",) if is_module_entry(stage.entry) else ()), stage.entry, "--config", config_path]
    if stage.launch_with == "python":
        return [py, *tail], {}
    n = int(d.get("num_processes") or 1)
    profile = d.get("launch_profile", "cpu")
    accelerate = str(root / f".venv-{stage.env}" / "bin" / "accelerate")
    if profile == "cpu" and n == 1:
        if stage.config is RewardConfig:
            return [py, *tail], {}
        return [accelerate, "launch", "--config_file", "configs/accelerate/cpu.yaml", "--num_processes", "1", *tail], {}
    if profile == "cpu":
        return [accelerate, "launch", "--multi_gpu", "--num_processes", str(n), *tail], {"ACCELERATE_USE_CPU": "true"}
    if stage.config is RewardConfig:  # data-parallel scoring needs no DeepSpeed
        return [accelerate, "launch", "--multi_gpu", "--num_processes", str(n), *tail], {}
    return [accelerate, "launch", "--config_file", f"configs/accelerate/{profile}.yaml", "--num_processes", str(n),
            *tail], {}
