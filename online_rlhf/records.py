"""Record formats shared by the stages (docs/run-directory.md) and the prompt-set loader.

- prompt set (input): ``messages`` (list of ``{role, content}``) or ``prompt`` (string or
  messages) or another text column named by ``prompt_field``; optional ``id``; any task fields.
- generated: ``{id, prompt: [messages], responses: [K str], finish_reasons: [K str],
  response_tokens: [K int], ...task fields}``
- rewards: generated + ``rewards: [K float | null]`` + ``reward_source`` (``null``: that response
  could not be scored; readers leave it out)
- pairs: ``{id, prompt: [messages], chosen: [messages], rejected: [messages], chosen_reward,
  rejected_reward}`` (TRL's conversational preference format)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, get_args

from .jsonl import DataError, check_finite, iter_jsonl
from .paths import is_local_data

# Where a rewards record's rewards came from (its ``reward_source``; the rewards stage's ``source``
# and its stats' ``source``): the one list of reward sources. Each has a scoring module,
# ``online_rlhf.stages.get_rewards.SOURCES``, which tests/test_stage_table.py ties to it.
RewardSource = Literal["reward_model", "verifier", "remote", "judge"]
REWARD_SOURCES: tuple[str, ...] = get_args(RewardSource)

ROLES = ("system", "user", "assistant")
# Fields a prompt record may carry that are not task fields.
_PROMPT_KEYS = ("id", "messages", "prompt")


def check_messages(messages: Any, where: str) -> list[dict]:
    """Validate a ``[{role, content}, ...]`` list (roles system/user/assistant, string content).

    Returns the messages reduced to ``role`` and ``content``.
    Raises:
        DataError: naming ``where`` and the bad message.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.80}.")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {j} must be an object with 'role' and 'content', got {m!r:.80}.")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has role {m['role']!r}; allowed roles are {', '.join(ROLES)}.")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {j} content must be a string, got {type(m['content']).__name__}.")
        out.append({"role": m["role"], "content": m["content"]})
    return out


GENERATED_ID_PREFIX = "row-"  # a row without an id gets "row-<0-based row number>"


