"""The SFT data set (the SFT stage's ``dataset``: one JSONL file of conversational rows): every row
checked (:func:`validate_sft_dataset`), the rows holding special-token strings counted
(:func:`special_text_rows`), and the Axolotl ``datasets`` entry that trains on it
(:func:`dataset_entry`). The SFT stage (``online_rlhf.stages.run_sft``) checks its data with these
before Axolotl starts, and the loop's plan (``online_rlhf.stage_checks``) before any stage runs.
Importable without torch or Axolotl.
"""

from __future__ import annotations

import os
from pathlib import Path

from .chat_tokens import has_special_text
from .config import ConfigError
from .jsonl import DataError, iter_jsonl
from .records import ROLES, check_messages


def dataset_entry(datasets, dataset: str) -> dict:
    """The Axolotl ``datasets`` entry for ``dataset``, from the config's one-entry template.

    The template (``datasets: [{type: chat_template, field_messages: messages, ...}]``) gives the
    format options; its ``path`` is set here. Raises ConfigError on more than one entry, a ``path``
    in the template, or a type other than ``chat_template``.
    """
    if datasets is None:
        datasets = [{"type": "chat_template", "field_messages": "messages"}]
    if not isinstance(datasets, list) or len(datasets) != 1 or not isinstance(datasets[0], dict):
        raise ConfigError("datasets: give exactly one entry with the format options (type: chat_template, "
                          "field_messages, roles_to_train, ...); the stage trains on one file, `dataset`. "
                          "Concatenate several SFT files into one JSONL first.")
    entry = dict(datasets[0])
    if entry.get("path") not in (None, dataset):
        raise ConfigError(f"datasets[0].path={entry['path']!r}: set the stage's `dataset=` instead of the path "
                          "inside `datasets` (the stage validates that file before Axolotl runs).")
    if entry.get("type", "chat_template") != "chat_template":
        raise ConfigError(f"datasets[0].type={entry['type']!r}: this stage trains on conversational "
                          "`messages` rows; use type: chat_template.")
    entry.update(type="chat_template", path=str(Path(dataset).absolute()), ds_type="json")
    entry.setdefault("field_messages", "messages")
    return entry


def validate_sft_dataset(path: str | os.PathLike, field: str = "messages") -> int:
    """Check every row of an SFT JSONL file; return the number of rows.

    A row is ``{field: [{"role": "system"|"user"|"assistant", "content": str}, ...], ...}`` with at
    least one assistant turn and no assistant turn that is empty (or only whitespace). Other
    columns (``id``, ``reward``) are allowed and ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataError: the first bad row, naming ``path:line`` and the fix; also an empty file.
    """
    path = Path(path)
    n = 0
    for lineno, rec in iter_jsonl(path):
        where = f"{path}:{lineno}"
        if field not in rec:
            raise DataError(f"{where}: no {field!r} column (columns: {', '.join(rec) or 'none'}). Each line must be "
                            f'{{"{field}": [{{"role": "user", "content": "..."}}, {{"role": "assistant", "content": "..."}}]}}.')
        messages = check_messages(rec[field], where)
        assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            raise DataError(f"{where}: no assistant turn, so nothing to train on. Add the response as "
                            f"{{\"role\": \"assistant\", ...}} or remove the row (roles: {', '.join(ROLES)}).")
        for j in assistant:
            if not messages[j]["content"].strip():
                raise DataError(f"{where}: message {j} (assistant) is empty; training on it teaches the model to "
                                "stop at once. Remove the row or give the turn its text.")
        n += 1
    if n == 0:
        raise DataError(f"{path}: the SFT data set is empty.")
    return n


def special_text_rows(path: str | os.PathLike, tokenizer, field: str = "messages") -> dict:
    """Rows of an SFT JSONL file whose messages hold a special-token string of ``tokenizer``.

    Axolotl parses such strings as special tokens (``online_rlhf.stages.run_sft``'s docstring); this
    only counts them. Call
    it on a file :func:`validate_sft_dataset` accepted.

    Returns:
        ``{"rows": n rows with at least one, "messages": {"system": n, "user": n, "assistant": n}}``
        (messages per role that hold one).
    """
    rows, by_role = 0, dict.fromkeys(ROLES, 0)
    for _, rec in iter_jsonl(path):
        hits = [m["role"] for m in rec[field] if has_special_text(tokenizer, m["content"])]
        rows += bool(hits)
        for role in hits:
            by_role[role] += 1
    return {"rows": rows, "messages": by_role}
