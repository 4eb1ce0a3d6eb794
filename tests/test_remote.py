"""HTTP reward service (annotate_data/reward_server.py) and its client (online_rlhf/remote.py), on 127.0.0.1."""

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")
pytest.importorskip("torch")

from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.jsonl import DataError, read_jsonl, write_jsonl  # noqa: E402
from online_rlhf.remote import score_items  # noqa: E402
from online_rlhf.reward_model import RewardModel  # noqa: E402
from online_rlhf.stage_configs import RewardConfig  # noqa: E402
from online_rlhf.stats import RewardStats, stats_path  # noqa: E402
from online_rlhf.testing import free_port, make_tiny_reward_model, serve_in_thread  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [[{"role": "user", "content": "What is 12 plus 30?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a short poem about the sea."}]]
RESPONSES = ["The answer is 42.", "The sea is blue, the sea is wide. " * 3]


def _load_script(name):
    mod = importlib.import_module(f"online_rlhf.stages.{name}")
    return mod


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def server(rm_dir):
    """The real server script in a subprocess on a free port; stopped at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "annotate_data" / "reward_server.py"), f"reward_model={rm_dir}",
                             f"port={port}", "batch_size=2"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"reward_server exited early:\n{proc.stdout.read()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("reward_server did not answer /health within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def test_health_names_the_model(server, rm_dir):
    reply = requests.get(f"{server}/health", timeout=10).json()
    assert reply["status"] == "ok" and reply["reward_model"] == str(rm_dir)


def test_server_rewards_match_local_reward_model(server, rm_dir):
    prompts, responses = PROMPTS * 3, RESPONSES + ["42", "x", "hmm", "?"]
    remote = score_items(server, prompts, responses, batch_size=4, timeout_s=60, retries=0)
    local, _ = RewardModel(str(rm_dir)).score(prompts, responses, batch_size=1)
    assert remote == pytest.approx(local, abs=1e-5)
    assert len(set(remote)) > 1


def test_mismatched_request_is_rejected_with_the_reason(server):
    with pytest.raises(DataError, match="400.*2 prompts but 1 responses"):
        score_items(server, PROMPTS, RESPONSES[:1], batch_size=8, timeout_s=60, retries=0)


def test_get_rewards_with_remote_source(server, rm_dir, tmp_path):
    recs = [{"id": str(i), "prompt": PROMPTS[i % 2], "responses": [RESPONSES[i % 2], "42", "x"],
             "finish_reasons": ["stop"] * 3, "response_tokens": [3] * 3} for i in range(3)]
    write_jsonl(tmp_path / "generated.jsonl", recs)
    cfg = RewardConfig(input=str(tmp_path / "generated.jsonl"), output=str(tmp_path / "rewards.jsonl"),
                       source="remote", url=server, batch_size=2)
    _load_script("get_rewards").main(cfg)
    out = read_jsonl(tmp_path / "rewards.jsonl")
    rm = RewardModel(str(rm_dir))
    assert [r["id"] for r in out] == ["0", "1", "2"]
    for rec in out:
        assert rec["reward_source"] == "remote"
        assert rec["rewards"] == pytest.approx(rm.score([rec["prompt"]] * 3, rec["responses"])[0], abs=1e-5)
    stats = RewardStats.read(stats_path(cfg.output))  # the stage's stats round-trip through their class
    assert stats.records_scored == 3 and stats.source_stats["requests"] == 5  # 9 items, 2 per request


def _flaky_app(failures: int):
    """A fake reward service that answers 503 ``failures`` times, then rewards = response lengths."""
    from fastapi import FastAPI, Response

    app = FastAPI()
    app.state.calls = 0

    @app.post("/score")
    def score(body: dict, response: Response):
        app.state.calls += 1
        if app.state.calls <= failures:
            response.status_code = 503
            return {"detail": "warming up"}
        return {"rewards": [float(len(r)) for r in body["responses"]]}

    return app


def test_client_retries_server_errors_then_succeeds():
    app = _flaky_app(failures=2)
    with serve_in_thread(app) as url:
        rewards = score_items(url, PROMPTS, RESPONSES, batch_size=8, timeout_s=10, retries=2, backoff_s=0.01)
    assert rewards == [float(len(r)) for r in RESPONSES]
    assert app.state.calls == 3


def test_client_gives_up_after_retries_naming_the_url():
    app = _flaky_app(failures=10)
    with serve_in_thread(app) as url:
        with pytest.raises(ConfigError, match=f"{url}/score.*3 attempts.*HTTP 503"):
            score_items(url, PROMPTS, RESPONSES, batch_size=8, timeout_s=10, retries=2, backoff_s=0.01)
    assert app.state.calls == 3


def test_unreachable_service_error_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"{url}/score is unreachable"):
        score_items(url, PROMPTS, RESPONSES, batch_size=8, timeout_s=5, retries=1, backoff_s=0.01)
    assert time.monotonic() - t0 < 10


def _bad_values_app():
    """A reward service whose reply holds, per response text, a value JSON-encoded as is: ``"nan"`` ->
    NaN, ``"inf"`` -> Infinity, ``"-inf"`` -> -Infinity, ``"null"`` -> null, ``"text"`` -> "1.0";
    any other response gets 1.0 + its length / 10."""
    from fastapi import FastAPI, Response

    app = FastAPI()
    raw = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity", "null": "null", "text": '"1.0"'}

    @app.post("/score")
    def score(body: dict):
        vals = [raw.get(r, repr(1.0 + len(r) / 10)) for r in body["responses"]]
        return Response(content='{"rewards": [' + ", ".join(vals) + "]}", media_type="application/json")

    return app


def test_bad_values_leave_out_only_their_response_counted_by_cause():
    from online_rlhf import remote

    recs = [{"id": "a", "prompt": PROMPTS[0], "responses": ["ok", "nan", "fine"]},
            {"id": "b", "prompt": PROMPTS[0], "responses": ["inf", "-inf", "null", "text"]}]
    with serve_in_thread(_bad_values_app()) as url:
        cfg = RewardConfig(input="x", output="y", source="remote", url=url, retries=0)
        res = remote.score(recs, cfg)
        rewards, stats = res.rewards, res
    assert rewards == [[1.2, None, 1.4], [None, None, None, None]]
    assert stats.responses_unscored == {"nan": 1, "inf": 2, "null": 1, "not_a_number": 1}
    assert stats.examples == {"nan": ["a (response 1)"], "inf": ["b (response 0)", "b (response 1)"],
                                 "null": ["b (response 2)"], "not_a_number": ["b (response 3)"]}


def test_get_rewards_keeps_the_scored_responses_of_a_record_with_a_nan(tmp_path):
    recs = [{"id": rid, "prompt": PROMPTS[0], "responses": resp, "finish_reasons": ["stop"] * len(resp)}
            for rid, resp in (("a", ["ok", "nan", "fine"]), ("b", ["null", "inf"]), ("c", ["x", "yy"]))]
    write_jsonl(tmp_path / "generated.jsonl", recs)
    with serve_in_thread(_bad_values_app()) as url:
        cfg = RewardConfig(input=str(tmp_path / "generated.jsonl"), output=str(tmp_path / "rewards.jsonl"),
                           source="remote", url=url, retries=0)
        stats = _load_script("get_rewards").main(cfg)
    out = read_jsonl(tmp_path / "rewards.jsonl")
    assert [(r["id"], r["rewards"]) for r in out] == [("a", [1.2, None, 1.4]), ("c", [1.1, 1.2])]
    assert stats.responses_scored == 4 and stats.responses_unscored == {"nan": 1, "null": 1, "inf": 1}
    assert stats.skipped == {"all_responses_unscored": 1} and stats.examples["all_responses_unscored"] == ["b"]
    assert stats.examples["nan"] == ["a (response 1)"] and stats.reward.min == 1.1
    assert RewardStats.read(stats_path(cfg.output)) == stats
