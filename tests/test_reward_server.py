"""The reward service's operations and faults (annotate_data/reward_server.py with its Mosec engine).

Front-only behaviour (token, queue bound, readiness) runs against a fake engine in a thread; load
and faults run the real server script with a tiny random reward model in a subprocess. Every
reward a client gets is compared with the local reward model's reward for *that* item, so a reply
that carried another request's rewards would fail.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("mosec")
pytest.importorskip("psutil")
requests = pytest.importorskip("requests")
pytest.importorskip("torch")

from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.remote import score_items  # noqa: E402
from online_rlhf.reward_engine import split_rewards  # noqa: E402
from online_rlhf.reward_model import RewardModel  # noqa: E402
from online_rlhf.stages.reward_server import EngineUnavailable, build_app  # noqa: E402
from online_rlhf.testing import free_port, make_tiny_reward_model, serve_in_thread  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
P = [{"role": "user", "content": "What is 12 plus 30?"}]


def items(n: int, tag: str):
    """n distinct (prompt, response) items; the texts carry ``tag`` so that requests differ."""
    prompts = [[{"role": "user", "content": f"Question {tag}-{i}: how long is {i * 'x'}?"}] for i in range(n)]
    responses = [f"Answer {tag} {i}: " + "the sea is wide " * (i % 5 + 1) for i in range(n)]
    return prompts, responses


def test_split_rewards_keeps_each_request_its_own_items():
    assert split_rewards([1, 2, 3, 4, 5, 6], [2, 0, 3, 1]) == [[1, 2], [], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="5 rewards for 6 items"):
        split_rewards([1, 2, 3, 4, 5], [3, 3])


def test_max_batch_requests_auto_merges_on_gpu_only_and_0_is_refused():
    from online_rlhf.stages.reward_server import ServeConfig, batch_requests_for

    cfg = ServeConfig(reward_model="rm")
    assert cfg.max_batch_requests == "auto"
    assert (batch_requests_for("auto", on_gpu=True), batch_requests_for("auto", on_gpu=False)) == (16, 1)
    assert batch_requests_for(ServeConfig(reward_model="rm", max_batch_requests=4).max_batch_requests, False) == 4
    assert ServeConfig(reward_model="rm", max_batch_requests="3", workers="2").max_batch_requests == 3
    for key, bad in (("max_batch_requests", 0), ("max_batch_requests", "abc"), ("max_batch_requests", 2.5),
                     ("workers", 0), ("workers", -1), ("workers", True), ("max_batch_requests", False)):
        with pytest.raises(Exception, match=f"(?s){key}.*give auto or a whole number >= 1, e.g. {key}=2"):
            ServeConfig(reward_model="rm", **{key: bad})


def test_worker_scores_a_merged_batch_and_a_lone_request(rm_dir, local_rm, monkeypatch):
    from online_rlhf import reward_engine
    from online_rlhf.reward_engine import ENV_SPEC, engine_spec

    monkeypatch.setenv(ENV_SPEC, json.dumps(engine_spec(str(rm_dir), "auto", 4096, 2, 1, 1, [], 8, 10, 60)))
    worker = reward_engine.RewardWorker()
    reqs = [dict(zip(("prompts", "responses"), items(n, f"w{n}"))) for n in (3, 1, 2)]
    merged = worker.forward(reqs)  # max_batch_requests > 1: a list of requests
    lone = worker.forward(reqs[0])  # max_batch_requests = 1: Mosec passes the request itself
    for req, out in zip(reqs, merged):
        assert out["rewards"] == pytest.approx(local_rm.score(req["prompts"], req["responses"], batch_size=1)[0], abs=1e-5)
        assert out["batch_requests"] == 3
    assert lone["rewards"] == pytest.approx(merged[0]["rewards"], abs=1e-5) and lone["batch_requests"] == 1


# -- the front with a fake engine ------------------------------------------------------------------

class FakeEngine:
    """Rewards = response lengths; ``gate`` (a threading.Event) holds every score call until set;
    ``start_gate`` holds start()."""

    name = "fake"

    def __init__(self):
        self.gate, self.start_gate = threading.Event(), threading.Event()
        self.gate.set()
        self.start_gate.set()
        self.problem = None
        self.calls = 0
        self.stopped = False

    async def start(self):
        await asyncio.to_thread(self.start_gate.wait)

    async def stop(self):
        self.stopped = True

    async def score(self, payload):
        self.calls += 1
        await asyncio.to_thread(self.gate.wait)
        if self.problem:
            raise EngineUnavailable(self.problem)
        return [float(len(r)) for r in payload["responses"]]

    def status(self):
        return {"name": self.name}


def test_token_required_when_set(monkeypatch):
    eng = FakeEngine()
    with serve_in_thread(build_app(eng, max_items=8, token="s3cret")) as url:
        r = requests.post(f"{url}/score", json={"prompts": [P], "responses": ["abc"]}, timeout=10)
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
        r = requests.post(f"{url}/score", json={"prompts": [P], "responses": ["abc"]}, timeout=10,
                          headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "wrong token" in r.json()["detail"]
        r = requests.post(f"{url}/score", json={"prompts": [P], "responses": ["abc"]}, timeout=10,
                          headers={"Authorization": "s3cret"})  # the token without its scheme
        assert r.status_code == 401 and "another scheme than Bearer, or no scheme" in r.json()["detail"]
        r = requests.post(f"{url}/score", data=b"{not json", timeout=10)  # refused before the body is read
        assert r.status_code == 401
        r = requests.post(f"{url}/score", json={"prompts": [P], "responses": ["abc"]}, timeout=10,
                          headers={"Authorization": "bearer s3cret"})  # the scheme name is case-insensitive
        assert r.status_code == 200 and r.json() == {"rewards": [3.0]}
        assert requests.get(f"{url}/health", timeout=10).status_code == 200  # probes need no token
        assert eng.calls == 1
        monkeypatch.setenv("REWARD_SERVER_TOKEN", "s3cret")  # the client sends it from the environment
        assert score_items(url, [P, P], ["abc", "hello"], batch_size=8, timeout_s=10, retries=0) == [3.0, 5.0]


def test_queue_bound_answers_503_with_retry_after_and_loses_nothing():
    eng = FakeEngine()
    eng.gate.clear()  # every request waits in the service
    with serve_in_thread(build_app(eng, max_items=8, max_queue=2, retry_after_s=7)) as url:
        body = {"prompts": [P], "responses": ["abcd"]}
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(requests.post, f"{url}/score", json=body, timeout=30) for _ in range(2)]
            deadline = time.monotonic() + 10
            while requests.get(f"{url}/health", timeout=30).json()["requests_in_service"] < 2:
                assert time.monotonic() < deadline, "the two held requests never reached the service"
                time.sleep(0.05)
            r = requests.post(f"{url}/score", json=body, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "7" and "max_queue" in r.json()["detail"]
            eng.gate.set()
            assert [f.result().json() for f in held] == [{"rewards": [4.0]}] * 2
        h = requests.get(f"{url}/health", timeout=30).json()
        assert h["requests_rejected_queue_full"] == 1 and h["requests_in_service"] == 0


def test_ready_only_after_start_and_early_requests_wait():
    eng = FakeEngine()
    eng.start_gate.clear()
    with serve_in_thread(build_app(eng, max_items=8)) as url:
        h = requests.get(f"{url}/health", timeout=30)
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["ready"] is False
        r = requests.get(f"{url}/ready", timeout=30)
        assert r.status_code == 503 and "loading" in r.json()["detail"]
        with ThreadPoolExecutor(1) as pool:
            early = pool.submit(requests.post, f"{url}/score", json={"prompts": [P], "responses": ["ab"]}, timeout=30)
            time.sleep(0.3)
            assert not early.done()  # waits for the engine rather than failing
            eng.start_gate.set()
            assert early.result().json() == {"rewards": [2.0]}
        assert requests.get(f"{url}/ready", timeout=30).status_code == 200
        eng.problem = "the scoring engine exited with code 1"
        r = requests.get(f"{url}/ready", timeout=30)
        assert r.status_code == 503 and "exited with code 1" in r.json()["detail"]
        h = requests.get(f"{url}/health", timeout=30)
        assert h.status_code == 503 and h.json()["status"] == "failed"
        r = requests.post(f"{url}/score", json={"prompts": [P], "responses": ["ab"]}, timeout=10)
        assert r.status_code == 503 and "exited with code 1" in r.json()["detail"] and "retry-after" in r.headers
    assert eng.stopped


# -- the real server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def local_rm(rm_dir):
    return RewardModel(str(rm_dir))


def start_server(rm_dir, *args, env_extra=None):
    port = free_port()
    given = {a.split("=")[0] for a in args}
    args = [a for a in ("batch_size=4", "max_items=64") if a.split("=")[0] not in given] + list(args)
    proc = subprocess.Popen([sys.executable, str(REPO / "annotate_data" / "reward_server.py"), f"reward_model={rm_dir}",
                             f"port={port}", *args],
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"reward_server exited early:\n{proc.stdout.read()[-3000:]}")
            try:
                if requests.get(f"{url}/ready", timeout=10).status_code == 200:
                    return proc, url
            except requests.RequestException:  # not listening yet, or too slow on a busy machine
                pass
            if time.monotonic() > deadline:
                pytest.fail("reward_server was not ready within 300 s")
            time.sleep(0.3)
    except BaseException:
        stop_server(proc)  # never leave a server behind
        raise


def stop_server(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def engine_processes(url):
    """Pids of the engine's manager and its workers, from /health."""
    e = requests.get(f"{url}/health", timeout=30).json()["engine"]
    return [e["pid"], *e["workers_alive"]]


