"""Every bench/ script runs, as its docstring says to run it, at its smallest size (so none rots).

Each runs as a module in a fresh process of this environment (``python -m bench.X ...`` from the
project root, the checkout first on PYTHONPATH) and must exit 0 and print its result lines;
figures are not checked (timings vary with the machine). The two whole-iteration comparisons with TRL run run_loop.sh on a
tiny random policy and are ``slow``, as is bench/bench_co_decode.py (four real generation
launches, from this env); bench/iteration_breakdown.py and bench/roofline.py then read
the run directory that run_loop.sh wrote. bench/bench_generation.py runs in the inference env
(``vllm`` mark).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INFER_PY = ROOT / ".venv-infer" / "bin" / "python"
PROMPTS = ROOT / ".cache" / "data" / "ifbench_train.jsonl"


def _run(module: str, *args: str, python: str = sys.executable, timeout: int = 1800) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([python, "-m", f"bench.{module}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"bench.{module} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_bench_matmul():
    out = _run("bench_matmul", "--size", "64", "--seconds", "0.05")
    assert "GFLOP/s" in out and "bf16" in out


def test_bench_dpo_step(tmp_path):
    out = _run("bench_dpo_step", "--smoke", "--output", str(tmp_path / "f.json"))
    assert "sequence / trl" in out and "side / trl" in out and "packed / trl" in out
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["loss_first_max_diff"] < 1e-3  # the same loss either way
    assert figures["runs"]["sequence"][0]["layout"] == "sequence" and figures["runs"]["trl"][0]["layout"] is None


def test_bench_dpo_ref():
    out = _run("bench_dpo_ref", "--smoke")
    assert "training-loop speed-up" in out


def test_bench_kl(tmp_path):
    out = _run("bench_kl", "--smoke", "--output", str(tmp_path / "f.json"))
    assert "auto / float32" in out
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["kl_se"] > 0 and abs(figures["kl"]["auto"] - figures["kl"]["float32"]) <= 0.1 * figures["kl_se"]


def test_bench_rm_scoring():
    out = _run("bench_rm_scoring", "--smoke")
    assert "speed-up batched / pipeline" in out


def test_bench_reward_server(tmp_path):
    from online_rlhf import gpu_check

    out = _run("bench_reward_server", "--smoke", "--workers", "2", "--output", str(tmp_path / "f.json"))
    assert "2 / 1 clients:" in out and "load test passed" in out
    figures = json.loads((tmp_path / "f.json").read_text())
    mosec = figures["servers"]["mosec"]
    assert mosec["device"] == "cpu" and mosec["workers"] == 2 and mosec["max_batch_requests"] == 1
    assert set(mosec["rows"]) == {"1", "2"} and figures["failed"] == []
    assert all(r["lost"] == 0 and r["mismatched"] == 0 for r in mosec["rows"].values())
    ok, fig = gpu_check.verify_server(tmp_path / "f.json", None)
    assert not ok and "2/1 clients" in fig and "cpu float32" in fig  # a CPU run never passes the GPU check


@pytest.mark.vllm
@pytest.mark.skipif(not INFER_PY.exists(), reason="no inference env")
def test_bench_generation(tmp_path):
    from online_rlhf.testing import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"Say something about {w}."}) + "\n"
                               for i, w in enumerate(["cats", "the sea"])), encoding="utf-8")
    out = _run("bench_generation", f"model={policy}", f"prompts={prompts}", "n_prompts=2", "k=1",
               "max_tokens=4", "calib_tokens=2", "hf_dtypes=[float32]", "hf_threads=[1]", "kv_cache_gb=0.25",
               python=str(INFER_PY))
    assert "tok/s" in out


@pytest.mark.slow
@pytest.mark.skipif(not INFER_PY.exists(), reason="no inference env")
def test_bench_co_decode(tmp_path):
    out = _run("bench_co_decode", "--smoke", "--threads", "1", "--output", str(tmp_path / "f.json"))
    assert "co-decoded / separate" in out
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["outputs_equal"] and figures["runs"][0]["startup_s"]["together"]["kl_generate"] == 0.0


def _needs_full_envs():
    if not (ROOT / ".venv-infer" / "bin" / "python").exists() or not PROMPTS.is_file():
        pytest.skip("needs both envs and the default prompts (scripts/prepare_default.py)")


def _separating_prompts(path: Path, n: int) -> Path:
    """n prompts whose IFEval checks a tiny random policy's 8-token answers pass or fail by chance.

    IFBench's prompts ask for things 8 random tokens never do, so every answer scored 0, both
    samples of every prompt tied and the pairs stage made no pair for the DPO stage. Letter counts,
    lowercase and no-comma checks pass for some random answers and not others; with partial
    credit over seven of them the two samples of a prompt rarely tie.
    """
    letters = [{"letter": c, "let_frequency": 1, "let_relation": "at least"} for c in "eaots"]
    ids = ["keywords:letter_frequency"] * len(letters) + ["change_case:english_lowercase", "punctuation:no_comma"]
    rows = [{"id": f"sep-{i}", "prompt": f"Write anything at all, number {i}.", "instruction_id_list": ids,
             "kwargs": [*letters, {}, {}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.trl_comparison
def test_iteration_vs_trl_then_breakdown_and_roofline_on_its_run(tmp_path):
    from online_rlhf.testing import make_tiny_policy

    _needs_full_envs()
    policy = make_tiny_policy(tmp_path / "tiny")
    prompts = _separating_prompts(tmp_path / "prompts.jsonl", 8)
    out = _run("iteration_vs_trl", "--prompts", "8", "--max-tokens", "8", "--eval-prompts", "1",
               "--prompts-file", str(prompts), "--policy", str(policy), "--work-dir", str(tmp_path / "work"),
               "--output", str(tmp_path / "f.json"))
    assert "ratio TRL / pipeline" in out
    figures = json.loads((tmp_path / "f.json").read_text())
    run_dir = Path(figures["results"]["ours"][0]["run_dir"])
    assert "DPO optimizer steps" in _run("iteration_breakdown", str(run_dir))
    last = _run("roofline", str(run_dir), "--gflops-fp32", "100", "--gflops-bf16", "200").strip().splitlines()[-1]
    assert last.startswith("share of the limit:"), last


@pytest.mark.slow
@pytest.mark.trl_comparison
def test_grpo_vs_trl(tmp_path):
    from online_rlhf.testing import make_tiny_policy

    _needs_full_envs()
    policy = make_tiny_policy(tmp_path / "tiny")
    out = _run("grpo_vs_trl", "--prompts", "2", "--k", "4", "--max-tokens", "8", "--policy", str(policy),
               "--work-dir", str(tmp_path / "work"))
    assert "ratio TRL / pipeline" in out
