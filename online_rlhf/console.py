"""The warnings of a stage's log that run_loop.sh repeats on the console after the stage ends.

    python -m online_rlhf.console warnings LOG [MAX]

Not only the project's own ``WARNING: `` / ``warning: `` lines: the warnings of the libraries the
stage runs too (Axolotl's ``[WARNING]`` lines, such as "the turn terminator won't be trained";
Python ``warnings`` as ``file:line: SomeWarning: ...``; ``logging``'s ``WARNING:name:`` and
``... - WARNING - ...``; vLLM's ``WARNING MM-DD ...``), each message once, in log order.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_PATTERNS = [
    re.compile(r"^(?:WARNING|warning): "),                 # the project's stages
    re.compile(r"\[WARNING\]"),                             # Axolotl / accelerate-style brackets
    re.compile(r"^\S.*:\d+: [A-Za-z]*Warning: "),           # warnings.warn
    re.compile(r"^WARNING:[\w.]+:"),                        # logging.basicConfig default format
    re.compile(r" - WARNING - "),                           # logging "%(asctime)s - %(levelname)s - ..." formats
    re.compile(r"^(?:\(\w+ pid=\d+\) )?WARNING \d\d-\d\d "),  # vLLM
]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colour codes (Axolotl colours its log lines)
# Timestamps, pids and source positions that make one message look like many.
_NOISE = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.\d]*|\d\d-\d\d \d\d:\d\d:\d\d|PID:\d+|pid=\d+")


def log_warnings(text: str, limit: int = 8, width: int = 300) -> list[str]:
    """Warning lines of a log ``text``, each message once (timestamps and pids ignored when
    comparing), at most ``limit`` of them cut to ``width`` characters, plus a last line
    ``(N more warnings in the log)`` when some were left out."""
    seen, out, more = set(), [], 0
    for line in text.replace("\r", "\n").splitlines():
        line = _ANSI.sub("", line).rstrip()
        if not any(p.search(line) for p in _PATTERNS):
            continue
        key = _NOISE.sub("", line)
        if key in seen:
            continue
        seen.add(key)
        if len(out) < limit:
            out.append(line[:width])
        else:
            more += 1
    if more:
        out.append(f"({more} more warnings in the log)")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "warnings":
        print(__doc__, file=sys.stderr)
        return 2
    try:
        text = Path(argv[1]).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return 0
    for line in log_warnings(text, int(argv[2]) if len(argv) > 2 else 8):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