@pytest.fixture(scope="module")
def server(rm_dir):
    import psutil

    proc, url = start_server(rm_dir, "workers=2", "max_batch_requests=8", "max_wait_ms=20")
    try:
        yield url
        pids = engine_processes(url)
    finally:
        proc.kill()  # the front dies without stopping the engine: the engine must end itself
        proc.wait(timeout=15)
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"engine processes {pids} outlived the killed front"
        time.sleep(0.2)


def run_clients(url, n_clients, n_requests, n_items, retries=0, tag=""):
    """``n_requests`` requests of distinct items from ``n_clients`` threads: (sent items, results or exceptions)."""
    reqs = [items(n_items, f"{tag}{k}") for k in range(n_requests)]

    def one(k):
        try:
            return score_items(url, *reqs[k], batch_size=n_items, timeout_s=60, retries=retries, backoff_s=0.2)
        except Exception as e:  # noqa: BLE001 - counted by the caller
            return e

    with ThreadPoolExecutor(n_clients) as pool:
        return reqs, list(pool.map(one, range(n_requests)))


def check_all_own(reqs, results, local_rm):
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, f"{len(errors)} requests failed, first: {errors[0]!r}"
    for (prompts, responses), got in zip(reqs, results):
        want, _ = local_rm.score(prompts, responses, batch_size=1)
        assert got == pytest.approx(want, abs=1e-5)


