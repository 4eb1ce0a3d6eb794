"""Serve a local reward model over HTTP (the other end of ``source=remote``).

    python annotate_data/reward_server.py reward_model=DIR [host=127.0.0.1] [port=8000] [batch_size=8] [workers=auto]

The process is a front (FastAPI on uvicorn) that keeps the HTTP contract below, and a scoring
engine it starts on an internal 127.0.0.1 port: Mosec workers, one per core on CPU and one per GPU
(``online_rlhf/reward_engine.py``), which batch the items of requests that arrive together.
docs/reward-server.md has the design, the measurements, the vLLM alternative and a Kubernetes
example.

Endpoints (schema also in online_rlhf/remote.py):

- ``POST /score``: request ``{"prompts": [[{"role": "user", "content": "..."}, ...], ...],
  "responses": ["...", ...]}``, one prompt message list per response (same length, at most
  ``max_items`` items). Reply ``{"rewards": [float | null, ...]}``, one reward per response in
  request order; ``null`` when the reward model's chat template refused that conversation.
  A malformed request gets ``422``/``400`` with ``{"detail": ...}``; with a token set (below), a
  request without it gets ``401``. ``503`` with ``Retry-After`` when ``max_queue`` requests are
  already in the service, when the engine is not ready, or when a worker was lost while the
  request was in flight (the client retries 503).
- ``GET /health`` (liveness): ``200 {"status": "ok", "ready": bool, "reward_model": DIR, "dtype",
  "device", "engine": {...}}`` while the service can serve or is still loading; ``503`` with
  ``"status": "failed"`` and ``"detail"`` once the engine has exited.
- ``GET /ready`` (readiness): ``200 {"ready": true, ...}`` only after the engine is up and has
  scored a warm-up item through the whole path; else ``503 {"ready": false, "detail": why}``.

A ``/score`` request that arrives while the engine is still loading waits for it (it counts
towards ``max_queue``). Authentication: when the environment variable ``REWARD_SERVER_TOKEN`` is
set and not empty, ``/score`` needs ``Authorization: Bearer <token>`` (the client in
online_rlhf/remote.py sends it from the same variable); ``/health`` and ``/ready`` stay open for
probes. Binds to 127.0.0.1 by default; expose it (``host=0.0.0.0``) only with a token on a trusted
network. SIGTERM (and Ctrl-C): the service stops taking connections, answers the requests in
flight, then stops the engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator

from online_rlhf.config import ConfigError, StageConfig, bool_as_number_error, run_main
from online_rlhf.paths import setup_cache_env

TOKEN_ENV = "REWARD_SERVER_TOKEN"


class ServeConfig(StageConfig):
    """annotate_data/reward_server.py: an HTTP reward service around a local reward model."""

    reward_model: str = Field(..., min_length=1, description="AutoModelForSequenceClassification dir or Hub id (one label)")
    host: str = Field("127.0.0.1", description="bind address (127.0.0.1: this machine only; set REWARD_SERVER_TOKEN before exposing it)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    batch_size: int = Field(8, ge=1, description="items per reward model forward pass inside a worker (the items of merged requests, sorted by length)")
    max_length: int = Field(4096, ge=8, description="input budget in tokens; longer inputs lose prompt tokens from the left")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: the hardware's choice (online_rlhf.hardware.compute_dtype): bf16 on GPU (fp16 where bf16 is missing), on CPU bf16 only with native bf16, else fp32")
    max_items: int = Field(4096, ge=1, description="most (prompt, response) items accepted in one request")
    workers: Union[int, Literal["auto"]] = Field("auto", description="scoring worker processes; auto: one per GPU, else one per usable CPU core (each with cores/workers threads)")
    max_batch_requests: Union[int, Literal["auto"]] = Field("auto", description="most requests the engine merges into one worker call (dynamic batching); auto: 16 on GPU, 1 on CPU, where merging requests measured slower (docs/reward-server.md)")
    max_wait_ms: int = Field(10, ge=1, description="how long the engine waits for more requests before it hands a batch to a worker (ms)")
    max_queue: int = Field(128, ge=1, description="most /score requests in the service at once (waiting or being scored); beyond: 503 with Retry-After")
    retry_after_s: int = Field(1, ge=1, description="the Retry-After (s) of a 503")
    request_timeout_s: float = Field(600.0, gt=0, description="a request the engine has not answered by then gets 503 (s)")
    startup_timeout_s: float = Field(600.0, gt=0, description="longest wait for the engine to load the model and score the warm-up item (s)")
    engine_port: int = Field(0, ge=0, le=65535, description="the engine's internal port on 127.0.0.1 (0: a free one)")

    @field_validator("workers", "max_batch_requests", mode="before")
    @classmethod
    def _count_or_auto(cls, v: Any, info) -> Any:
        """One clear line for a count key: ``auto`` or a whole number >= 1."""
        if isinstance(v, bool):  # this runs before StageConfig's own bool check, so say the same
            raise bool_as_number_error(v, f"give auto or a whole number >= 1, e.g. {info.field_name}=2")
        if v == "auto" or (isinstance(v, int) and v >= 1):
            return v
        if isinstance(v, str) and v.strip().isdigit() and int(v) >= 1:
            return int(v)
        raise ValueError(f"give auto or a whole number >= 1, e.g. {info.field_name}=2")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ScoreRequest(BaseModel):
    prompts: list[list[Message]] = Field(..., description="one prompt (message list) per response")
    responses: list[str] = Field(..., description="the responses to score")


class ScoreReply(BaseModel):
    rewards: list[Optional[float]]


class EngineUnavailable(Exception):
    """The engine cannot answer this request now; the front replies 503 with Retry-After."""


class EngineError(Exception):
    """The engine failed on a request (a bug or a model error); the front replies 500."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_layout(workers: Union[int, str]) -> tuple[int, int, list[str]]:
    """(workers, torch threads per worker, CUDA_VISIBLE_DEVICES per worker or ``[]`` on CPU).

    ``auto``: one worker per visible GPU; without a GPU one per usable CPU core. Threads on CPU:
    :func:`online_rlhf.hardware.stage_threads` for that many processes (``OMP_NUM_THREADS`` wins).
    With more workers than GPUs the workers share them round-robin.
    """
    import torch

    from online_rlhf.hardware import stage_threads, usable_cores

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = (gpus or usable_cores()) if workers == "auto" else int(workers)
    if gpus:
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
                  [str(i) for i in range(gpus)]
        return n, 1, [visible[i % len(visible)] for i in range(n)]
    return n, stage_threads(n), []


