"""Serve a local reward model over HTTP (the other end of ``source=remote``).

    python annotate_data/reward_server.py reward_model=DIR [host=127.0.0.1] [port=8000] [batch_size=8]

Endpoints (schema also in online_rlhf/remote.py):

- ``POST /score``: request ``{"prompts": [[{"role": "user", "content": "..."}, ...], ...],
  "responses": ["...", ...]}``, one prompt message list per response (same length, at most
  ``max_items`` items). Reply ``{"rewards": [float | null, ...]}``, one reward per response in
  request order; ``null`` when the reward model's chat template refused that conversation.
  A malformed request gets ``422``/``400`` with ``{"detail": ...}``.
- ``GET /health``: ``{"status": "ok", "reward_model": DIR, "dtype": ..., "device": ...}``.

Binds to 127.0.0.1 by default: the service has no authentication, so expose it
(``host=0.0.0.0``) only on a trusted network. Requests are scored one at a time (a lock around
the model); each request is batched internally with the reward model's sorted-length batching.
"""

from __future__ import annotations

import sys
import threading
from typing import Literal, Optional

from pydantic import BaseModel, Field

from online_rlhf.config import StageConfig, run_main
from online_rlhf.paths import setup_cache_env


class ServeConfig(StageConfig):
    """annotate_data/reward_server.py: an HTTP reward service around a local reward model."""

    reward_model: str = Field(..., description="AutoModelForSequenceClassification dir or Hub id (one label)")
    host: str = Field("127.0.0.1", description="bind address (127.0.0.1: this machine only; the service has no auth)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    batch_size: int = Field(8, ge=1, description="reward model batch size inside one request")
    max_length: int = Field(4096, ge=8, description="input budget in tokens; longer inputs lose prompt tokens from the left")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: the hardware's choice (online_rlhf.hardware.compute_dtype): bf16 on GPU (fp16 where bf16 is missing), on CPU bf16 only with native bf16, else fp32")
    max_items: int = Field(4096, ge=1, description="most (prompt, response) items accepted in one request")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ScoreRequest(BaseModel):
    prompts: list[list[Message]] = Field(..., description="one prompt (message list) per response")
    responses: list[str] = Field(..., description="the responses to score")


class ScoreReply(BaseModel):
    rewards: list[Optional[float]]


def build_app(rm, batch_size: int, max_items: int):
    """FastAPI app scoring with ``rm`` (an ``online_rlhf.reward_model.RewardModel``)."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="reward model service")
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "reward_model": rm.path, "dtype": str(rm.dtype).replace("torch.", ""),
                "device": str(rm.device)}

    @app.post("/score", response_model=ScoreReply)
    def score(req: ScoreRequest) -> ScoreReply:  # plain def: FastAPI runs it in a worker thread
        if len(req.prompts) != len(req.responses):
            raise HTTPException(400, f"{len(req.prompts)} prompts but {len(req.responses)} responses; send one prompt per response.")
        if len(req.responses) > max_items:
            raise HTTPException(400, f"{len(req.responses)} items in one request; this server takes at most {max_items}.")
        prompts = [[m.model_dump() for m in p] for p in req.prompts]
        if any(not p for p in prompts):
            raise HTTPException(400, "every prompt needs at least one message.")
        with lock:
            rewards, _ = rm.score(prompts, req.responses, batch_size=batch_size)
        return ScoreReply(rewards=rewards)

    return app


def main(cfg: ServeConfig) -> None:
    setup_cache_env()
    import uvicorn

    from online_rlhf.reward_model import RewardModel

    rm = RewardModel(cfg.reward_model, dtype=cfg.dtype, max_length=cfg.max_length)
    app = build_app(rm, cfg.batch_size, cfg.max_items)
    print(f"reward_server: {cfg.reward_model} on http://{cfg.host}:{cfg.port} (POST /score, GET /health)", file=sys.stderr)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(main, ServeConfig)


if __name__ == "__main__":
    cli()
