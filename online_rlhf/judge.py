"""``source=judge``: pairwise LLM-as-judge through an OpenAI-compatible chat endpoint.

For each prompt with K responses, every unordered pair (i, j) is shown to the judge twice, once
as (A=i, B=j) and once as (A=j, B=i), so a judge that prefers whichever answer comes first (or
second) gives a tie rather than a preference. The reward of response i is its win rate:

    reward_i = (wins_i + 0.5 * ties_i) / (2 * (K - 1))      in [0, 1]

over its 2(K-1) comparisons. Identical responses tie without asking. A reply with no readable
verdict counts as a tie and is counted in the stats (``unparsed_verdicts``).

Endpoint: ``POST {url}/chat/completions`` with ``{"model", "messages", "temperature": 0,
"max_tokens"}`` (e.g. a vLLM server: ``url=http://127.0.0.1:8001/v1``); the verdict is read from
``choices[0].message.content``. ``OPENAI_API_KEY`` is sent as a bearer token when set. Requests
run ``judge_concurrency`` at a time; each is retried like the remote source (see remote.py).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .jsonl import DataError
from .remote import base_url, openai_headers, post_json

JUDGE_SYSTEM = (
    "You are an impartial judge. You compare two responses written by AI assistants to the same "
    "conversation and decide which one better serves the user: it follows the user's instructions "
    "(including any format or length constraints), and it is correct, helpful and harmless. The order in "
    "which the responses are shown, their length and their style must not sway you. Explain briefly if "
    "needed, then end your reply with your verdict: [[A]] if Response A is better, [[B]] if Response B is better."
)

_VERDICT = re.compile(r"\[\[\s*(A|B|tie)\s*\]\]", re.IGNORECASE)


def render_conversation(prompt: list[dict]) -> str:
    """Messages as plain text for the judge: one ``Role: content`` block per turn."""
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt)


def judge_messages(prompt: list[dict], a: str, b: str) -> list[dict]:
    """The chat messages asking the judge to compare response ``a`` (shown as A) with ``b`` (B)."""
    user = (f"[Conversation]\n{render_conversation(prompt)}\n\n"
            f"[Response A]\n{a}\n\n[Response B]\n{b}\n\n"
            "Which response is better? End your reply with [[A]] or [[B]].")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def parse_verdict(text: str) -> Optional[str]:
    """``"A"``, ``"B"``, ``"tie"`` from the judge's reply (the last ``[[...]]`` wins; a bare ``A``/``B``
    reply is accepted), or None when there is no readable verdict."""
    found = _VERDICT.findall(text or "")
    if found:
        v = found[-1]
        return "tie" if v.lower() == "tie" else v.upper()
    bare = (text or "").strip().strip(".").strip()
    return bare.upper() if bare.upper() in ("A", "B") else None


def win_rates(k: int, outcomes: dict[tuple[int, int], list[Optional[str]]]) -> list[float]:
    """Win rate of each of ``k`` responses.

    Args:
        outcomes: ``{(i, j): [verdict, ...]}`` where each verdict says which of (i as A, j as B)
            won: ``"A"`` (i), ``"B"`` (j), ``"tie"`` or None (unreadable, counted as a tie). The
            reversed order of a pair is stored under the key ``(j, i)``.
    Returns:
        ``k`` floats in [0, 1]: (wins + 0.5 ties) / comparisons of that response.
    """
    points = [0.0] * k
    games = [0] * k
    for (i, j), verdicts in outcomes.items():
        for v in verdicts:
            games[i] += 1
            games[j] += 1
            if v == "A":
                points[i] += 1.0
            elif v == "B":
                points[j] += 1.0
            else:
                points[i] += 0.5
                points[j] += 0.5
    return [p / g if g else 0.5 for p, g in zip(points, games)]


def score(records: list[dict], cfg) -> tuple[list[Optional[list[float]]], dict]:
    """``source=judge``: win rate of each response in pairwise, both-order comparisons.

    Records with a single response cannot be compared: None, counted as ``single_response``.
    Makes K(K-1) requests per record (fewer when responses repeat).

    Raises:
        ConfigError: the endpoint stays unreachable (names the URL).
        DataError: a reply without ``choices[0].message.content``.
    """
    endpoint = base_url(cfg.url, "/chat/completions") + "/chat/completions"
    headers = openai_headers()
    jobs = []  # (record index, i, j): i shown as A, j as B
    for ri, rec in enumerate(records):
        resp = rec["responses"]
        for i in range(len(resp)):
            for j in range(len(resp)):
                if i != j and resp[i] != resp[j]:
                    jobs.append((ri, i, j))

    def ask(job):
        ri, i, j = job
        rec = records[ri]
        payload = {"model": cfg.judge_model, "temperature": 0.0, "max_tokens": cfg.judge_max_tokens,
                   "messages": judge_messages(rec["prompt"], rec["responses"][i], rec["responses"][j])}
        reply = post_json(endpoint, payload, cfg.timeout_s, cfg.retries, cfg.retry_backoff_s, headers=headers)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise DataError(f"{endpoint}: reply has no choices[0].message.content: {str(reply)[:200]}") from None
        return parse_verdict(text)

    with ThreadPoolExecutor(max_workers=cfg.judge_concurrency) as pool:
        verdicts = list(pool.map(ask, jobs))

    outcomes: list[dict] = [{} for _ in records]
    for (ri, i, j), v in zip(jobs, verdicts):
        outcomes[ri].setdefault((i, j), []).append(v)
    identical = 0
    out: list[Optional[list[float]]] = []
    for ri, rec in enumerate(records):
        k = len(rec["responses"])
        if k < 2:
            out.append(None)
            continue
        for i in range(k):
            for j in range(k):
                if i != j and rec["responses"][i] == rec["responses"][j]:
                    outcomes[ri].setdefault((i, j), []).append("tie")
                    identical += 1
        out.append(win_rates(k, outcomes[ri]))
    n_single = sum(r is None for r in out)
    stats = {"skipped": {"single_response": n_single} if n_single else {}, "url": cfg.url,
             "judge_model": cfg.judge_model, "requests": len(jobs),
             "unparsed_verdicts": sum(v is None for v in verdicts),
             "identical_pairs_not_asked": identical // 2,
             "position_agreement": _position_agreement(jobs, verdicts)}
    return out, stats


def _position_agreement(jobs, verdicts) -> Optional[float]:
    """Share of pairs whose two orders agree on the winner (1.0: no position bias seen)."""
    by = {(ri, i, j): v for (ri, i, j), v in zip(jobs, verdicts)}
    agree = total = 0
    for (ri, i, j), v in by.items():
        if i < j and (ri, j, i) in by:
            w = by[(ri, j, i)]
            total += 1
            agree += (v == "A" and w == "B") or (v == "B" and w == "A")
    return agree / total if total else None