def batch_requests_for(setting: Union[int, str], on_gpu: bool) -> int:
    """The ``max_batch_requests`` a setting means: an int as given; ``auto`` is 16 on GPU, 1 on CPU.

    On a GPU, merging requests is where the throughput comes from. On CPU one request's K items are
    already a forward pass of several hundred tokens per row, so merging gains no matrix-product
    efficiency, and it costs throughput when a worker takes most of the queue while the others wait
    (measured 2026-12-03, AMD EPYC AVX2, 2 workers x 1 thread, float32, 4-item requests: at 4 clients
    1.29 items/s with 1 request per call, 0.90 with up to 16; at 16 clients p99 54 s against 82 s;
    docs/reward-server.md). One request per call also makes every reward equal to the same request
    scored alone, bit for bit.
    """
    if setting == "auto":
        return 16 if on_gpu else 1
    return int(setting)


class MosecEngine:
    """The Mosec engine subprocess (``online_rlhf.reward_engine``) and an HTTP client to it.

    Args:
        spec: :func:`online_rlhf.reward_engine.engine_spec`.
        port: internal port on 127.0.0.1 (0: a free one).
        capacity: Mosec's queue capacity (its own 429 bound; the front's ``max_queue`` binds first).
        timeout_s: per-request limit, given to Mosec and to the front's wait.
        startup_timeout_s: longest wait in :meth:`start`.
        poll_s: how often the watchdog looks at the engine's processes.

    A watchdog notices when a worker process disappears (Mosec then starts a new one) and fails
    every request in flight at that moment with :class:`EngineUnavailable`: Mosec would hold the
    lost worker's requests until ``timeout_s``, and the front cannot tell which they were. The
    client retries them; no reply carries rewards that were not computed for it.
    """

    name = "mosec"

    def __init__(self, spec: dict, port: int = 0, capacity: int = 1024, timeout_s: float = 600.0,
                 startup_timeout_s: float = 600.0, poll_s: float = 0.2):
        self.spec, self.capacity, self.timeout_s = spec, capacity, timeout_s
        self.port = port or free_port()
        self.startup_timeout_s, self.poll_s = startup_timeout_s, poll_s
        self.proc: Optional[subprocess.Popen] = None
        self.problem: Optional[str] = None
        self.worker_pids: set[int] = set()
        self.workers_lost = 0
        self.requests_failed_by_lost_worker = 0
        self.batch_requests: dict[int, int] = {}  # n -> requests answered by a worker call that held n requests
        self._inflight: set[asyncio.Future] = set()
        self._watchdog: Optional[asyncio.Task] = None
        self.client = None

    # -- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine, wait until it answers, score the warm-up item, start the watchdog.

        Raises:
            EngineUnavailable: the engine exited, or was not up within ``startup_timeout_s``, or the
                warm-up item did not get a finite reward (the message says which).
        """
        import httpx

        from online_rlhf.reward_engine import ENV_SPEC, WARMUP_ITEM

        env = {**os.environ, ENV_SPEC: json.dumps(self.spec)}
        cmd = [sys.executable, "-c", "from online_rlhf.reward_engine import main; main()", "--address", "127.0.0.1",
               "--port", str(self.port), "--timeout", str(int(self.timeout_s * 1000)),
               "--capacity", str(self.capacity), "--log-level", "warning"]
        # Own session (process group): a Ctrl-C in the terminal reaches the front only, which drains, then
        # stops the engine; the engine ends itself when the front is gone (reward_engine.main).
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=self.timeout_s + 5,
                                        limits=httpx.Limits(max_connections=self.capacity, max_keepalive_connections=64))
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"the scoring engine exited with code {self.proc.returncode} while starting; "
                                        "its log above says why (a bad reward_model, out of memory, ...)")
            try:
                if (await self.client.get("/", timeout=2)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the scoring engine did not answer within startup_timeout_s="
                                        f"{self.startup_timeout_s}")
            await asyncio.sleep(0.2)
        self.worker_pids = set(self._live_workers())
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        left = max(1.0, deadline - time.monotonic())
        try:
            rewards = await asyncio.wait_for(self.score(WARMUP_ITEM), timeout=left)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the warm-up item was not scored within startup_timeout_s="
                                    f"{self.startup_timeout_s}") from None
        except EngineError as e:
            raise EngineUnavailable(f"the warm-up item failed: {e}") from None
        if not (len(rewards) == 1 and isinstance(rewards[0], float) and math.isfinite(rewards[0])):
            raise EngineUnavailable(f"the warm-up item got {rewards!r}, not one finite reward")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop the watchdog and the engine: SIGTERM, then SIGKILL to its whole process group after
        ``grace_s``. The front calls this after it has answered its requests in flight; what Mosec may
        still hold then is work for requests already answered 503 (a lost worker's), so nothing is lost."""
        if self._watchdog:
            self._watchdog.cancel()
        if self.client is not None:
            await self.client.aclose()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            deadline = time.monotonic() + grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        try:  # the Rust server and the workers too, whether or not the manager exited cleanly
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)

    def _live_workers(self) -> list[int]:
        """Pids of the engine's worker processes that are alive (Mosec spawns them)."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []
        out = []
        for p in kids:
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                    out.append(p.pid)
            except psutil.Error:
                continue
        return out

    def _fail_inflight(self, reason: str) -> None:
        for fut in list(self._inflight):
            if not fut.done():
                fut.set_result(reason)
                self.requests_failed_by_lost_worker += 1

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if self.proc.poll() is not None:
                self.problem = (f"the scoring engine exited with code {self.proc.returncode} (all its workers died, "
                                "or it was killed); restart the service")
                self._fail_inflight(self.problem)
                return
            live = set(self._live_workers())
            lost = self.worker_pids - live
            if lost:
                self.workers_lost += len(lost)
                self._fail_inflight(f"scoring worker(s) {sorted(lost)} exited while this request was in flight; "
                                    "the engine starts a new one; retry")
            self.worker_pids = live

    # -- scoring -------------------------------------------------------------------------------
    async def score(self, payload: dict) -> list:
        """Rewards for a validated request ``{"prompts", "responses"}``: one value per response.

        Raises:
            EngineUnavailable: the engine has exited, is unreachable, timed out, is over its
                capacity, or lost a worker while this request was in flight.
            EngineError: the engine answered with an error, or with the wrong number of rewards.
        """
        import httpx

        if self.problem:
            raise EngineUnavailable(self.problem)
        lost = asyncio.get_running_loop().create_future()
        self._inflight.add(lost)
        call = asyncio.ensure_future(self.client.post("/score", content=json.dumps(payload).encode()))
        try:
            done, _ = await asyncio.wait({call, lost}, timeout=self.timeout_s + 5, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._inflight.discard(lost)
            if not call.done():
                call.cancel()
        if lost in done:
            raise EngineUnavailable(lost.result())
        if not done:
            raise EngineUnavailable(f"no reply from the scoring engine within request_timeout_s={self.timeout_s}")
        try:
            resp = call.result()
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"the scoring engine is unreachable ({type(e).__name__})") from None
        if resp.status_code in (408, 429, 503):
            raise EngineUnavailable(f"the scoring engine answered HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code != 200:
            raise EngineError(f"the scoring engine answered HTTP {resp.status_code}: {resp.text[:300]}")
        body = resp.json()
        rewards = body.get("rewards")
        if not isinstance(rewards, list) or len(rewards) != len(payload["responses"]):
            raise EngineError(f"the scoring engine gave {rewards!r:.200} for {len(payload['responses'])} responses")
        n = int(body.get("batch_requests", 1))
        self.batch_requests[n] = self.batch_requests.get(n, 0) + 1
        return rewards

    def status(self) -> dict:
        """What /health shows about the engine."""
        return {"name": self.name, "pid": self.proc.pid if self.proc else None, "workers": self.spec["workers"],
                "workers_alive": sorted(self.worker_pids), "workers_lost": self.workers_lost,
                "requests_failed_by_lost_worker": self.requests_failed_by_lost_worker,
                "max_batch_requests": self.spec["max_batch_requests"], "batch_size": self.spec["batch_size"],
                "requests_by_batch_requests": {str(k): v for k, v in sorted(self.batch_requests.items())}}


class BearerAuth:
    """ASGI middleware: ``POST /score`` needs ``Authorization: Bearer <token>`` (else 401), checked
    before the body is read; other paths pass. The scheme name is case-insensitive (RFC 7235); the
    token is compared in constant time."""

    def __init__(self, app, token: str):
        self.app, self.expected = app, token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/") == "/score":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, given = got.strip().partition(b" ")
            bearer = scheme.lower() == b"bearer"
            if not bearer or not secrets.compare_digest(given.strip(), self.expected):
                why = ("no Authorization header" if not got else "a wrong token" if bearer
                       else "another scheme than Bearer, or no scheme")
                body = json.dumps({"detail": f"this service needs 'Authorization: Bearer <token>' ({why} was sent); "
                                             f"set {TOKEN_ENV} on the client to the service's token"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(engine, max_items: int, max_queue: int = 128, retry_after_s: int = 1, token: Optional[str] = None,
              info: Optional[dict] = None, startup_timeout_s: float = 600.0, on_start_failure=None):
    """The FastAPI front around ``engine`` (a :class:`MosecEngine` or anything with its ``start``,
    ``stop``, ``score``, ``status`` and ``problem``).

    Args:
        engine: the scoring engine; started in the background when the app starts, stopped when it stops.
        max_items: most items in one request (400 beyond).
        max_queue: most /score requests in the service at once (503 + Retry-After beyond).
        retry_after_s: the Retry-After of every 503.
        token: bearer token for /score (None or "": no authentication).
        info: extra keys for /health (reward_model, dtype, device).
        startup_timeout_s: how long a request that arrives during start-up waits for readiness.
        on_start_failure: called with the reason when the engine fails to start (the CLI stops the server).
    Returns:
        a FastAPI app (wrapped in :class:`BearerAuth` when ``token`` is set).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse

    state: dict[str, Any] = {"ready": False, "started": None, "start_problem": None, "in_service": 0, "rejected_full": 0,
                             "served": 0}

    async def _start():
        try:
            await engine.start()
            state["ready"] = True
        except Exception as e:  # EngineUnavailable, or anything unexpected while starting
            state["start_problem"] = str(e) if isinstance(e, EngineUnavailable) else f"{type(e).__name__}: {e}"
            print(f"reward_server: the scoring engine did not start: {state['start_problem']}", file=sys.stderr)
            if on_start_failure:
                on_start_failure(state["start_problem"])
        finally:
            state["started"].set()

    @asynccontextmanager
    async def lifespan(app):
        state["started"] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(_start())
        try:
            yield
        finally:  # uvicorn has stopped taking connections and answered the requests in flight
            print(f"reward_server: shutting down (requests in flight answered; {state['served']} scored in all); "
                  "stopping the scoring engine", file=sys.stderr)
            if not task.done():
                task.cancel()
            await engine.stop()
            print("reward_server: stopped", file=sys.stderr)

    app = FastAPI(title="reward model service", lifespan=lifespan)

    def problem() -> Optional[str]:
        return state["start_problem"] or engine.problem

    def unavailable(detail: str) -> HTTPException:
        return HTTPException(503, detail, headers={"Retry-After": str(retry_after_s)})

    @app.get("/health")
    def health():
        p = problem()
        body = {"status": "failed" if p else "ok", "ready": state["ready"] and not p, **(info or {}),
                "engine": engine.status(), "requests_in_service": state["in_service"],
                "requests_rejected_queue_full": state["rejected_full"]}
        if p:
            body["detail"] = p
        return JSONResponse(body, status_code=503 if p else 200)

    @app.get("/ready")
    def ready():
        p = problem()
        if state["ready"] and not p:
            return {"ready": True, **(info or {})}
        return JSONResponse({"ready": False, "detail": p or "loading the reward model and scoring a warm-up item"},
                            status_code=503)

    @app.post("/score", response_model=ScoreReply)
    async def score(req: ScoreRequest) -> ScoreReply:
        if len(req.prompts) != len(req.responses):
            raise HTTPException(400, f"{len(req.prompts)} prompts but {len(req.responses)} responses; send one prompt per response.")
        if len(req.responses) > max_items:
            raise HTTPException(400, f"{len(req.responses)} items in one request; this server takes at most {max_items}. "
                                     f"Send at most {max_items} per request (the loop's client: reward.batch_size="
                                     f"{max_items} or less), or start the service with max_items={len(req.responses)}.")
        prompts = [[m.model_dump() for m in p] for p in req.prompts]
        if any(not p for p in prompts):
            raise HTTPException(400, "every prompt needs at least one message.")
        if state["in_service"] >= max_queue:
            state["rejected_full"] += 1
            raise unavailable(f"{max_queue} requests are already in the service (max_queue); retry after {retry_after_s} s.")
        state["in_service"] += 1
        try:
            if not state["ready"]:
                try:
                    await asyncio.wait_for(state["started"].wait(), timeout=startup_timeout_s)
                except asyncio.TimeoutError:
                    raise unavailable("the reward model is still loading; retry later.") from None
            if problem():
                raise unavailable(problem())
            rewards = await engine.score({"prompts": prompts, "responses": req.responses})
        except EngineUnavailable as e:
            raise unavailable(str(e)) from None
        except EngineError as e:
            raise HTTPException(500, str(e)) from None
        finally:
            state["in_service"] -= 1
        state["served"] += 1
        return ScoreReply(rewards=rewards)

    return BearerAuth(app, token) if token else app


