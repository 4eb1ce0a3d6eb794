"""Child processes that die with the process that started them, and lock files naming their holder.

:func:`start_guarded` runs a command under a small guard process (this file run as a script):

- the guard starts in a session of its own (one process group: ``os.killpg(guard.pid, ...)`` stops
  the whole tree, as ``generation/launch.py`` does on SIGTERM);
- before it runs, the kernel is told to send it SIGTERM when its starter dies, even by ``kill -9``
  (Linux ``prctl(PR_SET_PDEATHSIG)``); a starter already gone by then is noticed too;
- on SIGTERM, SIGINT or SIGHUP the guard SIGKILLs its whole process group: the command and every
  process the command started that stayed in the group (vLLM's engine processes), then itself;
- otherwise it waits for the command and exits with its status (128 + N for a signal N).

So a killed launcher leaves no shard behind: nothing keeps generating, holds GPU memory or later
overwrites a file of the rerun. This file imports only the standard library, so that it runs as
a script in either environment.

:func:`exclusive_lock` holds an ``fcntl.flock`` lock for a ``with`` block and writes the holder's
pid into the lock file; a second holder is refused with :class:`LockHeld` naming that pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GUARD = Path(__file__).resolve()


class LockHeld(RuntimeError):
    """Another process holds the lock; the message names the file and that process's pid."""


def _death_signal_setter(sig: int):
    """A ``preexec_fn`` that asks the kernel for ``sig`` when the parent dies (None off Linux).
    libc is loaded here, in the parent, so the forked child only makes the system call."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return preexec


def start_guarded(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Start ``cmd`` under the guard (see the module docstring) and return the guard's ``Popen``.

    ``popen_kwargs`` go to ``subprocess.Popen`` (``stdout``, ``stderr``, ``env``, ``cwd``...); the
    guard passes its stdio and environment on to ``cmd``. The guard's pid is its process group.
    """
    argv = [sys.executable, "-I", str(GUARD), str(os.getpid()), *cmd]  # -I: no sibling modules on sys.path
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_death_signal_setter(signal.SIGTERM),
                            **popen_kwargs)


def _kill_group(signum=None, frame=None) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the command, its children, and this guard


def guard(parent: int, cmd: Sequence[str]) -> int:
    """The guard's main: run ``cmd`` in this process group until it exits; kill the group on a
    stop signal or when ``parent`` is already gone. Returns the exit status to exit with."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _kill_group)
    if os.getppid() != parent:  # the starter died before the death signal was armed
        _kill_group()
    child = subprocess.Popen(list(cmd), preexec_fn=_death_signal_setter(signal.SIGKILL))  # dies if the guard does
    rc = child.wait()
    return 128 - rc if rc < 0 else rc


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block; the file
    holds the holder's pid. Released when the block ends or the process dies.

    Args:
        what: what the lock protects, for the message (e.g. ``"shard output runs/x/shard_00.jsonl"``).
    Raises:
        LockHeld: another process (or another open of the file here) holds it; names its pid.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise LockHeld(f"{path}: {what} is in use by pid {holder} (still running, e.g. left by a killed "
                           f"launcher). Stop it (kill {holder}) or let it finish, then rerun.") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


if __name__ == "__main__":
    raise SystemExit(guard(int(sys.argv[1]), sys.argv[2:]))
