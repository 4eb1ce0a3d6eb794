"""online_rlhf/gpu_check.py (scripts/gpu_check.sh): its CPU side here, the check itself where a GPU is.

On CPU: argument parsing, the plan with the GPU profile (``--plan-only``: the loop's own plan of
the DPO and GRPO runs with ``launch_profile: zero2``), running a component (exit codes, timeouts,
verifiers), the verifiers on stats files, the tied-weights worker under DeepSpeed's CPU ZeRO-2
(slow), the table and the exit code. Tests marked ``gpu`` run the check on a CUDA machine and are
skipped (counted) elsewhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from online_rlhf import gpu_check as G
from online_rlhf import gpu_check_workers as W
from online_rlhf import stats as S
from online_rlhf.jsonl import read_json, write_json
from online_rlhf.testing import example_stats, make_tiny_policy

ROOT = Path(__file__).resolve().parent.parent


# --- arguments -----------------------------------------------------------------------------------

def test_parse_args_defaults_and_plan_first():
    a = G.parse_args([])
    assert a.models == ["tiny", "default"] and a.only == list(G.COMPONENTS) and a.gpus is None
    assert a.min_rm_speedup == 4.0 and not a.plan_only
    b = G.parse_args(["--only", "dpo_zero2,loop", "--models", "tiny", "--gpus", "2"])
    assert b.only == ["plan", "dpo_zero2", "loop"] and b.models == ["tiny"] and b.gpus == 2


@pytest.mark.parametrize("argv, message", [
    (["--only", "dpo,loop"], "--only dpo: expected a comma-separated subset of plan,generation"),
    (["--models", "llama"], "--models llama: expected"),
    (["--gpus", "0"], "--gpus 0: give at least 1"),
    (["--timeout-s", "0"], "must be positive"),
])
def test_parse_args_refuses_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        G.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(G._visible_gpus() > 0, reason="a CUDA device is visible here")
def test_without_a_gpu_the_check_refuses_and_says_plan_only(tmp_path, capsys):
    assert G.main(["--work-dir", str(tmp_path)]) == 2
    assert "needs a GPU" in capsys.readouterr().err and "--plan-only" in G.__doc__
    assert not list(tmp_path.iterdir())  # nothing planned


# --- the plan with the GPU profile ---------------------------------------------------------------

@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu_check")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = G.main(["--plan-only", "--models", "tiny", "--gpus", "2", "--work-dir", str(work)])
    (run,) = work.iterdir()
    return rc, run, out.getvalue()


def test_plan_only_plans_zero2_runs_with_one_process_and_shard_per_gpu(planned):
    rc, run, _ = planned
    assert rc == 0
    dpo = read_json(run / "runs" / "tiny_dpo" / "iter_1" / "plan.json")
    assert "configs/accelerate/zero2.yaml" in dpo["dpo"]["command"] and "--num_processes 2" in dpo["dpo"]["command"]
    assert "ACCELERATE_USE_CPU" not in dpo["dpo"]["command"] and "grpo" not in dpo
    import yaml

    gen = yaml.safe_load(Path(dpo["generate"]["config"]).read_text())
    assert gen["num_shards"] == 2 and gen["k"] == G.K
    d = yaml.safe_load(Path(dpo["dpo"]["config"]).read_text())
    assert d["launch_profile"] == "zero2" and d["training"]["max_steps"] == 2 and d["train_batch_size"] == 4
    assert d["attn_implementation"] == G.attention()
    grpo = read_json(run / "runs" / "tiny_grpo" / "iter_1" / "plan.json")
    assert "configs/accelerate/zero2.yaml" in grpo["grpo"]["command"] and "dpo" not in grpo
    assert (run / "models" / "tiny" / "config.json").is_file()


def test_plan_only_lists_every_command_and_runs_none(planned):
    rc, run, stdout = planned
    rows = read_json(run / "results.json")
    assert [r["component"] for r in rows] == list(G.COMPONENTS)
    assert rows[0]["ok"] is True and all(r["ok"] is None for r in rows[1:])
    assert "[tiny tied_weights]" in stdout and "--phase resume" in stdout and "zero2.yaml" in stdout
    loop_line = next(ln for ln in stdout.splitlines() if ln.startswith("[tiny loop]"))
    assert "run_loop.sh" in loop_line and "launch_profile=zero2" in loop_line and "iterations=1" in loop_line
    assert "1 passed, 0 failed, 8 not run" in stdout
    lora_line = next(ln for ln in stdout.splitlines() if ln.startswith("[tiny lora]"))
    assert " iterations=2 " in lora_line and "lora=" in lora_line and " iterations=1 " not in lora_line
    server = next(ln for ln in stdout.splitlines() if ln.startswith("[tiny reward_server]"))
    assert "bench.bench_reward_server --backbone" in server and "--dtype float32" in server
    assert not (run / "runs" / "tiny_dpo" / "iter_1" / "generated.jsonl").exists()  # nothing ran


def test_a_failed_plan_is_a_failed_row_and_no_other(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "default_model_dir", lambda: tmp_path / "absent")
    args = G.parse_args(["--models", "default", "--only", "dpo_zero2"])
    checks = G.build_checks(args, tmp_path, 1, "sdpa")
    assert [c.component for c in checks] == ["plan"]
    r = G.run_check(checks[0], tmp_path / "logs")
    assert r.ok is False and "prepare_default.py" in r.figure


# --- running a component -------------------------------------------------------------------------

def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_models_checks_verify_that_models_own_files(tmp_path, monkeypatch):
    """Checks are built for every model first and run later: a verifier must not read the last model's file."""
    monkeypatch.setattr(G, "_model_dir", lambda model, work: tmp_path / model)
    monkeypatch.setattr(G, "run_plan", lambda name, over, log: tmp_path / "runs" / name)
    for name in ("verify_rm", "verify_server"):
        monkeypatch.setattr(G, name, lambda out, expect: (True, str(out)))
    monkeypatch.setattr(G, "verify_tied", lambda out: (True, str(out)))
    monkeypatch.setattr(G, "verify_loop", lambda run: (True, str(run)))
    args = G.parse_args(["--models", "tiny,default", "--only", "rm_scoring,reward_server,tied_weights,loop"])
    checks = [c for c in G.build_checks(args, tmp_path, 1, "sdpa") if c.component != "plan"]
    assert len(checks) == 8
    for c in checks:
        assert f"{c.model}_" in c.verify()[1], (c.model, c.component, c.verify())


