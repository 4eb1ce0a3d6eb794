"""Stage completion markers: ``<stage>.done`` holds a hash of the stage's config and inputs, and
the size and hash of each of its outputs as the stage left them.

A stage is skipped on rerun only when its marker exists, the hash matches and its outputs are
unchanged (docs/architecture.md, "Freshness"; an output cut, edited or replaced after the stage finished
makes the stage run again). The marker is written last and atomically, after the stage's outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

from .jsonl import read_json, write_json, DataError

_BIG = 64 << 20  # files above this are hashed by size + first/last MiB, not whole


def _hash_file(h: "hashlib._Hash", p: Path) -> None:
    size = p.stat().st_size
    h.update(f"{p.name}:{size}".encode())
    with open(p, "rb") as f:
        if size <= _BIG:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f.read(1 << 20))
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))


def fingerprint(config: Any, inputs: Iterable[str | os.PathLike] = (), root: str | os.PathLike | None = None) -> str:
    """sha256 over the JSON of ``config`` and the content of each input file or folder.

    Folders (model checkpoints) are hashed file by file in sorted order; hidden files are
    skipped and files above 64 MiB contribute their size and first/last MiB only. A missing input
    hashes as missing. Inputs under ``root`` are named relative to it, so a run directory that is
    moved or copied keeps its fingerprints.
    """
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for inp in inputs:
        p = Path(inp)
        label = str(inp)
        if root is not None and p.is_absolute() and p.is_relative_to(root):
            label = "<root>/" + str(p.relative_to(root))
        h.update(label.encode())
        if p.is_dir():
            for f in sorted(x for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")):
                _hash_file(h, f)
        elif p.is_file():
            _hash_file(h, p)
        else:
            h.update(b"<missing>")
    return h.hexdigest()


def _label(p: Path, root: str | os.PathLike | None) -> str:
    if root is not None and p.is_absolute() and p.is_relative_to(root):
        return "<root>/" + str(p.relative_to(root))
    return str(p)


def output_digests(outputs: Iterable[str | os.PathLike], root: str | os.PathLike | None = None) -> dict[str, dict]:
    """``{output: {"bytes": size, "sha256": hash}}`` of each output file or folder as it is now.

    The hash is :func:`fingerprint`'s of that one path (a folder: its files in sorted order; files
    above 64 MiB by size and first/last MiB); ``bytes`` is the file's size or the folder's total
    (``-1``: missing). Paths under ``root`` are named relative to it, as in :func:`fingerprint`.
    """
    out = {}
    for o in outputs:
        p = Path(o)
        if p.is_dir():
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        else:
            size = p.stat().st_size if p.is_file() else -1
        out[_label(p, root)] = {"bytes": size, "sha256": fingerprint({}, [p], root=root)}
    return out


def changed_outputs(marker: str | os.PathLike, outputs: Iterable[str | os.PathLike],
                    root: str | os.PathLike | None = None) -> list[str]:
    """One line per output of ``outputs`` whose size or hash differs from what ``marker`` recorded
    when the stage finished (``"<path>: 1234 -> 617 bytes"``, ``"<path>: same size, other content"``,
    ``"<path>: missing"``). Empty when all match, or when the marker records no outputs (written
    before they were recorded: nothing to compare).

    Raises:
        FileNotFoundError, DataError: no marker, or one that is not JSON.
    """
    recorded = read_json(marker).get("outputs")
    if not isinstance(recorded, dict):
        return []
    now = output_digests(outputs, root)
    lines = []
    for label, cur in now.items():
        then = recorded.get(label)
        if then is None or then == cur:
            continue
        if cur["bytes"] < 0:
            lines.append(f"{label}: missing")
        elif then.get("bytes") != cur["bytes"]:
            lines.append(f"{label}: {then.get('bytes')} -> {cur['bytes']} bytes")
        else:
            lines.append(f"{label}: same size, other content")
    return lines


def is_done(marker: str | os.PathLike, digest: str) -> bool:
    """True when ``marker`` exists and records ``digest``."""
    try:
        return read_json(marker).get("hash") == digest
    except (FileNotFoundError, DataError, AttributeError):
        return False


def mark_done(marker: str | os.PathLike, digest: str, outputs: Iterable[str | os.PathLike] = (),
              root: str | os.PathLike | None = None, **info: Any) -> None:
    """Atomically write ``marker`` with ``digest``, the size and hash of each of ``outputs`` as they
    are now (:func:`output_digests`, checked back by :func:`changed_outputs`) and any extra info
    (e.g. wall seconds)."""
    write_json(marker, {"hash": digest, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "outputs": output_digests(outputs, root), **info})