def main(cfg: ServeConfig) -> None:
    setup_cache_env()
    import uvicorn

    from online_rlhf.hardware import compute_dtype
    from online_rlhf.paths import REWARD_MODEL_HINT, resolve_model
    from online_rlhf.reward_engine import engine_spec

    if cfg.reward_model == "default":
        raise ConfigError("reward_model=default is the embedded policy (a causal LM), not a reward model. Give a "
                          "reward model folder or Hub id; to try the service offline, docs/reward-server.md shows how "
                          "to save a tiny random one.")
    path = resolve_model(cfg.reward_model, hint=REWARD_MODEL_HINT)  # a missing dir: exit 2 before anything starts
    if Path(path).is_dir():  # a folder that is not a one-label classifier fails here, not in every worker
        from online_rlhf.reward_model import check_reward_model_config

        check_reward_model_config(path)
    n, threads, devices = worker_layout(cfg.workers)
    device = "cuda" if devices else "cpu"
    merge = batch_requests_for(cfg.max_batch_requests, on_gpu=bool(devices))
    spec = engine_spec(path, cfg.dtype, cfg.max_length, cfg.batch_size, n, threads, devices, merge, cfg.max_wait_ms,
                       cfg.request_timeout_s)
    engine = MosecEngine(spec, port=cfg.engine_port, capacity=cfg.max_queue + 16, timeout_s=cfg.request_timeout_s,
                         startup_timeout_s=cfg.startup_timeout_s)
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not token:
        print(f"warning: reward_server listens on {cfg.host} without authentication; set {TOKEN_ENV} to require a "
              "bearer token.", file=sys.stderr)
    failure: list[str] = []
    server: Optional[uvicorn.Server] = None

    def stop_on_failure(reason: str) -> None:
        failure.append(reason)
        server.should_exit = True

    info = {"reward_model": path, "dtype": compute_dtype(device, cfg.dtype), "device": device}
    app = build_app(engine, cfg.max_items, cfg.max_queue, cfg.retry_after_s, token, info, cfg.startup_timeout_s,
                    on_start_failure=stop_on_failure)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           timeout_graceful_shutdown=int(cfg.request_timeout_s)))
    print(f"reward_server: {cfg.reward_model} on http://{cfg.host}:{cfg.port} (POST /score, GET /health, GET /ready); "
          f"engine: mosec, {n} worker(s) on {device}" + (f", {threads} thread(s) each" if device == "cpu" else "")
          + (", bearer token required" if token else ""), file=sys.stderr)
    server.run()
    if failure:
        raise ConfigError(f"reward_server: {failure[0]}")


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(main, ServeConfig)


if __name__ == "__main__":
    cli()