def test_verify_server_needs_cuda_no_faults_and_the_ratio_for_the_default_model(tmp_path):
    def figures(device="cuda", ratio=5.0, mismatched=0, failed=()):
        rows = {str(c): {"items_per_s": ips, "p50": 0.1, "p99": 0.2, "errors": 0, "lost": 0, "not_sent": 0,
                         "mismatched": mismatched if c == 16 else 0, "max_diff": 0.0}
                for c, ips in ((1, 10.0), (4, 30.0), (16, 10.0 * ratio))}
        write_json(tmp_path / "f.json", {"levels": [1, 4, 16], "failed": list(failed), "servers": {"mosec": {
            "device": device, "dtype": "float32", "workers": 1, "max_batch_requests": 16, "rows": rows, "ratio": ratio}}})
        return tmp_path / "f.json"

    ok, fig = G.verify_server(figures(), 4.0)
    assert ok and fig.startswith("16/1 clients 5.0x items/s (expect >= 4x), 10.0 -> 50.0 items/s") and "0 lost" in fig
    assert not G.verify_server(figures(ratio=3.0), 4.0)[0]
    assert G.verify_server(figures(ratio=1.2), None) == (True, G.verify_server(figures(ratio=1.2), None)[1])
    assert "not judged" in G.verify_server(figures(ratio=1.2), None)[1]
    assert not G.verify_server(figures(device="cpu"), 4.0)[0]
    assert not G.verify_server(figures(mismatched=1), None)[0]
    assert not G.verify_server(figures(failed=["mosec at 16 clients: 1 errors"]), None)[0]


