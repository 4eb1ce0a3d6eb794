"""Pairwise LLM-as-judge (online_rlhf/judge.py) against a fake OpenAI-compatible endpoint on 127.0.0.1."""

import re
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("requests")

from online_rlhf import judge  # noqa: E402
from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.jsonl import read_jsonl, write_jsonl  # noqa: E402
from online_rlhf.stage_configs import RewardConfig  # noqa: E402
from online_rlhf.stats import RewardStats, stats_path  # noqa: E402
from online_rlhf.testing import serve_in_thread  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
_AB = re.compile(r"\[Response A\]\n(.*)\n\n\[Response B\]\n(.*)\n\nWhich response", re.S)


def fake_judge(rule: str):
    """An OpenAI-compatible /v1/chat/completions whose verdict follows ``rule``; it logs every (A, B) shown.

    rule: ``longer`` (the longer response wins), ``first`` (always A: pure position bias),
    ``garbage`` (no verdict), ``two_verdicts`` (``[[B]]``, then ``[[A]]`` later), ``fail_x`` (HTTP
    400 when response A is ``x``, else the longer one wins), ``fail`` (always HTTP 400).
    """
    from fastapi import FastAPI, HTTPException

    app = FastAPI()
    app.state.seen = []
    app.state.models = set()
    lock = threading.Lock()

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        a, b = _AB.search(body["messages"][-1]["content"]).groups()
        with lock:
            app.state.seen.append((a, b))
            app.state.models.add(body["model"])
        if rule == "longer":
            text = "Response A is longer. [[A]]" if len(a) > len(b) else "B says more. [[B]]"
        elif rule == "first":
            text = "[[A]]"
        elif rule == "two_verdicts":
            text = "Verdict: [[B]]. I would have said [[A]] at first."
        elif rule == "fail" or (rule == "fail_x" and a == "x"):
            raise HTTPException(status_code=400, detail="bad request")
        elif rule == "fail_x":
            text = "[[A]]" if len(a) > len(b) else "[[B]]"
        else:
            text = "I cannot decide."
        return {"id": "x", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}

    return app


def _cfg(url, **kw):
    fields = {"input": "generated.jsonl", "output": "rewards.jsonl", "source": "judge", "url": url,
              "judge_model": "tiny-judge", "retries": 0, "judge_concurrency": 4, **kw}
    return RewardConfig(**fields)


def test_both_orders_of_every_pair_are_asked():
    app = fake_judge("longer")
    responses = ["short", "a bit longer", "the longest answer of all"]
    with serve_in_thread(app) as url:
        judge.score([{"id": "0", "prompt": PROMPT, "responses": responses}], _cfg(url + "/v1"))
    expected = {(a, b) for a in responses for b in responses if a != b}
    assert sorted(app.state.seen) == sorted(expected)  # each ordered pair exactly once: K(K-1) = 6 requests
    assert app.state.models == {"tiny-judge"}


def test_rewards_are_win_rates():
    app = fake_judge("longer")
    recs = [{"id": "0", "prompt": PROMPT, "responses": ["bb", "a", "dddd", "ccc"]},
            {"id": "1", "prompt": PROMPT, "responses": ["long answer", "short"]}]
    with serve_in_thread(app) as url:
        res = judge.score(recs, _cfg(url + "/v1"))
        rewards, stats = res.rewards, res
    assert rewards == [[1 / 3, 0.0, 1.0, 2 / 3], [1.0, 0.0]]
    assert stats.source_stats["requests"] == 12 + 2 and stats.source_stats["unparsed_verdicts"] == 0 and stats.source_stats["position_agreement"] == 1.0


def test_position_bias_cancels_out():
    app = fake_judge("first")
    with serve_in_thread(app) as url:
        res = judge.score([{"id": "0", "prompt": PROMPT, "responses": ["x", "yy", "zzz"]}], _cfg(url + "/v1"))
        rewards, stats = res.rewards, res
    assert rewards == [[0.5, 0.5, 0.5]]
    assert stats.source_stats["position_agreement"] == 0.0