def test_concurrent_clients_get_their_own_rewards_batched_together(server, local_rm):
    reqs, results = run_clients(server, n_clients=16, n_requests=48, n_items=3)
    check_all_own(reqs, results, local_rm)
    h = requests.get(f"{server}/health", timeout=30).json()
    assert h["status"] == "ok" and h["ready"] and len(h["engine"]["workers_alive"]) == 2
    merged = {int(k): v for k, v in h["engine"]["requests_by_batch_requests"].items()}
    assert any(k > 1 for k in merged), f"no two requests shared a worker call: {merged}"


def test_bad_requests_get_clear_errors_and_the_server_stays_healthy(server, local_rm):
    r = requests.post(f"{server}/score", data=b'{"prompts": [[', headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 422 and "json" in json.dumps(r.json()["detail"]).lower()
    r = requests.post(f"{server}/score", json={"prompts": [P], "responses": ["a", "b"]}, timeout=10)
    assert r.status_code == 400 and "1 prompts but 2 responses" in r.json()["detail"]
    p, resp = items(65, "big")
    r = requests.post(f"{server}/score", json={"prompts": p, "responses": resp}, timeout=10)
    assert r.status_code == 400 and "65 items" in r.json()["detail"] and "at most 64" in r.json()["detail"]
    assert "reward.batch_size=64 or less" in r.json()["detail"] and "max_items=65" in r.json()["detail"]
    r = requests.post(f"{server}/score", json={"prompts": [[]], "responses": ["a"]}, timeout=10)
    assert r.status_code == 400 and "at least one message" in r.json()["detail"]
    reqs, results = run_clients(server, 4, 8, 2, tag="after-bad")
    check_all_own(reqs, results, local_rm)


def test_client_that_disconnects_mid_request_harms_no_other(server, local_rm):
    host, port = server.removeprefix("http://").split(":")
    p, resp = items(40, "gone")
    body = json.dumps({"prompts": p, "responses": resp}).encode()
    head = (f"POST /score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for cut in (len(body) // 2, len(body)):  # mid-body, and right after the whole body
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head + body[:cut])
    reqs, results = run_clients(server, 8, 16, 3, tag="after-gone")
    check_all_own(reqs, results, local_rm)
    assert requests.get(f"{server}/ready", timeout=30).status_code == 200


def test_worker_killed_under_load_is_restarted_and_no_result_is_wrong(server, local_rm):
    victim = requests.get(f"{server}/health", timeout=30).json()["engine"]["workers_alive"][0]
    out = {}
    t = threading.Thread(target=lambda: out.update(r=run_clients(server, 8, 60, 4, retries=5, tag="kill")))
    t.start()
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    t.join(timeout=240)
    assert not t.is_alive()
    check_all_own(*out["r"], local_rm)  # requests on the lost worker were answered 503, retried, then scored
    deadline = time.monotonic() + 120
    while True:  # Mosec starts a new worker; the service is ready throughout
        h = requests.get(f"{server}/health", timeout=30).json()
        if len(h["engine"]["workers_alive"]) == 2 and victim not in h["engine"]["workers_alive"]:
            break
        assert time.monotonic() < deadline, f"no new worker: {h['engine']}"
        time.sleep(0.5)
    assert h["engine"]["workers_lost"] >= 1 and h["ready"]
    reqs, results = run_clients(server, 4, 8, 3, tag="after-kill")
    check_all_own(reqs, results, local_rm)


def test_last_worker_killed_fails_readiness_and_says_so(rm_dir):
    proc, url = start_server(rm_dir, "workers=1")
    try:
        victim = requests.get(f"{url}/health", timeout=30).json()["engine"]["workers_alive"][0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while requests.get(f"{url}/ready", timeout=30).status_code == 200:
            assert time.monotonic() < deadline, "still ready after its only worker died"
            time.sleep(0.3)
        r = requests.get(f"{url}/ready", timeout=30)
        assert "exited" in r.json()["detail"] and "restart the service" in r.json()["detail"]
        assert requests.get(f"{url}/health", timeout=30).status_code == 503
        with pytest.raises(ConfigError, match="HTTP 503.*exited"):
            score_items(url, [P], ["x"], batch_size=1, timeout_s=10, retries=1, backoff_s=0.1)
    finally:
        stop_server(proc)


def test_sigterm_finishes_the_request_in_flight(rm_dir, local_rm):
    import psutil

    proc, url = start_server(rm_dir, "workers=1", "max_items=4096", "batch_size=1")
    try:
        pids = engine_processes(url)
        p, resp = items(200, "drain")
        def post():
            r = requests.post(f"{url}/score", json={"prompts": p, "responses": resp}, timeout=120)
            return r, time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post)
            deadline = time.monotonic() + 30
            while requests.get(f"{url}/health", timeout=30).json()["requests_in_service"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            t_signal = time.monotonic()
            reply, t_reply = fut.result()
        assert t_reply > t_signal  # the reply came after the signal: it was in flight
        assert reply.status_code == 200, reply.text[:300]
        want, _ = local_rm.score(p, resp, batch_size=1)
        assert reply.json()["rewards"] == pytest.approx(want, abs=1e-5)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has drained
        log = proc.stdout.read()
        assert "shutting down (requests in flight answered; 1 scored in all)" in log and "reward_server: stopped" in log
        assert not any(psutil.pid_exists(p) for p in pids)  # the front stopped its engine before exiting
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/health", timeout=30)
    finally:
        stop_server(proc)


@pytest.mark.parametrize("given, says", [
    ("", "reward_model: String should have at least 1 character"),
    ("default", "reward_model=default is the embedded policy (a causal LM), not a reward model"),
    ("{empty}", "has no config.json: it is not a saved model folder"),
    ("{causal}", "checkpoint, not a reward model"),
    ("{missing}", "no such directory"),
])
def test_a_bad_reward_model_is_refused_before_any_worker_starts(tmp_path, given, says):
    from online_rlhf.testing import make_tiny_policy

    (tmp_path / "empty").mkdir()
    given = given.format(empty=tmp_path / "empty", causal=make_tiny_policy(tmp_path / "causal"),
                         missing=tmp_path / "nope")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(REPO / "annotate_data" / "reward_server.py"), f"reward_model={given}",
                        f"port={free_port()}"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2 and says in p.stderr, p.stderr[-2000:]
    assert "'default'" not in p.stderr and "Traceback" not in p.stderr
    assert "reward engine: mosec" not in p.stderr and time.monotonic() - t0 < 60  # no engine was started