def test_run_check_passes_exit_codes_timeouts_and_verifier_errors(tmp_path):
    logs = tmp_path / "logs"
    out = tmp_path / "out.json"
    ok = G.Check("generation", "tiny", [_py(f"import json; json.dump({{'n': 3}}, open({str(out)!r}, 'w'))")],
                 lambda: (read_json(out)["n"] == 3, "3 things"), 30)
    r = G.run_check(ok, logs)
    assert r.ok is True and r.figure == "3 things" and r.seconds > 0
    bad = G.run_check(G.Check("dpo_zero2", "tiny", [_py("print('boom: CUDA error'); raise SystemExit(3)"), _py("print(1)")],
                              lambda: (True, "never"), 30), logs)
    assert bad.ok is False and bad.figure.startswith("exit 3: boom: CUDA error") and "tiny_dpo_zero2.log" in bad.figure
    assert "print(1)" not in (logs / "tiny_dpo_zero2.log").read_text()  # later commands do not run
    slow = G.run_check(G.Check("loop", "tiny", [_py("import time; time.sleep(30)")], lambda: (True, "x"), 1), logs)
    assert slow.ok is False and "timed out after 1 s" in slow.figure
    missing = G.run_check(G.Check("grpo", "tiny", [], lambda: G.verify_training(tmp_path, 1, "sdpa", "grpo"), 5), logs)
    assert missing.ok is False and "FileNotFoundError" in missing.figure and "wrote no stats" in missing.figure
    wrong = G.run_check(G.Check("rm_scoring", "tiny", [], lambda: (False, "1.2x"), 5), logs)
    assert wrong.ok is False and wrong.figure == "1.2x"


def test_table_and_exit_code():
    rs = [G.Result("generation", "tiny", True, 12.34, "2 shards on cuda"),
          G.Result("rm_scoring", "tiny", False, 3.0, "batched/B=1 2.0x (expect >= 4x)"),
          G.Result("loop", "tiny", None, 0.0, "planned, not run (--plan-only)")]
    text = G.format_table(rs)
    lines = text.splitlines()
    assert lines[0].split() == ["component", "model", "result", "seconds", "figure"]
    assert lines[1].split()[:4] == ["generation", "tiny", "PASS", "12.3"] and lines[2].split()[2] == "FAIL"
    assert lines[3].split()[2] == "-" and lines[-1] == "1 passed, 1 failed, 1 not run"
    assert lines[1].index("12.3") == lines[0].index("seconds")  # columns line up
    assert G.exit_code(rs) == 1 and G.exit_code([rs[0], rs[2]]) == 0 and G.exit_code([]) == 1


# --- verifiers -----------------------------------------------------------------------------------

def _train_stats(run_dir: Path, cls, **kw) -> None:
    hw = {"device": "cuda", "dtype": "bfloat16", "threads": 1, "processes": 2, "cpu_model": "x",
          "cpu_capability": "AVX2", "cpu_native_bf16": False}
    st = example_stats(cls, **{"steps": 2, "num_processes": 2, "deepspeed_zero_stage": 2, "hardware": hw,
                               "dtype": {"loaded": "bfloat16"}, **kw})
    (run_dir / "iter_1").mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "iter_1" / "model.stats.json", st.model_dump(mode="json"))


def test_verify_training_needs_two_zero2_bf16_steps_on_cuda_and_tied_checkpoint(tmp_path):
    make_tiny_policy(tmp_path / "iter_1" / "model")
    _train_stats(tmp_path, S.DPOStats)
    ok, fig = G.verify_training(tmp_path, 2, "flash_attention_2", "dpo")
    assert ok and "attn flash_attention_2" in fig and "ZeRO-2 x2" in fig
    for bad in ({"deepspeed_zero_stage": None}, {"steps": 1}, {"num_processes": 1}, {"dtype": {"loaded": "float32"}}):
        _train_stats(tmp_path, S.DPOStats, **bad)
        assert not G.verify_training(tmp_path, 2, "sdpa", "dpo")[0], bad


def test_tied_check_of_a_saved_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_tiny_policy(tmp_path / "m")
    assert W.tied_in_checkpoint(model)[0]
    (f,) = model.glob("*.safetensors")
    t = load_file(str(f))
    emb = next(k for k in t if k.endswith("embed_tokens.weight"))
    t["lm_head.weight"] = t[emb].clone()
    save_file(t, str(f), metadata={"format": "pt"})
    assert W.tied_in_checkpoint(model) == (True, "tied (lm_head stored)")
    t["lm_head.weight"][0, 0] += 1.0  # a ZeRO save that broke the tie
    save_file(t, str(f), metadata={"format": "pt"})
    assert W.tied_in_checkpoint(model)[0] is False


