"""``source=remote``: rewards from an HTTP reward service (client side).

Protocol (served by ``annotate_data/reward_server.py``; any service that speaks it will do):

- ``POST {url}/score`` with JSON ``{"prompts": [[{"role", "content"}, ...], ...], "responses": [str, ...]}``
  (one prompt message list per response, same length) -> ``200 {"rewards": [float | null, ...]}``,
  one reward per response in request order; ``null`` = that item could not be scored. A null,
  NaN, Infinity or non-number leaves that one response unscored (``null`` in ``rewards.jsonl``),
  counted by cause with example ids; the other responses of its prompt still count.
  Errors: ``4xx {"detail": "..."}`` for a bad request (not retried), ``5xx`` (retried).
- ``GET {url}/health`` -> ``200 {"status": "ok", "reward_model": "..."}``.
- When the environment variable ``REWARD_SERVER_TOKEN`` is set and not empty, every request
  carries ``Authorization: Bearer <token>`` (``annotate_data/reward_server.py`` then requires it).

The client sends ``batch_size`` items per request, waits at most ``timeout_s`` per request, and
retries connection errors, timeouts, 429 and 5xx ``retries`` times with exponential backoff
(``retry_backoff_s``, then 2x, 4x, ...). When the service stays unreachable it raises a
``ConfigError`` naming the URL.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from typing import Any, Optional

from .config import ConfigError
from .jsonl import DataError
from .stats import ScoreResult

MAX_EXAMPLES = 5  # example ids kept per cause in the stats


def post_json(url: str, payload: dict, timeout_s: float, retries: int, backoff_s: float,
              headers: Optional[dict] = None) -> Any:
    """POST ``payload`` as JSON to ``url`` and return the decoded JSON reply.

    Retries ``retries`` times (waiting ``backoff_s * 2**attempt`` s) on connection errors,
    timeouts, HTTP 429 and 5xx.

    Raises:
        ConfigError: still unreachable / failing after the retries (names the URL and last error).
        DataError: the service rejected the request (other 4xx) or replied with something that is not JSON.
    """
    import requests

    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            resp = requests.post(url, json=payload, timeout=timeout_s, headers=headers)
        except requests.exceptions.Timeout:
            last = f"no reply within timeout_s={timeout_s}"
            continue
        except requests.exceptions.ConnectionError as e:
            last = f"connection failed ({type(e).__name__})"
            continue
        if resp.status_code == 429 or resp.status_code >= 500:
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            continue
        if resp.status_code >= 400:
            raise DataError(f"{url} rejected the request: HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            return resp.json()
        except ValueError:
            raise DataError(f"{url} replied with non-JSON: {resp.text[:200]!r}") from None
    raise ConfigError(f"{url} is unreachable or failing after {retries + 1} attempts (last: {last}). "
                      "Is the service running at that address? Fix url=, or raise timeout_s / retries.")


def base_url(url: str, suffix: str) -> str:
    """``http://h:p/`` or ``http://h:p/score`` -> ``http://h:p`` (so either form can be configured)."""
    url = url.rstrip("/")
    return url[: -len(suffix)] if url.endswith(suffix) else url


def fetch_items(url: str, prompts: list[list[dict]], responses: list[str], batch_size: int, timeout_s: float,
                retries: int, backoff_s: float = 1.0) -> list[Any]:
    """The service's raw reward values for (prompt, response) items, ``batch_size`` items per request,
    as decoded from its JSON (numbers, ``None``, NaN/inf from ``NaN``/``Infinity``, or anything else).

    Raises:
        ConfigError: the service is unreachable (see :func:`post_json`).
        DataError: a reply without a ``rewards`` list of the right length.
    """
    endpoint = base_url(url, "/score") + "/score"
    headers = token_headers()
    out: list[Any] = []
    for s in range(0, len(responses), batch_size):
        p, r = prompts[s:s + batch_size], responses[s:s + batch_size]
        reply = post_json(endpoint, {"prompts": p, "responses": r}, timeout_s, retries, backoff_s, headers=headers)
        rw = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rw, list) or len(rw) != len(r):
            raise DataError(f"{endpoint}: expected {{\"rewards\": [{len(r)} numbers]}}, got {str(reply)[:200]}")
        out.extend(rw)
    return out


def unscored_cause(x: Any) -> Optional[str]:
    """Why a reward value cannot be used: ``"null"``, ``"nan"``, ``"inf"`` (either sign),
    ``"not_a_number"`` (text, a boolean, a list...); None for a finite number."""
    if x is None:
        return "null"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "not_a_number"
    if math.isnan(x):
        return "nan"
    return None if math.isfinite(x) else "inf"


def score_items(url: str, prompts: list[list[dict]], responses: list[str], batch_size: int, timeout_s: float,
                retries: int, backoff_s: float = 1.0) -> list[Optional[float]]:
    """Rewards of (prompt, response) items from the service at ``url``, ``batch_size`` items per request.

    Returns one float per item, ``None`` where the value cannot be used (see :func:`unscored_cause`).
    Raises ConfigError (unreachable) / DataError (bad reply: no ``rewards`` list of the right length).
    """
    raw = fetch_items(url, prompts, responses, batch_size, timeout_s, retries, backoff_s)
    return [None if unscored_cause(x) else float(x) for x in raw]


def score(records: list[dict], cfg) -> ScoreResult:
    """``source=remote``: one reward per response from the service at ``cfg.url``.

    Returns:
        :class:`~online_rlhf.stats.ScoreResult`: ``rewards[i]`` aligned with ``records[i]["responses"]``;
        a response the service gave null, NaN, inf or a non-number for is ``None`` there (the others
        still count). ``responses_unscored`` counts those by cause (``null``, ``nan``, ``inf``,
        ``not_a_number``) and ``examples[cause]`` names up to 5 as ``"<id> (response j)"``;
        ``source_stats`` = ``{"url", "requests"}``. No record is skipped.
    Raises:
        ConfigError / DataError: see :func:`fetch_items`.
    """
    items = [(ri, j) for ri, rec in enumerate(records) for j in range(len(rec["responses"]))]
    raw = fetch_items(cfg.url, [records[ri]["prompt"] for ri, _ in items],
                      [records[ri]["responses"][j] for ri, j in items], cfg.batch_size, cfg.timeout_s,
                      cfg.retries, cfg.retry_backoff_s)
    out: list[Optional[list[Optional[float]]]] = [[] for _ in records]
    causes: Counter = Counter()
    examples: dict[str, list[str]] = {}
    for (ri, j), x in zip(items, raw):
        cause = unscored_cause(x)
        out[ri].append(None if cause else float(x))
        if cause:
            causes[cause] += 1
            ex = examples.setdefault(cause, [])
            if len(ex) < MAX_EXAMPLES:
                ex.append(f"{records[ri]['id']} (response {j})")
    return ScoreResult(rewards=out, responses_unscored=causes, examples=examples,
                       source_stats={"url": cfg.url, "requests": math.ceil(len(items) / cfg.batch_size)})


def token_headers() -> dict:
    """Authorization header from ``REWARD_SERVER_TOKEN`` when set (the reward service's bearer token)."""
    key = os.environ.get("REWARD_SERVER_TOKEN", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def openai_headers() -> dict:
    """Authorization header from ``OPENAI_API_KEY`` when set (OpenAI-compatible servers that need one)."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}
