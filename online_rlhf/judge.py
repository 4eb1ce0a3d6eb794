"""``source=judge``: pairwise LLM-as-judge through an OpenAI-compatible chat endpoint.

For each prompt with K responses, every unordered pair (i, j) is shown to the judge twice, once
as (A=i, B=j) and once as (A=j, B=i), so a judge that prefers whichever answer comes first (or
second) gives a tie rather than a preference. The reward of response i is its win rate:

    reward_i = (wins_i + 0.5 * ties_i) / (2 * (K - 1))      in [0, 1]

over the comparisons it got a verdict in (2(K-1) when every reply was read). Identical responses
tie without asking. A reply with no verdict, or with two different ones (``[[B]] ... [[A]]``), is
unparsable: counted (``unparsed_verdicts``), never scored. A request that fails (no reply after the
retries, an HTTP error, a reply without a message) is counted too (``failed_calls``) and never
scored; only when every request fails does the stage stop, naming the endpoint. A response with
no scored comparison left gets ``null`` as its reward (``responses_unscored``); the stats list up
to five example ids per cause (``examples``).

Endpoint: ``POST {url}/chat/completions`` with ``{"model", "messages", "temperature": 0,
"max_tokens"}`` (e.g. a vLLM server: ``url=http://127.0.0.1:8001/v1``); the verdict is read from
``choices[0].message.content``. ``OPENAI_API_KEY`` is sent as a bearer token when set. Requests
run ``judge_concurrency`` at a time; each is retried like the remote source (see remote.py).
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from .config import ConfigError
from .jsonl import DataError
from .remote import base_url, openai_headers, post_json
from .stats import ScoreResult

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
    """The judge's verdict in ``text``.

    Returns:
        ``"A"``, ``"B"`` or ``"tie"`` when the reply's ``[[...]]`` markers all name the same verdict
        (a bare ``A``/``B`` reply is accepted too); None when it is unparsable: no verdict, or two
        different ones (e.g. ``Verdict: [[B]]`` followed by ``I would have said [[A]]``).
    """
    found = {("tie" if v.lower() == "tie" else v.upper()) for v in _VERDICT.findall(text or "")}
    if found:
        return found.pop() if len(found) == 1 else None
    bare = (text or "").strip().strip(".").strip()
    return bare.upper() if bare.upper() in ("A", "B") else None


MAX_EXAMPLES = 5  # example ids kept per cause in the stats
FAILED = "failed"  # the verdict slot of a request that got no usable reply


def win_rates(k: int, outcomes: dict[tuple[int, int], list[Optional[str]]]) -> list[Optional[float]]:
    """Win rate of each of ``k`` responses.

    Args:
        outcomes: ``{(i, j): [verdict, ...]}`` where each verdict says which of (i as A, j as B)
            won: ``"A"`` (i), ``"B"`` (j) or ``"tie"``; None (unparsable) and ``"failed"`` (no
            reply) are not scored. The reversed order of a pair is stored under the key ``(j, i)``.
    Returns:
        ``k`` values: (wins + 0.5 ties) / scored comparisons of that response, in [0, 1]; None for
        a response without any scored comparison.
    """
    points = [0.0] * k
    games = [0] * k
    for (i, j), verdicts in outcomes.items():
        for v in verdicts:
            if v not in ("A", "B", "tie"):
                continue
            games[i] += 1
            games[j] += 1
            if v == "A":
                points[i] += 1.0
            elif v == "B":
                points[j] += 1.0
            else:
                points[i] += 0.5
                points[j] += 0.5
    return [p / g if g else None for p, g in zip(points, games)]


def _jobs(records: list[dict]) -> list[tuple[int, int, int]]:
    """Every ordered pair of different texts per record: (record index, i shown as A, j as B)."""
    return [(ri, i, j) for ri, rec in enumerate(records) for i, a in enumerate(rec["responses"])
            for j, b in enumerate(rec["responses"]) if i != j and a != b]


def _ask(endpoint: str, headers: dict, cfg, rec: dict, i: int, j: int) -> tuple[Optional[str], Optional[str]]:
    """One judge request. Returns ``(verdict, error)``: the parsed verdict (None: unparsable), or
    ``("failed", message)`` when the request failed after its retries or the reply has no message."""
    payload = {"model": cfg.judge_model, "temperature": 0.0, "max_tokens": cfg.judge_max_tokens,
               "messages": judge_messages(rec["prompt"], rec["responses"][i], rec["responses"][j])}
    reply = None
    try:
        reply = post_json(endpoint, payload, cfg.timeout_s, cfg.retries, cfg.retry_backoff_s, headers=headers)
        text = reply["choices"][0]["message"]["content"]
    except (ConfigError, DataError) as e:
        return FAILED, str(e)
    except (KeyError, IndexError, TypeError):
        return FAILED, f"{endpoint}: reply has no choices[0].message.content: {str(reply)[:200]}"
    return parse_verdict(text if isinstance(text, str) else ""), None


def _rewards(records: list[dict], outcomes: list[dict], examples: dict) -> tuple[list, int]:
    """Win rates per record from its verdicts (identical texts tie without a request); None for a
    record with one response. Returns ``(rewards, identical ordered pairs)``; unscored responses
    are added to ``examples``."""
    identical = 0
    out: list[Optional[list[Optional[float]]]] = []
    for ri, rec in enumerate(records):
        resp = rec["responses"]
        if len(resp) < 2:
            out.append(None)
            continue
        same = [(i, j) for i in range(len(resp)) for j in range(len(resp)) if i != j and resp[i] == resp[j]]
        for key in same:
            outcomes[ri].setdefault(key, []).append("tie")
        identical += len(same)
        out.append(win_rates(len(resp), outcomes[ri]))
        for j in (j for j, r in enumerate(out[-1]) if r is None):
            _example(examples, "no_scored_comparison", f"{rec['id']} (response {j})")
    return out, identical


def _example(examples: dict, cause: str, text: str) -> None:
    bucket = examples.setdefault(cause, [])
    if len(bucket) < MAX_EXAMPLES:
        bucket.append(text)


def score(records: list[dict], cfg) -> ScoreResult:
    """``source=judge``: win rate of each response in pairwise, both-order comparisons.

    Returns:
        :class:`~online_rlhf.stats.ScoreResult`. Records with a single response cannot be compared:
        None, counted in ``skipped`` as ``single_response``. Makes K(K-1) requests per record (fewer
        when responses repeat). Unparsable replies and failed requests are counted
        (``source_stats["unparsed_verdicts"]``, ``source_stats["failed_calls"]``, example ids in
        ``examples``) and left out of the win rates; a response left with no scored comparison gets
        None (``responses_unscored["no_scored_comparison"]``). ``source_stats`` also holds ``url``,
        ``judge_model``, ``requests``, ``verdicts``, ``identical_pairs_not_asked`` and
        ``position_agreement``.

    Raises:
        ConfigError: every request failed (names the endpoint and the first error).
    """
    endpoint = base_url(cfg.url, "/chat/completions") + "/chat/completions"
    headers = openai_headers()
    jobs = _jobs(records)
    with ThreadPoolExecutor(max_workers=cfg.judge_concurrency) as pool:
        replies = list(pool.map(lambda job: _ask(endpoint, headers, cfg, records[job[0]], job[1], job[2]), jobs))
    failed = [err for _, err in replies if err]
    if jobs and len(failed) == len(jobs):
        raise ConfigError(f"every judge request failed ({len(jobs)}); first error: {failed[0]}")
    examples: dict[str, list[str]] = {}
    outcomes: list[dict] = [{} for _ in records]
    for (ri, i, j), (v, err) in zip(jobs, replies):
        outcomes[ri].setdefault((i, j), []).append(v)
        if v is None or err:
            _example(examples, "failed_calls" if err else "unparsed_verdicts",
                     f"{records[ri]['id']} (A=response {i}, B=response {j})" + (f": {err[:120]}" if err else ""))
    out, identical = _rewards(records, outcomes, examples)
    n_single = sum(r is None for r in out)
    n_unscored = sum(x is None for r in out if r is not None for x in r)
    verdicts = [v for v, _ in replies]
    source_stats = {"url": cfg.url, "judge_model": cfg.judge_model, "requests": len(jobs),
                    "verdicts": {v: verdicts.count(v) for v in ("A", "B", "tie")},
                    "unparsed_verdicts": verdicts.count(None), "failed_calls": len(failed),
                    "identical_pairs_not_asked": identical // 2,
                    "position_agreement": _position_agreement(jobs, verdicts)}
    return ScoreResult(rewards=out, skipped=Counter({"single_response": n_single} if n_single else {}),
                       responses_unscored=Counter({"no_scored_comparison": n_unscored} if n_unscored else {}),
                       examples=examples, source_stats=source_stats)


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