def test_identical_responses_tie_without_asking_and_single_response_is_skipped():
    app = fake_judge("longer")
    recs = [{"id": "0", "prompt": PROMPT, "responses": ["same", "same", "much longer"]},
            {"id": "1", "prompt": PROMPT, "responses": ["alone"]}]
    with serve_in_thread(app) as url:
        res = judge.score(recs, _cfg(url + "/v1"))
        rewards, stats = res.rewards, res
    assert ("same", "same") not in app.state.seen and len(app.state.seen) == 4
    assert rewards == [[0.25, 0.25, 1.0], None]
    assert stats.skipped == {"single_response": 1} and stats.source_stats["identical_pairs_not_asked"] == 1


@pytest.mark.parametrize("rule", ["garbage", "two_verdicts"])
def test_unparsable_verdicts_are_counted_and_never_scored(rule):
    app = fake_judge(rule)
    with serve_in_thread(app) as url:
        res = judge.score([{"id": "0", "prompt": PROMPT, "responses": ["x", "yy"]}], _cfg(url + "/v1"))
        rewards, stats = res.rewards, res
    assert rewards == [[None, None]]  # no tie invented: neither response has a scored comparison
    assert stats.source_stats["unparsed_verdicts"] == 2 and stats.source_stats["verdicts"] == {"A": 0, "B": 0, "tie": 0}
    assert stats.responses_unscored == {"no_scored_comparison": 2}
    assert stats.examples["unparsed_verdicts"] == ["0 (A=response 0, B=response 1)", "0 (A=response 1, B=response 0)"]


def test_failed_calls_are_counted_and_never_scored():
    app = fake_judge("fail_x")  # every request showing "x" as A fails
    with serve_in_thread(app) as url:
        res = judge.score([{"id": "r", "prompt": PROMPT, "responses": ["x", "yy", "zzz"]}], _cfg(url + "/v1"))
        rewards, stats = res.rewards, res
    # x: only its two games as B count (both lost); yy: lost to zzz twice, beat x once; zzz won all four
    assert rewards == [[0.0, 1 / 3, 1.0]]
    assert stats.source_stats["failed_calls"] == 2 and stats.source_stats["unparsed_verdicts"] == 0 and stats.source_stats["requests"] == 6
    assert [e.split(":")[0] for e in stats.examples["failed_calls"]] == ["r (A=response 0, B=response 1)",
                                                                           "r (A=response 0, B=response 2)"]
    assert "HTTP 400" in stats.examples["failed_calls"][0]


def test_every_call_failing_stops_the_stage_naming_the_endpoint():
    with serve_in_thread(fake_judge("fail")) as url:
        with pytest.raises(ConfigError, match=r"every judge request failed \(2\).*chat/completions.*400"):
            judge.score([{"id": "0", "prompt": PROMPT, "responses": ["x", "yy"]}], _cfg(url + "/v1"))


@pytest.mark.parametrize("text,verdict", [("[[A]]", "A"), ("A is wrong; B is right. [[B]]", "B"),
                                          ("first [[A]] then on reflection [[B]]", None),
                                          ("Verdict: [[B]]. I would have said [[A]].", None),
                                          ("[[B]] ... so once more: [[ b ]]", "B"), (" b. ", "B"),
                                          ("[[tie]]", "tie"), ("[[A]] or [[tie]]", None),
                                          ("Both are fine.", None), ("", None)])
def test_parse_verdict(text, verdict):
    assert judge.parse_verdict(text) == verdict


def test_get_rewards_with_judge_source(tmp_path):
    recs = [{"id": str(i), "prompt": PROMPT, "responses": ["a", "bbb", "cc"][: 3 - i], "finish_reasons": ["stop"] * (3 - i),
             "response_tokens": [1] * (3 - i)} for i in range(3)]
    write_jsonl(tmp_path / "generated.jsonl", recs)
    from online_rlhf.stages import get_rewards as mod

    with serve_in_thread(fake_judge("longer")) as url:
        cfg = _cfg(url + "/v1", input=str(tmp_path / "generated.jsonl"), output=str(tmp_path / "rewards.jsonl"))
        mod.main(cfg)
    out = read_jsonl(tmp_path / "rewards.jsonl")
    assert [(r["id"], r["rewards"]) for r in out] == [("0", [0.0, 1.0, 0.5]), ("1", [0.0, 1.0])]
    stats = RewardStats.read(stats_path(cfg.output))  # the stage's stats round-trip through their class
    assert stats.skipped == {"single_response": 1} and stats.records_in == 3
    assert stats.source_stats["judge_model"] == cfg.judge_model and stats.hardware is None
