"""The loop's bookkeeping, called by run_loop.sh as ``python -m online_rlhf.loop COMMAND ...``
(the commands: ``python -m online_rlhf.loop -h``, :mod:`online_rlhf.loop.cli`).

One module per concern, each importing only those before it:

- :mod:`.resolve`: the loop config resolved and checked (:func:`resolve`, :func:`stage_dict`);
- :mod:`.provenance`: where each value of a stage YAML came from (its comment block);
- :mod:`.plan`: the run directory's files (:func:`plan`, :func:`fresh_refusal`);
- :mod:`.freshness`: whether a stage is done and fresh (``check``), and why not;
- :mod:`.co_decoding`: the later generation stages a launch decodes with the same engine start;
- :mod:`.run`: ``exec``, ``mark``, ``stages``/``after``;
- :mod:`.memory_check`: the dry run (each model stage once at its largest shapes);
- :mod:`.metrics`: one row of ``metrics.jsonl`` per iteration;
- :mod:`.report`: ``report.md``, ``report.png``, wandb and the live metrics line;
- :mod:`.cli`: the command line.

The stages themselves are the rows of ``online_rlhf.stage_table.STAGES``.
"""

from ..config import ConfigError
from ..jsonl import DataError
from ..loop_config import iteration_config
from ..stage_table import STAGES, no_pairs_stop
from .cli import main
from .metrics import grpo_metrics, iteration_stats, mean_ci95, metrics
from .plan import RUN_CONFIG_HEADER, fresh_refusal, plan, run_config_dict
from .report import metrics_line, report
from .resolve import auto_processes, resolve, sft_dict, stage_dict
from .freshness import check, stage_hash, stale_reason
from .memory_check import DRY_RUN_STAGES, dry_run
from .run import after_line, exec_stage, mark, output_hint, previous_stage, stage_lines

__all__ = ["ConfigError", "DataError", "STAGES", "DRY_RUN_STAGES", "RUN_CONFIG_HEADER", "after_line", "auto_processes",
           "check", "dry_run", "exec_stage", "fresh_refusal", "grpo_metrics", "iteration_config", "iteration_stats",
           "main", "mark", "mean_ci95", "metrics", "metrics_line", "no_pairs_stop", "output_hint", "plan",
           "previous_stage", "report", "resolve", "run_config_dict", "sft_dict", "stage_dict", "stage_hash",
           "stage_lines", "stale_reason"]
