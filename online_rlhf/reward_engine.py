"""The scoring engine behind the reward service: Mosec workers that batch items across requests.

``annotate_data/reward_server.py`` (the front, ``online_rlhf/stages/reward_server.py``) keeps the
HTTP contract of ``source=remote`` and starts this engine as a subprocess on an internal
127.0.0.1 port. Mosec (https://mosecorg.github.io/mosec/, the serving library OAT uses for its
reward oracle) runs a Rust HTTP server and ``workers`` Python processes; its dynamic batching
hands one worker up to ``max_batch_requests`` requests that arrived within ``max_wait_ms`` of each
other. The worker scores all their items in one :meth:`RewardModel.score` call (sorted-length
batches of ``batch_size`` items) and splits the rewards back per request, in request order.

The engine takes requests the front has already validated: ``{"prompts": [[messages], ...],
"responses": [str, ...]}`` of equal length, at least one message per prompt. A reply is
``{"rewards": [float | null, ...], "worker_pid": int, "batch_requests": int}`` (``batch_requests``:
how many requests shared that worker call). Mosec restarts a worker process that
dies while another worker of the stage is alive; when every worker is dead it exits.

The engine's settings come as JSON in the environment variable :data:`ENV_SPEC` (keys of
:func:`engine_spec`); Mosec's own flags (``--address``, ``--port``, ``--timeout`` in ms,
``--capacity``, ``--log-level``) come on the command line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ENV_SPEC = "ONLINE_RLHF_REWARD_ENGINE"
WARMUP_ITEM = {"prompts": [[{"role": "user", "content": "Warm-up: what is 1 plus 1?"}]], "responses": ["2"]}


def engine_spec(reward_model: str, dtype: str, max_length: int, batch_size: int, workers: int, threads: int,
                devices: list[str], max_batch_requests: int, max_wait_ms: int, timeout_s: float) -> dict:
    """The JSON-able settings the engine subprocess reads from :data:`ENV_SPEC`.

    Args:
        reward_model: checkpoint dir or Hub id (``online_rlhf.reward_model.RewardModel``).
        dtype, max_length: as ``RewardModel``.
        batch_size: items per forward pass inside a worker.
        workers: worker processes (>= 1).
        threads: torch threads per worker (CPU).
        devices: one ``CUDA_VISIBLE_DEVICES`` value per worker, or ``[]`` on CPU.
        max_batch_requests: most requests Mosec merges into one worker call.
        max_wait_ms: how long Mosec waits for more requests before a batch is handed on (ms).
        timeout_s: longest one worker call may take before Mosec fails its requests (s).
    Raises:
        ValueError: ``devices`` given but not one per worker.
    """
    if devices and len(devices) != workers:
        raise ValueError(f"{len(devices)} devices for {workers} workers; give one device per worker.")
    return {"reward_model": reward_model, "dtype": dtype, "max_length": max_length, "batch_size": batch_size,
            "workers": workers, "threads": threads, "devices": devices, "max_batch_requests": max_batch_requests,
            "max_wait_ms": max_wait_ms, "timeout_s": timeout_s}


def split_rewards(rewards: list, counts: list[int]) -> list[list]:
    """Cut the flat reward list of a merged batch back into one list per request.

    Args:
        rewards: one value per item, the items of request 0 first, then request 1, ...
        counts: items of each request.
    Returns:
        ``len(counts)`` lists; list ``i`` holds request ``i``'s ``counts[i]`` rewards in its order.
    Raises:
        ValueError: ``sum(counts) != len(rewards)``.
    """
    if sum(counts) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards for {sum(counts)} items; the merged batch lost or gained items.")
    out, s = [], 0
    for n in counts:
        out.append(list(rewards[s:s + n]))
        s += n
    return out


def _worker_class():
    """The Mosec worker class (built here so that importing this module needs no Mosec)."""
    from mosec import Worker

    class RewardWorker(Worker):
        """One Mosec worker process: loads the reward model once, scores merged batches of requests."""

        example = [WARMUP_ITEM]  # Mosec runs forward(example) once before the worker takes requests

        def __init__(self):
            super().__init__()
            import torch

            from online_rlhf.paths import setup_cache_env
            from online_rlhf.reward_model import RewardModel

            setup_cache_env()
            spec = json.loads(os.environ[ENV_SPEC])
            device = "cuda" if spec["devices"] else "cpu"
            if device == "cpu":
                torch.set_num_threads(spec["threads"])
            self.batch_size = spec["batch_size"]
            self.rm = RewardModel(spec["reward_model"], dtype=spec["dtype"], device=device,
                                  max_length=spec["max_length"])
            self.pid = os.getpid()

        def forward(self, data):
            if isinstance(data, dict):  # max_batch_requests=1: Mosec hands over the request itself, not a list
                return self.forward([data])[0]
            prompts = [p for req in data for p in req["prompts"]]
            responses = [r for req in data for r in req["responses"]]
            rewards, _ = self.rm.score(prompts, responses, batch_size=self.batch_size)
            return [{"rewards": r, "worker_pid": self.pid, "batch_requests": len(data)}
                    for r in split_rewards(rewards, [len(req["responses"]) for req in data])]

        def serialize(self, data: Any) -> bytes:  # compact JSON (Mosec's default indents)
            return json.dumps(data, separators=(",", ":")).encode()

    return RewardWorker


def __getattr__(name):  # the worker processes unpickle ``online_rlhf.reward_engine.RewardWorker``
    if name == "RewardWorker":
        return _cached_worker()
    raise AttributeError(name)


_CACHE: dict = {}


def _cached_worker():
    if "cls" not in _CACHE:
        cls = _worker_class()
        cls.__module__, cls.__qualname__ = __name__, "RewardWorker"
        _CACHE["cls"] = cls
    return _CACHE["cls"]


def _end_when_orphaned(poll_s: float = 1.0) -> None:
    """A daemon thread: once the parent (the front) is gone, SIGKILL this process group (the
    manager, Mosec's Rust server, the workers), so a killed front leaves no engine behind."""
    import signal
    import threading
    import time

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(os.getpid(), signal.SIGKILL)

    if os.getpgid(0) != os.getpid():  # not a group leader (started by hand): nothing of ours to end as a group
        return

    threading.Thread(target=watch, daemon=True, name="end-when-orphaned").start()


def main() -> None:
    """Entry of the engine subprocess: ``python -c 'from online_rlhf.reward_engine import main; main()'
    --address 127.0.0.1 --port P --timeout MS --capacity N`` with :data:`ENV_SPEC` set, started
    in its own process group by the front."""
    from mosec import Server

    _end_when_orphaned()
    spec = json.loads(os.environ[ENV_SPEC])
    n = spec["workers"]
    if spec["devices"]:
        env = [{"CUDA_VISIBLE_DEVICES": d} for d in spec["devices"]]
    else:
        env = [{"OMP_NUM_THREADS": str(spec["threads"])} for _ in range(n)]
    server = Server()
    server.append_worker(_cached_worker(), num=n, max_batch_size=spec["max_batch_requests"],
                         max_wait_time=spec["max_wait_ms"], env=env, timeout=spec["timeout_s"], route="/score")
    print(f"reward engine: mosec, {n} worker(s), up to {spec['max_batch_requests']} requests per batch",
          file=sys.stderr)
    server.run()