def test_verify_generation_counts_shards_and_devices(tmp_path):
    n = G.PROMPTS_PER_GPU * 2
    st = example_stats(S.GenerateStats, num_shards=2, records_out=n, responses=n * G.K, generated_tokens_per_s=900.0)
    d = st.model_dump(mode="json")
    d["shards"] = [{**d["shards"][0], "shard_index": r, "hardware": {**d["shards"][0]["hardware"], "device": "cuda"}}
                   for r in range(2)]
    (tmp_path / "iter_1").mkdir()
    write_json(tmp_path / "iter_1" / "generated.jsonl.stats.json", d)
    ok, fig = G.verify_generation(tmp_path, 2)
    assert ok and fig.startswith(f"2 shards on cuda, {n * G.K} responses, 900 tok/s")
    assert not G.verify_generation(tmp_path, 4)[0]  # 4 GPUs should have made 4 shards
    d["shards"][1]["hardware"]["device"] = "cpu"
    write_json(tmp_path / "iter_1" / "generated.jsonl.stats.json", d)
    assert not G.verify_generation(tmp_path, 2)[0]


def test_rm_speedup_measures_both_modes_on_the_same_items(tmp_path):
    model = make_tiny_policy(tmp_path / "m")
    r = W.rm_speedup(str(model), tmp_path / "rm.json", items=8, batch_size=4, repeats=1, device="cpu")
    assert read_json(tmp_path / "rm.json") == r
    assert r["items"] == 8 and r["device"] == "cpu" and r["ratio"] == pytest.approx(r["one_s"] / r["batched_s"])
    assert r["max_abs_diff"] < 1e-4 * max(1.0, r["max_abs_score"])  # float32: batching changes no score
    ok, fig = G.verify_rm(tmp_path / "rm.json", 4.0)
    assert not ok and "expect >= 4x" in fig  # a CPU measurement never passes the GPU check


@pytest.mark.slow
def test_tied_worker_under_cpu_zero2_save_reload_and_resume(tmp_path):
    """The worker the GPU check launches, on DeepSpeed's CPU ZeRO-2 (fp32, one process)."""
    model = make_tiny_policy(tmp_path / "m", seed=1)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for phase in ("train", "resume"):
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "zero2_cpu.yaml"), "--num_processes", "1",
               "--main_process_port", str(G._free_port()), "-m", "online_rlhf.gpu_check", "tied-worker",
               "--model", str(model), "--dir", str(tmp_path / "tied"), "--phase", phase]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = read_json(tmp_path / "tied" / "result.json")
    train = read_json(tmp_path / "tied" / "train.json")
    assert train["loss0"] != train["loss1"]  # the step changed the weights: the resume has something to match
    assert r["ok"] and r["tied"] and r["logit_rel_diff"] <= W.LOGIT_RTOL, r
    assert r["loss1"][0] == pytest.approx(r["loss1"][1], rel=W.LOSS_RTOL), r
    assert G.verify_tied(tmp_path / "tied" / "result.json")[0]


def test_tied_worker_refuses_without_deepspeed(tmp_path):
    model = make_tiny_policy(tmp_path / "m")
    p = subprocess.run([sys.executable, "-m", "online_rlhf.gpu_check", "tied-worker", "--model", str(model),
                        "--dir", str(tmp_path / "t"), "--phase", "train"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode != 0 and "a DeepSpeed profile" in p.stderr


# --- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_check_passes_on_the_tiny_model(tmp_path):
    p = subprocess.run([sys.executable, "-m", "online_rlhf.gpu_check", "--models", "tiny", "--work-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1500)
    (run,) = tmp_path.iterdir()
    rows = read_json(run / "results.json")
    assert p.returncode == 0 and all(r["ok"] for r in rows), p.stdout[-4000:]
    assert [r["component"] for r in rows] == list(G.COMPONENTS)
    assert json.loads((run / "tiny_rm.json").read_text())["ratio"] >= 4.0
