"""Atomic JSON/JSONL I/O with errors that name the file and the line.

Every writer here writes to a temporary file in the destination's folder, flushes and fsyncs it,
then renames it over the destination (``os.replace``), so a crash leaves either the old file or
the complete new one, never a half-written file that looks whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


class DataError(ValueError):
    """A data file or record is malformed. The message names the file, the line and the fix."""


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[Any]:
    """Open a temporary sibling of ``path`` for writing; rename it to ``path`` on success.

    On an exception the temporary file is removed and ``path`` is left untouched.
    ``mode`` is ``"w"`` (text) or ``"wb"`` (binary).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _default(obj: Any) -> Any:
    # numpy / torch scalars and arrays
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serialisable")


def dumps(record: Any) -> str:
    """One JSON line; non-finite floats are refused (JSON has no NaN)."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False, default=_default)


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Atomically write ``records`` as JSON Lines to ``path``. Returns the number of lines.

    Raises:
        DataError: a record holds NaN/inf or an object JSON cannot hold (names the record index).
    """
    n = 0
    with atomic_open(path) as f:
        for n, rec in enumerate(records, start=1):
            try:
                f.write(dumps(rec))
            except ValueError as e:  # NaN / inf
                raise DataError(f"{path}: record {n} (id={rec.get('id')!r}) cannot be written: {e}") from e
            f.write("\n")
    return n


def json_text(obj: Any) -> str:
    """``obj`` as one indented JSON document (no NaN/inf), as :func:`write_json` writes it."""
    return json.dumps(obj, ensure_ascii=False, indent=2, allow_nan=False, default=_default) + "\n"


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write one JSON document (indented) to ``path``."""
    text = json_text(obj)  # before the file is opened: a value JSON cannot hold leaves no file
    with atomic_open(path) as f:
        f.write(text)


def relative_paths_note() -> str:
    """Where a relative path was looked for: the current directory, and first the directory
    run_loop.sh was started from (``ONLINE_RLHF_CALLER_PWD``) when that is another one."""
    caller = os.environ.get("ONLINE_RLHF_CALLER_PWD")
    if caller and Path(caller).resolve() != Path.cwd().resolve():
        return f"run_loop.sh looks for relative paths in {caller}, where it was started, then in {Path.cwd()}"
    return f"relative paths are taken from {Path.cwd()}"


class JsonlLines:
    """The records of a JSONL file, ``(line_number, record)`` per non-blank line; see :func:`iter_jsonl`.

    Blank (empty or whitespace-only) lines are skipped and counted: ``blank_lines`` holds the count
    so far and ``blank_line_numbers`` the first ``MAX_LISTED`` of their line numbers. When the file
    has been read to its end and some lines were blank, one line goes to stderr:
    ``note: skipped N blank line(s) in FILE (line 3, 7)``. This is the one place that counts them;
    stages copy ``blank_lines`` into their stats.
    """

    MAX_LISTED = 5

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.blank_lines = 0
        self.blank_line_numbers: list[int] = []

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        path = self.path
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file. Check the path ({relative_paths_note()}).")
        self.blank_lines, self.blank_line_numbers = 0, []
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                                    "line). Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None
                if lineno == 1:
                    line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark, as some editors write
                if not line.strip():
                    self.blank_lines += 1
                    if len(self.blank_line_numbers) < self.MAX_LISTED:
                        self.blank_line_numbers.append(lineno)
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                        "Each line must be one complete JSON object; fix or remove that line."
                    ) from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(rec).__name__}.")
                yield lineno, rec
        if self.blank_lines:
            print(f"note: {self.note()}", file=sys.stderr)

    def note(self) -> str:
        """``skipped N blank line(s) in FILE (line a, b, ...)`` (what goes to stderr at the end of the file)."""
        listed = ", ".join(map(str, self.blank_line_numbers)) + (", ..." if self.blank_lines > self.MAX_LISTED else "")
        return f"skipped {self.blank_lines} blank line(s) in {self.path} (line {listed})"


def iter_jsonl(path: str | os.PathLike) -> JsonlLines:
    """``(line_number, record)`` for each non-blank line of a JSONL file, in file order.

    Returns an iterable (:class:`JsonlLines`) whose ``blank_lines`` counts the blank lines skipped
    (read it after the loop; a note naming the file goes to stderr when it is not 0)::

        lines = iter_jsonl(path)
        for lineno, rec in lines: ...
        lines.blank_lines

    Raises (when iterated):
        FileNotFoundError: the file does not exist (message names it).
        DataError: a line is not valid JSON, or not a JSON object; names file and line.
    """
    return JsonlLines(path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a whole JSONL file into a list of dicts (see :func:`iter_jsonl` for errors)."""
    return [rec for _, rec in iter_jsonl(path)]


def read_json(path: str | os.PathLike) -> Any:
    """Read one JSON document; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None


def check_finite(value: Any, where: str) -> float:
    """Return ``value`` as a float; raise DataError naming ``where`` if it is NaN, inf or not a number
    (text such as ``"1.0"`` and booleans are not numbers here: they mean a broken reward source)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{where}: reward {value!r} is not a number (got {type(value).__name__}); rewards must be "
                        "JSON numbers.")
    x = float(value)
    if not math.isfinite(x):
        raise DataError(f"{where}: reward is {x} (not finite). Fix the reward source; such a record cannot be ranked.")
    return x
