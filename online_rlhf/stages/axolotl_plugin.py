"""Axolotl plugin used by online_rlhf.stages.run_sft: writes the trainer's log history to a JSON file.

Axolotl (0.19) prints the loss to its console log but keeps no ``trainer_state.json`` when it saves
no intermediate checkpoints. run_sft.py adds ``plugins: [online_rlhf.stages.axolotl_plugin.TrainLogPlugin]`` to the
resolved Axolotl config and reads ``<Axolotl output_dir>/sft_train_log.json`` afterwards:

    {"rows_used": int, "global_step": int, "log_history": [{"loss": float, "step": int, ...}, ...]}

``rows_used`` is the number of training rows after Axolotl's own filtering (too long, too short,
deduplication). The file is rewritten at every logging step (it is small), so a crashed run keeps
the losses it reached. Only the main process writes it.
"""

from __future__ import annotations

from pathlib import Path

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from online_rlhf.jsonl import write_json

LOG_FILE = "sft_train_log.json"


class _WriteLogHistory(TrainerCallback):
    def __init__(self, path: Path, rows_used: int | None):
        self.path, self.rows_used = path, rows_used

    def _write(self, state) -> None:
        if state.is_world_process_zero:
            write_json(self.path, {"rows_used": self.rows_used, "global_step": state.global_step,
                                   "log_history": state.log_history})

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._write(state)

    def on_train_end(self, args, state, control, **kwargs):
        self._write(state)


class TrainLogPlugin(BasePlugin):
    """Adds a callback that writes ``sft_train_log.json`` into Axolotl's output_dir."""

    def get_training_args(self, cfg):
        """On a machine without CUDA, bf16 (autocast on a CPU with native bf16, chosen by
        ``run_sft`` for ``bf16: auto``) needs ``use_cpu=True`` in the TrainingArguments: without it
        transformers refuses bf16 ("Your setup doesn't support bf16/gpu"), and Axolotl has no key for it."""
        import torch

        if cfg.bf16 is True and not torch.cuda.is_available():
            return {"use_cpu": True}
        return None

    def add_callbacks_post_trainer(self, cfg, trainer):
        dataset = getattr(trainer, "train_dataset", None)
        rows = len(dataset) if hasattr(dataset, "__len__") else None
        return [_WriteLogHistory(Path(cfg.output_dir) / LOG_FILE, rows)]
