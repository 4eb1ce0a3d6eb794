"""Stage completion markers: ``<stage>.done`` holds a hash of the stage's config and inputs.

A stage is skipped on rerun only when its marker exists and the hash matches (README.md, "Run
directory"). The marker is written last and atomically, after the stage's outputs.
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


def is_done(marker: str | os.PathLike, digest: str) -> bool:
    """True when ``marker`` exists and records ``digest``."""
    try:
        return read_json(marker).get("hash") == digest
    except (FileNotFoundError, DataError, AttributeError):
        return False


def mark_done(marker: str | os.PathLike, digest: str, **info: Any) -> None:
    """Atomically write ``marker`` with ``digest`` and any extra info (e.g. wall seconds)."""
    write_json(marker, {"hash": digest, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **info})
