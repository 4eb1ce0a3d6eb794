"""Co-decoding (online_rlhf/co_decode.py): an iteration's generation stages of one policy
(eval_generate, kl_generate, ifeval_generate) decode with one engine start, while each keeps its own
output, stats, resume and .done.

The first tests need no engine: which configs may share one, which stages ``loop exec`` takes
along, and what a co-decoded launch records (the launcher replaced by a stand-in that writes the
outputs, or dies half-way). The ``slow`` tests run real launches through ``loop exec`` on a tiny
random policy (``.venv-infer`` must exist; the loop itself runs in the training env): co-decoded outputs equal separate launches, a changed IFEval setting
reruns only ifeval_generate, and a rerun decodes nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from online_rlhf import co_decode, loop
from online_rlhf.jsonl import read_json, read_jsonl, write_jsonl
from online_rlhf.loop import co_decoding
from online_rlhf.stages.generate import config_groups
from online_rlhf.stats import GenerateStats, stats_path
from online_rlhf.testing import constraint_prompts, example_stats, make_tiny_policy

ROOT = Path(__file__).resolve().parent.parent
STAGES3 = ("eval_generate", "kl_generate", "ifeval_generate")


# ---------------------------------------------------------------- which configs may share an engine

BASE = {"model": "m", "prompts": "p.jsonl", "k": 1, "temperature": 0.0, "max_tokens": 64, "seed": 42,
        "max_model_len": 2048, "dtype": "auto", "num_shards": 1, "num_machines": 1, "tensor_parallel_size": 1,
        "enforce_eager": True, "kv_cache_gb": 2.0, "output": "a.jsonl", "dry_run": False}


def test_request_keys_may_differ_engine_keys_may_not():
    other = {**BASE, "prompts": "q.jsonl", "k": 4, "temperature": 1.0, "max_tokens": 8, "seed": 7, "output": "b.jsonl",
             "save_token_ids": True, "limit": 3}
    assert co_decode.refusal(BASE, other, in_process=True) is None
    for key, value in (("model", "m2"), ("max_model_len", 1024), ("dtype", "float32"), ("num_shards", 2),
                       ("tensor_parallel_size", 2), ("enforce_eager", False), ("kv_cache_gb", 1.0)):
        why = co_decode.refusal(BASE, {**BASE, key: value}, in_process=True)
        assert why and key in why, key
    assert "several machines" in co_decode.refusal(BASE, {**BASE, "num_machines": 2}, in_process=True)
    assert "dry run" in co_decode.refusal(BASE, {**BASE, "dry_run": True}, in_process=True)


def test_a_sampled_config_joins_only_an_engine_in_the_shard_process():
    sampled = {**BASE, "temperature": 1.0, "output": "b.jsonl"}
    assert co_decode.refusal(BASE, sampled, in_process=True) is None
    assert "seed could not be restored" in co_decode.refusal(BASE, sampled, in_process=False)
    assert co_decode.refusal(BASE, {**BASE, "output": "c.jsonl"}, in_process=False) is None  # greedy: the seed is moot


def test_the_engine_is_in_process_for_one_cpu_shard_unless_you_set_the_vllm_variables():
    assert co_decode.engine_in_process(1, 1, [], env={})
    assert not co_decode.engine_in_process(2, 1, [], env={})
    assert not co_decode.engine_in_process(1, 1, ["0"], env={})
    assert not co_decode.engine_in_process(1, 1, [], env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert not co_decode.engine_in_process(1, 1, [], env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert co_decode.engine_in_process(1, 1, ["0"], env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert not co_decode.engine_in_process(1, 2, ["0", "1"], env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def test_each_config_flag_starts_a_group_of_its_own():
    assert config_groups(["prompts=p", "k=2"]) == [["prompts=p", "k=2"]]
    assert config_groups(["--config", "a.yaml", "k=2"]) == [["--config", "a.yaml", "k=2"]]
    assert config_groups(["k=1", "--config", "a.yaml", "x=1", "--config=b.yaml", "--config", "c.yaml", "y=2"]) == [
        ["k=1", "--config", "a.yaml", "x=1"], ["--config=b.yaml"], ["--config", "c.yaml", "y=2"]]


def test_launch_refuses_a_dry_run_of_several_configs(tmp_path):
    for n in "ab":
        (tmp_path / f"{n}.yaml").write_text(yaml.safe_dump({"prompts": "p.jsonl", "output": str(tmp_path / f"{n}.jsonl")}))
    proc = subprocess.run([sys.executable, str(ROOT / "generation" / "launch.py"), "--config", str(tmp_path / "a.yaml"),
                           "dry_run=true", "--config", str(tmp_path / "b.yaml")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "dry_run=true measures one config" in proc.stderr


# ---------------------------------------------------------------- the loop: companions, records, marks

def _fake_model(path: Path, weights: bytes = b"w0") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def _plan(tmp_path: Path, *extra: str, policy: Path | None = None, name: str = "r") -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    args = [f"train_prompts={constraint_prompts(data / 'train.jsonl', 6, 't')}",
            f"eval_prompts={constraint_prompts(data / 'eval.jsonl', 3, 'e')}",
            f"ifeval.prompts={constraint_prompts(data / 'ifeval.jsonl', 2, 'i')}",
            f"output_root={tmp_path / 'runs'}", f"run_name={name}",
            f"policy={policy or _fake_model(tmp_path / 'start')}"]
    given = {o.split("=", 1)[0] for o in extra}
    args += [o for o in ("iterations=1", "ifeval.when=every", "kl_samples=1") if o.split("=", 1)[0] not in given]
    args += extra
    return loop.plan(None, args, shell_out=open(os.devnull, "w"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONLINE_RLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ONLINE_RLHF_EVAL_CACHE", raising=False)
    monkeypatch.delenv("ONLINE_RLHF_CO_DECODE", raising=False)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tmp_path / "cache" / "eval"


def _write_output(d: dict) -> None:
    out = Path(d["output"])
    write_jsonl(out, [{"id": "e0", "prompt": [{"role": "user", "content": "q"}], "responses": ["a"] * d["k"],
                       "finish_reasons": ["stop"] * d["k"], "response_tokens": [1] * d["k"]}])
    example_stats(GenerateStats).write(stats_path(out))


class FakeLauncher:
    """Stands in for the generation launcher (``online_rlhf.procs.start_guarded``, ``os.execve``): writes the output and stats of each
    ``--config`` it is given, the first ``write`` of them (all by default), then exits ``rc``."""

    def __init__(self, write: int | None = None, rc: int = 0):
        self.write, self.rc, self.calls = write, rc, []

    def __call__(self, argv, **kw):
        configs = [argv[j + 1] for j, a in enumerate(argv) if a == "--config"]
        self.calls.append(configs)
        for path in configs[:self.write]:
            _write_output(yaml.safe_load(Path(path).read_text()))
        return SimpleNamespace(wait=lambda: self.rc)


def _run_loop_says(check_out: str) -> str:
    """The line run_loop.sh's run_stage prints for ``loop check``'s output (its case block run alone)."""
    import subprocess

    script = (Path(__file__).resolve().parents[1] / "run_loop.sh").read_text()
    block = script[script.index('  case "$why" in'):]
    block = block[:block.index("\n  esac\n") + 7]
    out = subprocess.run(["bash", "-c", 'say() { printf "%s\\n" "$*"; }; i=1 ITERATIONS=2 stage=kl_generate\n'
                          'env="${1%%$\'\\n\'*}"; why="${1#*$\'\\n\'}"\n' + block, "_", check_out.rstrip("\n")],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().removeprefix("iteration 1/2 · ")


def _run_stage(run: Path, i: int, stage: str) -> None:
    """What run_loop.sh does for a stale stage: exec, then mark."""
    assert not loop.check(run, i, stage)
    loop.exec_stage(run, i, stage)
    loop.mark(run, i, stage, 1.0)


@pytest.fixture
def run1(tmp_path, cache, monkeypatch):
    """A planned run whose iteration-1 model exists (as if DPO had finished), the launcher faked."""
    monkeypatch.chdir(tmp_path)
    run = _plan(tmp_path)
    _fake_model(run / "iter_1" / "model", b"w1")
    fake = FakeLauncher()
    monkeypatch.setattr("online_rlhf.procs.start_guarded", fake)  # a co-decoded launch (a child of loop exec)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: fake(argv))  # a launch of one stage (exec)
    return SimpleNamespace(run=run, fake=fake, tmp=tmp_path)


def test_held_out_generation_takes_kl_and_ifeval_along(run1, capsys):
    run = run1.run
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == [(1, "kl_generate"), (1, "ifeval_generate")]
    _run_stage(run, 1, "eval_generate")
    assert [Path(c).name for c in run1.fake.calls[0]] == ["eval_generate.yaml", "kl_generate.yaml",
                                                           "ifeval_generate.yaml"]
    assert "also decodes kl_generate, ifeval_generate of iteration 1 with" in capsys.readouterr().out
    for stage in ("kl_generate", "ifeval_generate"):  # recorded, not yet done
        assert (run / "iter_1" / f"{stage}.co_decoded").is_file() and not loop.check(run, 1, stage)
    capsys.readouterr()
    assert loop.main(["check", str(run), "1", "kl_generate"]) == 1  # `loop check` says it only gets marked
    checked = capsys.readouterr().out
    assert "already decoded (co-decoded in the engine start of stage eval_generate of iteration 1)" in checked
    said = _run_loop_says(checked)  # run_loop.sh's console line: the note alone, not "runs again: not run yet"
    assert said.startswith("kl_generate: its output is already decoded") and "runs again" not in said
    assert co_decoding.co_decoded_note(run, 1, "eval_generate") is None
    for stage in ("kl_generate", "ifeval_generate"):  # their turn: nothing runs, then marked as usual
        _run_stage(run, 1, stage)
        assert "nothing to run" in capsys.readouterr().out
        assert loop.check(run, 1, stage)
        assert read_json(run / "iter_1" / f"{stage}.done")["co_decoded_by"] == "eval_generate"
        assert not (run / "iter_1" / f"{stage}.co_decoded").exists()
    assert len(run1.fake.calls) == 1  # one launch for the three
    assert all(loop.check(run, 1, s) for s in STAGES3)


def test_a_changed_ifeval_setting_reruns_only_ifeval_generate(run1):
    run = run1.run
    for stage in STAGES3:
        _run_stage(run, 1, stage)
    assert len(run1.fake.calls) == 1
    _plan(run1.tmp, "ifeval.max_tokens=99")  # the same run directory, re-planned
    assert [s for s in STAGES3 if not loop.check(run, 1, s)] == ["ifeval_generate"]
    _run_stage(run, 1, "ifeval_generate")  # alone: no later generation stage to take along
    assert [Path(c).name for c in run1.fake.calls[1]] == ["ifeval_generate.yaml"]
    assert all(loop.check(run, 1, s) for s in STAGES3)


def test_a_rerun_of_fresh_stages_launches_nothing(run1):
    run = run1.run
    for stage in STAGES3:
        _run_stage(run, 1, stage)
    _plan(run1.tmp)  # the same command again
    assert all(loop.check(run, 1, s) for s in STAGES3)
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == []
    assert len(run1.fake.calls) == 1


def test_an_interrupted_co_decode_marks_and_records_nothing_it_did_not_write(run1, capsys):
    run = run1.run
    stale = run / "iter_1" / "ifeval_generated.jsonl"  # an earlier run's answers, for another config
    _write_output({"output": str(stale), "k": 1})
    run1.fake.write, run1.fake.rc = 1, 128 + 9  # the held-out answers written, then killed
    with pytest.raises(SystemExit) as e:
        loop.exec_stage(run, 1, "eval_generate")
    assert e.value.code == 137
    assert not stale.exists()  # a companion's stale output goes before the launch
    for stage in STAGES3:  # the loop stops there: nothing marked, nothing recorded
        assert not loop.check(run, 1, stage)
        assert not (run / "iter_1" / f"{stage}.co_decoded").exists()
    assert "kl_generate of iteration 1 was not written by this launch" in capsys.readouterr().out
    # the rerun launches the three again
    run1.fake.write, run1.fake.rc = None, 0
    for stage in STAGES3:
        _run_stage(run, 1, stage)
    assert len(run1.fake.calls) == 2 and all(loop.check(run, 1, s) for s in STAGES3)


def test_a_later_config_that_failed_runs_alone_at_its_turn(run1):
    run = run1.run
    run1.fake.write, run1.fake.rc = 2, 3  # LATER_CONFIG_FAILED: held-out and KL written, IFEval not
    _run_stage(run, 1, "eval_generate")  # its own output was written: the stage succeeds
    _run_stage(run, 1, "kl_generate")
    assert len(run1.fake.calls) == 1
    run1.fake.write, run1.fake.rc = None, 0
    _run_stage(run, 1, "ifeval_generate")
    assert [Path(c).name for c in run1.fake.calls[1]] == ["ifeval_generate.yaml"]


def test_a_record_for_another_config_or_an_edited_output_counts_for_nothing(run1):
    run = run1.run
    _run_stage(run, 1, "eval_generate")
    out = run / "iter_1" / "kl_generated.jsonl"
    out.write_text(out.read_text() + "\n")  # edited after the launch wrote it
    _run_stage(run, 1, "kl_generate")  # runs (alone), not taken from the record
    assert [Path(c).name for c in run1.fake.calls[1]] == ["kl_generate.yaml"]
    _plan(run1.tmp, "ifeval.max_tokens=99")  # the record was for the old IFEval config
    _run_stage(run, 1, "ifeval_generate")
    assert [Path(c).name for c in run1.fake.calls[2]] == ["ifeval_generate.yaml"]


def test_co_decode_false_or_a_missing_input_or_other_engine_settings_launch_alone(run1, capsys):
    run, tmp = run1.run, run1.tmp
    _plan(tmp, "co_decode=false")
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == []
    _plan(tmp, "ifeval.max_tokens=99")
    shutil.rmtree(run / "iter_1" / "model")
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == []
    assert "its input" in capsys.readouterr().out
    _fake_model(run / "iter_1" / "model", b"w1")
    _plan(tmp, "generation.max_model_len=1024", "ifeval.max_tokens=99")  # all three change alike: still together
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == [(1, "kl_generate"), (1, "ifeval_generate")]
    _plan(tmp, "generation_shards=2")  # a sampled stage cannot join an engine in processes of its own
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == [(1, "ifeval_generate")]
    assert "kl_generate of iteration 1 runs with its own engine start: it samples" in capsys.readouterr().out


def test_iteration_0_takes_along_only_what_the_evaluation_cache_does_not_hold(run1, capsys):
    run = run1.run
    # no KL at iteration 0; iteration 1's rollouts sample from the same starting policy
    assert co_decoding.co_decode_companions(run, 0, "eval_generate") == [(0, "ifeval_generate"), (1, "generate")]
    for stage in ("eval_generate", "ifeval_generate"):
        _run_stage(run, 0, stage)
    _run_stage(run, 1, "generate")
    assert len(run1.fake.calls) == 1
    other = _plan(run1.tmp, "seed=5", name="r2")  # another seed of the same starting policy
    assert co_decoding.co_decode_companions(other, 0, "eval_generate") == []  # both from the cache
    loop.exec_stage(other, 0, "eval_generate")
    assert "reused" in capsys.readouterr().out and len(run1.fake.calls) == 1


def test_the_next_iterations_rollouts_join_the_evaluation_of_the_policy_they_sample(tmp_path, cache, monkeypatch,
                                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    run = _plan(tmp_path, "iterations=2")
    _fake_model(run / "iter_1" / "model", b"w1")
    fake = FakeLauncher()
    monkeypatch.setattr("online_rlhf.procs.start_guarded", fake)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: fake(argv))
    # iteration 2 samples from iteration 1's model, the one iteration 1 evaluates
    assert co_decoding.co_decode_companions(run, 1, "eval_generate") == [(1, "kl_generate"), (1, "ifeval_generate"),
                                                                       (2, "generate")]
    _run_stage(run, 1, "eval_generate")
    assert "also decodes kl_generate, ifeval_generate of iteration 1 and generate of iteration 2" in \
        capsys.readouterr().out
    assert [Path(c).parent.parent.name + "/" + Path(c).name for c in fake.calls[0]][-1] == "iter_2/generate.yaml"
    for stage in ("kl_generate", "ifeval_generate"):
        _run_stage(run, 1, stage)
    _run_stage(run, 2, "generate")  # its turn: nothing runs
    out = capsys.readouterr().out
    assert "stage generate of iteration 2: decoded in the engine start of stage eval_generate of iteration 1" in out
    done = read_json(run / "iter_2" / "generate.done")
    assert (done["co_decoded_by"], done["co_decoded_iteration"]) == ("eval_generate", 1)
    assert len(fake.calls) == 1 and loop.check(run, 2, "generate")
    # a rollout setting changed after the launch: the record no longer holds, the rollouts rerun alone
    _plan(tmp_path, "iterations=2", "generation.max_tokens=33")
    assert not loop.check(run, 2, "generate")
    _run_stage(run, 2, "generate")
    assert [Path(c).name for c in fake.calls[1]] == ["generate.yaml"]


# ---------------------------------------------------------------- real engines (tiny random policy)

needs_infer = pytest.mark.skipif(not (ROOT / ".venv-infer" / "bin" / "python").exists(),
                                 reason="no .venv-infer (scripts/setup_envs.sh infer)")
SMALL = ["eval_limit=3", "evaluation.max_tokens=10", "generation.max_tokens=10", "generation.max_model_len=128", "generation.kv_cache_gb=0.25",
         "ifeval.max_tokens=12", "kl_samples=2"]


def _loop(*args: str, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "online_rlhf.loop", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _run_iteration_1(run: Path, env: dict) -> str:
    """eval_generate, kl_generate, ifeval_generate of iteration 1, then iteration 2's generate, as
    run_loop.sh runs them; their logs."""
    logs = []
    for i, stage in [*((1, s) for s in STAGES3), (2, "generate")]:
        if subprocess.run([sys.executable, "-m", "online_rlhf.loop", "check", str(run), str(i), stage], cwd=ROOT,
                          env=env, capture_output=True).returncode == 0:
            continue
        logs.append(_loop("exec", str(run), str(i), stage, env=env).stdout)
        _loop("mark", str(run), str(i), stage, "1", env=env)
    return "\n".join(logs)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("co_decode")
    policy = make_tiny_policy(tmp / "policy", hidden_size=128, seed=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ONLINE_RLHF_CACHE": str(tmp / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "ONLINE_RLHF_CO_DECODE"):
        env.pop(var, None)
    runs = {}
    for name, extra in (("together", []), ("apart", ["co_decode=false"])):
        run = _plan(tmp, *SMALL, "iterations=2", *extra, policy=policy, name=name)
        shutil.copytree(policy, run / "iter_1" / "model")  # as if DPO had saved the policy unchanged
        runs[name] = (run, _run_iteration_1(run, env))
    return SimpleNamespace(tmp=tmp, policy=policy, env=env, runs=runs)


@pytest.mark.slow
@needs_infer
def test_co_decoded_outputs_equal_separate_launches(real):
    (together, log_t), (apart, log_a) = real.runs["together"], real.runs["apart"]
    assert "also decodes kl_generate, ifeval_generate of iteration 1 and generate of iteration 2" in log_t
    assert "stage generate of iteration 2: decoded in the engine start of stage eval_generate of iteration 1" in log_t
    assert "co-decoding" not in log_a
    for out in ("iter_1/eval_generated.jsonl", "iter_1/kl_generated.jsonl", "iter_1/ifeval_generated.jsonl",
                "iter_2/generated.jsonl"):
        a, b = read_jsonl(together / out), read_jsonl(apart / out)
        assert a == b, out  # the sampled KL answers and rollouts too: each config's seed is restored first
    rollouts = read_jsonl(together / "iter_2" / "generated.jsonl")
    assert all(len(r["responses"]) > 1 for r in rollouts) and len({s for r in rollouts for s in r["responses"]}) > 1
    kl = read_jsonl(together / "iter_1" / "kl_generated.jsonl")
    assert len({s for r in kl for s in r["responses"]}) > 1  # sampled, not one repeated string
    eval_st = GenerateStats.read(stats_path(together / "iter_1" / "eval_generated.jsonl"))
    kl_st = GenerateStats.read(stats_path(together / "iter_1" / "kl_generated.jsonl"))
    assert eval_st.engine_startup_s > 0 and eval_st.engine_shared_with is None
    assert kl_st.engine_startup_s == 0.0 and kl_st.engine_shared_with.endswith("eval_generated/shard_00.jsonl")


@pytest.mark.slow
@needs_infer
def test_real_rerun_decodes_nothing_and_a_new_ifeval_setting_decodes_only_ifeval(real):
    run, _ = real.runs["together"]
    _plan(real.tmp, *SMALL, "iterations=2", policy=real.policy, name="together")
    assert _run_iteration_1(run, real.env) == ""  # every stage fresh: no exec at all
    before = {s: read_json(run / "iter_1" / f"{s}.done") for s in STAGES3}
    over = [o for o in SMALL if not o.startswith("ifeval.max_tokens")] + ["ifeval.max_tokens=14"]
    _plan(real.tmp, *over, "iterations=2", policy=real.policy, name="together")
    log = _run_iteration_1(run, real.env)
    assert "co-decoding" not in log and "/ifeval_generate.yaml" in log and "/eval_generate.yaml" not in log
    for s in ("eval_generate", "kl_generate"):
        assert read_json(run / "iter_1" / f"{s}.done") == before[s]
    assert read_json(run / "iter_1" / "ifeval_generate.done") != before["ifeval_generate"]