def check_plain_id(value, where: str, col: str = "id") -> None:
    """Raise DataError (naming ``where`` and ``col``) unless ``value`` is a string or a number: an id
    is a dict key and a file's join key, so a list, a mapping or a boolean cannot be one."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: {col!r} must be a string or a number, got {type(value).__name__} "
                        f"{value!r:.60}. Give the row a plain id.")


def prompt_id(rec: dict, index: int, where: str) -> tuple[str, bool]:
    """The id of a prompt row: its ``id`` (else ``key``) column as a string, or ``row-<index>``.

    Returns:
        ``(id, generated)``: generated is True when the row has no id (``null`` counts as none).
    Raises:
        DataError: an id that is not a string or a number, or is empty (names ``where``).
    """
    for col in ("id", "key"):
        value = rec.get(col)
        if value is None:
            continue
        check_plain_id(value, where, col)
        if not str(value).strip():
            raise DataError(f"{where}: {col!r} is empty. Give the row an id, or remove the column so one is generated.")
        return str(value), False
    return f"{GENERATED_ID_PREFIX}{index}", True


def normalize_prompt_record(rec: dict, index: int, where: str, prompt_field: str | None = None) -> dict:
    """Turn one input row into ``{id, prompt: [messages], ...task fields}``.

    ``prompt_field`` names the prompt column when it is neither ``messages`` nor ``prompt``: a text
    column (e.g. ``question`` for GSM8K, ``instruction`` for AlpacaEval) or a message-list column
    (e.g. ``context_messages`` in RLHFlow's prompt sets). Trailing assistant turns are removed (the
    policy writes that turn; :func:`load_prompt_set` counts the prompts that had them).
    The id comes from :func:`prompt_id`: ``rec["id"]`` (else ``rec["key"]``) as a string, else
    ``row-<index>``.

    Raises:
        DataError: no prompt column, a bad message list, an empty prompt, or a bad id; names ``where``.
    """
    return _normalize(rec, index, where, prompt_field)[0]


def _normalize(rec: dict, index: int, where: str, prompt_field: str | None) -> tuple[dict, int]:
    """:func:`normalize_prompt_record` and the number of trailing assistant turns it removed."""
    if prompt_field and prompt_field not in ("messages", "prompt") and (
            prompt_field in rec or not ("messages" in rec or "prompt" in rec)):
        if prompt_field not in rec:
            raise DataError(f"{where}: no column {prompt_field!r} (prompt_field). Columns: {', '.join(rec)}.")
        value = rec[prompt_field]
        if isinstance(value, list):
            messages = check_messages(value, f"{where}, column {prompt_field!r}")
        elif isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        else:
            raise DataError(f"{where}: column {prompt_field!r} must be a string or a list of {{role, content}} "
                            f"messages, got {type(value).__name__}.")
        skip = {prompt_field}
    elif "messages" in rec and prompt_field != "prompt":
        messages = check_messages(rec["messages"], where)
        skip = {"messages"}
    elif "prompt" in rec:
        p = rec["prompt"]
        if not isinstance(p, (str, list)):
            raise DataError(f"{where}: column 'prompt' must be a string or a list of {{role, content}} messages, "
                            f"got {type(p).__name__} {p!r:.60}.")
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else check_messages(p, f"{where}, column 'prompt'")
        skip = {"prompt"}
    else:
        raise DataError(
            f"{where}: no prompt. A prompt record needs 'messages' (list of {{role, content}}) or 'prompt' "
            f"(string); or set prompt_field to the text column. Columns: {', '.join(rec) or 'none'}."
        )
    removed = 0
    while messages and messages[-1]["role"] == "assistant":
        messages, removed = messages[:-1], removed + 1
    if not messages or messages[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt must end with a user turn.")
    if not messages[-1]["content"].strip():
        raise DataError(f"{where}: the user turn is empty. Remove the record or give it text.")
    out = {"id": prompt_id(rec, index, where)[0], "prompt": messages}
    for k, v in rec.items():
        if k not in _PROMPT_KEYS and k not in skip:
            out[k] = v
    return out, removed


@dataclass
class PromptSetCounts:
    """What :func:`load_prompt_set` skipped or changed while loading a prompt set (never silently:
    each also makes one ``note:`` line on stderr naming the file).

    Attributes:
        blank_lines: blank lines skipped in a local JSONL file (in the rows read, up to ``limit``).
        assistant_turns_removed: prompts that ended with assistant turn(s), removed so that the
            policy answers the last user turn.
        first_assistant_removed: ``"<file:line> (id=...)"`` of the first such prompt, or None.
        prompt_column_unused: rows with both ``messages`` and ``prompt`` whose prompt came from
            ``messages`` (their ``prompt`` column is not kept); ``first_prompt_column_unused`` names
            the first.
        prompt_field_missing: rows without the ``prompt_field`` column, whose prompt came from their
            ``messages`` or ``prompt`` column instead; ``first_prompt_field_missing`` names the first.
    """

    blank_lines: int = 0
    assistant_turns_removed: int = 0
    first_assistant_removed: str | None = None
    prompt_column_unused: int = 0
    first_prompt_column_unused: str | None = None
    prompt_field_missing: int = 0
    first_prompt_field_missing: str | None = None


def load_prompts(source: str | os.PathLike, split: str = "train", prompt_field: str | None = None,
                 limit: int | None = None) -> list[dict]:
    """The rows of :func:`load_prompt_set` (same arguments, errors and stderr notes), without the counts."""
    return load_prompt_set(source, split, prompt_field, limit)[0]


def load_prompt_set(source: str | os.PathLike, split: str = "train", prompt_field: str | None = None,
                    limit: int | None = None) -> tuple[list[dict], PromptSetCounts]:
    """Load a prompt set and normalize every row (see :func:`normalize_prompt_record`).

    ``source`` is a local ``.jsonl``/``.json``/``.parquet`` file or an HF Hub dataset id
    (``split`` chooses the split). Local JSONL is read line by line so that errors name the line.

    Returns:
        ``(rows, counts)``: rows are ``{id: str, prompt: [messages], ...}`` in file order (the first
        ``limit`` rows); a row without an id gets ``row-<0-based row number>``. ``counts``
        (:class:`PromptSetCounts`) holds the blank lines skipped and the prompts whose trailing
        assistant turns were removed; each non-zero count also prints one ``note:`` line on stderr
        naming the file (and the first such record).
    Raises:
        FileNotFoundError / DataError: missing file, bad row (names file and line), duplicate id
        (names both rows, and says when an id was generated), or an empty prompt set.
    """
    source = str(source)
    rows: Iterable[tuple[str, int, dict]]
    path = Path(source)
    lines = None  # the JSONL reader, for its blank-line count
    if path.suffix == ".jsonl" or (path.exists() and path.suffix == ".json" and _looks_jsonl(path)):
        lines = iter_jsonl(path)
        rows = ((f"{path}:{ln}", i, rec) for i, (ln, rec) in enumerate(lines))
    else:
        import datasets

        if path.exists():
            kind = {".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
            if kind is None:
                raise DataError(f"{path}: unsupported prompt file type {path.suffix!r}; use .jsonl, .json or .parquet.")
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        elif is_local_data(source):
            raise FileNotFoundError(f"{source}: no such prompt file.")
        else:
            ds = _load_hub_prompts(datasets, source, split)
        rows = ((f"{source} row {i}", i, dict(r)) for i, r in enumerate(ds))
    out: list[dict] = []
    seen: dict[str, str] = {}
    counts = PromptSetCounts()
    stopped_early = False
    custom_field = prompt_field not in (None, "messages", "prompt")
    first_columns = None
    for where, i, rec in rows:
        if limit is not None and len(out) >= limit:
            stopped_early = True
            break
        first_columns = list(rec) if first_columns is None else first_columns
        r, removed = _normalize(rec, i, where, prompt_field)
        if custom_field and prompt_field not in rec:
            counts.prompt_field_missing += 1
            counts.first_prompt_field_missing = counts.first_prompt_field_missing or where
        elif "messages" in rec and "prompt" in rec and prompt_field in (None, "messages"):
            counts.prompt_column_unused += 1
            counts.first_prompt_column_unused = counts.first_prompt_column_unused or where
        here = where + (" (no id: generated)" if prompt_id(rec, i, where)[1] else "")
        if r["id"] in seen:
            raise DataError(f"{here}: duplicate id {r['id']!r}, also the id of {seen[r['id']]}. Ids must be unique "
                            f"(a row without an id gets '{GENERATED_ID_PREFIX}<0-based row number>'): rename one, "
                            "or give every row an id.")
        seen[r["id"]] = here
        if removed:
            counts.assistant_turns_removed += 1
            if counts.first_assistant_removed is None:
                counts.first_assistant_removed = f"{where} (id={r['id']!r})"
        out.append(r)
    if not out:
        raise DataError(f"{source}: the prompt set is empty.")
    if custom_field and counts.prompt_field_missing == len(out):  # e.g. a typo: their messages/prompt column was used
        print(f"warning: {source}: no row has the column prompt_field={prompt_field!r}; the prompts came from "
              "its 'messages' or 'prompt' column. Check the name if you meant that column "
              f"(columns of the first row: {', '.join(first_columns or [])}).", file=sys.stderr)
    elif counts.prompt_field_missing:
        print(f"warning: {source}: {counts.prompt_field_missing} of {len(out)} row(s) have no column "
              f"prompt_field={prompt_field!r} (first: {counts.first_prompt_field_missing}); their prompts came from "
              "their 'messages' or 'prompt' column.", file=sys.stderr)
    if counts.prompt_column_unused:
        print(f"note: {source}: {counts.prompt_column_unused} row(s) have both 'messages' and 'prompt' (first: "
              f"{counts.first_prompt_column_unused}); their prompt came from 'messages' and the 'prompt' column was "
              "not kept. Give prompt_field=prompt to use it instead.", file=sys.stderr)
    if lines is not None:
        counts.blank_lines = lines.blank_lines
        if stopped_early and lines.blank_lines:  # the reader notes them itself only at the end of the file
            print(f"note: {lines.note()}, in the rows read up to limit={limit}", file=sys.stderr)
    if counts.assistant_turns_removed:
        print(f"note: {source}: removed the trailing assistant turn(s) of {counts.assistant_turns_removed} "
              f"prompt(s) (first: {counts.first_assistant_removed}); the policy answers the last user turn. "
              "End each prompt with its user turn to silence this note.", file=sys.stderr)
    return out, counts


def _looks_jsonl(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        first = f.read(1).strip()
    return first == "{"


def _load_hub_prompts(datasets, source: str, split: str):
    """``datasets.load_dataset(source, split=split)`` with the failures a user can fix said plainly."""
    try:
        return datasets.load_dataset(source, split=split)
    except ValueError as e:  # e.g. an unknown split: datasets names the ones that exist
        raise DataError(f"prompt set {source!r}, split {split!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - hub/network errors come in many classes (httpx, OSError, RuntimeError...)
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = ("HF_HUB_OFFLINE=1 is set and it is not in the local cache" if offline else
                "is the Hub reachable from here, and is the id right?")
        raise DataError(f"prompt set {source!r}: there is no local file {Path(source).resolve()}, and as a Hugging "
                        f"Face Hub dataset id it could not be loaded ({type(e).__name__}: {str(e)[:200]}); {hint} "
                        "A local file needs its suffix (.jsonl, .json, .parquet, .csv). Download it where there is network (or give a local .jsonl "
                        "of {id, prompt} rows) and point train_prompts/eval_prompts at it.") from None


def validate_generated(rec: dict, where: str) -> None:
    """Check a generated record; raise DataError naming ``where`` and the bad field."""
    for k in ("id", "prompt", "responses", "finish_reasons"):
        if k not in rec:
            raise DataError(f"{where}: generated record lacks {k!r}. Was it written by generation/generate.py?")
    check_plain_id(rec["id"], where)
    check_messages(rec["prompt"], where)
    resp, fin = rec["responses"], rec["finish_reasons"]
    if not isinstance(resp, list) or not all(isinstance(r, str) for r in resp):
        raise DataError(f"{where}: 'responses' must be a list of strings.")
    if not isinstance(fin, list) or len(fin) != len(resp):
        raise DataError(f"{where}: 'finish_reasons' must have one entry per response ({len(resp)}).")


def sampled_token_ids(rec: dict, j: int, where: str) -> tuple[list[int], list[int]] | None:
    """``(prompt ids, response ids)`` of response ``j`` of a generated record exactly as the engine
    sampled it: the ``prompt_token_ids`` / ``response_token_ids`` the generation stage writes with
    ``save_token_ids: true``. None when the record has neither (the caller re-tokenizes the text,
    which a tokenizer need not round-trip).

    Raises:
        DataError: the ids are there but malformed (not int lists, or not one list per response).
    """
    prompt, responses = rec.get("prompt_token_ids"), rec.get("response_token_ids")
    if prompt is None and responses is None:
        return None
    ok = (isinstance(prompt, list) and isinstance(responses, list) and len(responses) == len(rec.get("responses") or [])
          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
          and all(isinstance(r, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in r) for r in responses)
          and len(prompt) > 0 and all(len(r) > 0 for r in responses)
          and all(t >= 0 for t in prompt) and all(t >= 0 for r in responses for t in r))
    if not ok:
        raise DataError(f"{where}: prompt_token_ids must be a non-empty list of token ids (ints >= 0) and "
                        "response_token_ids one non-empty list of token ids per response; regenerate the file with save_token_ids=true or remove both fields to "
                        "re-tokenize the text.")
    return list(prompt), list(responses[j])


def validate_rewards(rec: dict, where: str) -> list[float | None]:
    """Check a rewards record; return its rewards, one per response.

    Returns:
        finite floats, with ``None`` where the reward stage could not score that response (``null``).
    Raises:
        DataError: no ``rewards``, the wrong number of them, or one that is NaN/inf/not a number
        (names ``where``, the id and the response).
    """
    validate_generated(rec, where)
    rw = rec.get("rewards")
    if "rewards" not in rec:
        raise DataError(f"{where}: record has no 'rewards': this looks like generation output. Score it first: "
                        "annotate_data/get_rewards.py input=<generated.jsonl> output=<rewards.jsonl>.")
    if not isinstance(rw, list) or len(rw) != len(rec["responses"]):
        raise DataError(f"{where}: 'rewards' must be a list with one value per response ({len(rec['responses'])}).")
    return [None if x is None else check_finite(x, f"{where} (id={rec['id']!r}, response {j})")
            for j, x in enumerate(rw)]


def validate_pair(rec: dict, where: str) -> None:
    """Check a preference pair in TRL's conversational format."""
    for k in ("prompt", "chosen", "rejected"):
        if k not in rec:
            raise DataError(f"{where}: pair lacks {k!r}; expected {{prompt, chosen, rejected}} as message lists.")
        check_messages(rec[k], where)
    if rec["chosen"] == rec["rejected"]:
        raise DataError(f"{where}: chosen == rejected; such a pair carries no preference.")
