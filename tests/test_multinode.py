"""Multi-node settings (docs/multi-node.md): loop config validation, the launch commands
for several machines (local and SLURM), the plan's stage configs, ``loop exec machine_rank=R``, and a
two-"machine" simulation on this host of one DPO step and one reward-model scoring pass, compared
with the single-machine run of the same config.

The simulations start two ``accelerate launch`` commands, machine_rank 0 and 1, each with one CPU
process over gloo, meeting at 127.0.0.1 on a free port: the same launcher path as two real machines,
only the address differs. They are ``slow`` (each launch starts torch, transformers and TRL twice).
"""

from __future__ import annotations

import json
import re
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from online_rlhf.config import ConfigError
from online_rlhf.loop import auto_processes, resolve
from online_rlhf.loop_config import LoopConfig
from online_rlhf.stage_configs import DPOStageConfig, GenerateConfig, RewardConfig
from online_rlhf.stage_launch import launch_command
from online_rlhf.stage_table import STAGES
from online_rlhf.stats import stats_path
from online_rlhf.testing import example_stats, free_port

ROOT = Path(__file__).resolve().parent.parent
TWO = ["num_machines=2", "main_process_ip=10.1.2.3", "main_process_port=29511"]


def _cmd(argv: list[str], env: dict) -> str:
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, argv)])


# --- config validation ------------------------------------------------------------------------------

def test_several_machines_need_the_address_of_machine_0():
    with pytest.raises(ConfigError, match="num_machines=2 needs main_process_ip"):
        LoopConfig.from_dict({"num_machines": 2})
    with pytest.raises(ConfigError, match="num_machines=2 needs main_process_ip"):
        DPOStageConfig.from_dict({"policy": "p", "pairs": "x", "output_dir": "/tmp/o", "num_machines": 2})


def test_num_processes_counts_all_machines_and_must_divide_by_them():
    with pytest.raises(ConfigError, match=r"num_processes=3 .* multiple of num_machines=2"):
        LoopConfig.from_dict({"num_machines": 2, "main_process_ip": "h", "num_processes": 3})
    with pytest.raises(ValueError, match=r"num_processes=3 .* multiple of num_machines=2"):
        RewardConfig(input="i", output="o", source="reward_model", reward_model="rm", num_processes=3,
                     num_machines=2, main_process_ip="h")
    assert LoopConfig.from_dict({"num_machines": 2, "main_process_ip": "h", "num_processes": 4}).num_processes == 4


def test_machine_rank_port_and_launcher_are_checked():
    with pytest.raises(ConfigError, match="machine_rank=2 must be < num_machines=2"):
        LoopConfig.from_dict({"num_machines": 2, "main_process_ip": "h", "machine_rank": 2})
    with pytest.raises(ConfigError, match="main_process_port"):
        LoopConfig.from_dict({"main_process_port": 70000})
    with pytest.raises(ConfigError, match="launcher"):
        LoopConfig.from_dict({"launcher": "mpi"})
    with pytest.raises(ValueError, match="machine_rank=1 must be < num_machines=1"):
        GenerateConfig(prompts="p", output="o.jsonl", machine_rank=1)


def test_a_single_process_reward_source_is_not_spread_over_machines():
    with pytest.raises(ValueError, match="source=verifier runs in one process on machine 0"):
        RewardConfig(input="i", output="o", num_machines=2, main_process_ip="h")


def test_plan_refuses_a_machine_rank_other_than_0_naming_loop_exec(tmp_path):
    with pytest.raises(ConfigError, match=r"machine_rank=1: run_loop.sh and the plan run on machine 0 only.*"
                                          r"loop exec RUN_DIR ITER STAGE machine_rank=1"):
        resolve(None, [f"output_root={tmp_path}", *TWO, "machine_rank=1", "num_processes=2"])


@pytest.mark.parametrize("key", ["num_machines", "main_process_ip", "main_process_port", "launcher", "machine_rank"])
def test_machine_keys_are_run_level(tmp_path, key):
    with pytest.raises(ConfigError, match=rf"per_iteration.1.{key}: cannot be set per iteration"):
        resolve(None, [f"output_root={tmp_path}", f"per_iteration.1.{key}=1"])


@pytest.mark.parametrize("section,key", [("dpo", "num_machines"), ("dpo", "main_process_ip"),
                                         ("reward", "main_process_port"), ("generation", "num_machines"),
                                         ("generation", "machine_rank")])
def test_sections_refuse_the_machine_keys_the_loop_sets(tmp_path, section, key):
    with pytest.raises(ConfigError, match=rf"{section}.{key}: cannot be set here; .*(top level|machine_rank=k)"):
        resolve(None, [f"output_root={tmp_path}", f"{section}.{key}=1"])


def test_auto_processes_is_per_machine_count_times_machines():
    # 3 usable cores per machine, 2 machines, batch 8: 3x2=6 and 2x2... 8 % 4 == 0 -> 2 per machine, 4 in all
    assert auto_processes("cpu", [(8, 1)], free=3, num_machines=2) == 4
    assert auto_processes("cpu", [(None, 1)], free=3, num_machines=2) == 6
    assert auto_processes("cpu", [(3, 1)], free=2, num_machines=2) == 2  # 1 per machine: never below one
    assert auto_processes("cpu", [(8, 1)], free=2) == 2  # one machine: as before


# --- launch commands ----------------------------------------------------------------------------------

def _dpo_dict(**kw) -> dict:
    return DPOStageConfig(policy="p", pairs="x.jsonl", output_dir="/tmp/out", **kw).model_dump(mode="json")


def test_launch_command_adds_the_machine_flags_when_there_are_several():
    d = _dpo_dict(num_processes=4, num_machines=2, main_process_ip="10.1.2.3", main_process_port=29511)
    for rank in (0, 1):
        argv, env = launch_command(STAGES["dpo"], "c.yaml", d, root=Path("."), machine_rank=rank)
        assert _cmd(argv, env) == (
            f"ACCELERATE_USE_CPU=true .venv-train/bin/accelerate launch --num_machines 2 --machine_rank {rank} "
            "--main_process_ip 10.1.2.3 --main_process_port 29511 --multi_gpu --num_processes 4 "
            "dpo_iteration/run_dpo.py --config c.yaml")
    d["launch_profile"] = "zero2"
    argv, env = launch_command(STAGES["dpo"], "c.yaml", d, root=Path("."), machine_rank=1)
    assert argv[2:12] == ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.1.2.3",
                          "--main_process_port", "29511", "--config_file", "configs/accelerate/zero2.yaml"] and env == {}
    with pytest.raises(ConfigError, match=r"machine_rank=2 must be in 0..1"):
        launch_command(STAGES["dpo"], "c.yaml", d, machine_rank=2)


def test_one_machine_commands_are_unchanged():
    d = _dpo_dict(num_processes=2)
    argv, env = launch_command(STAGES["dpo"], "c.yaml", d, root=Path("."))
    assert _cmd(argv, env) == ("ACCELERATE_USE_CPU=true .venv-train/bin/accelerate launch --multi_gpu --num_processes 2 "
                               "dpo_iteration/run_dpo.py --config c.yaml")
    assert launch_command(STAGES["dpo"], "c.yaml", d, root=Path("."), launcher="slurm") == (argv, env)  # no srun for 1
    g = GenerateConfig(prompts="p", output="o.jsonl", num_shards=2).model_dump(mode="json")
    assert launch_command(STAGES["generate"], "g.yaml", g, root=Path(".")) == (
        [".venv-infer/bin/python", "generation/launch.py", "--config", "g.yaml"], {})
    with pytest.raises(ConfigError, match="stage generate runs on machine 0 only"):
        launch_command(STAGES["generate"], "g.yaml", g, machine_rank=1)


def test_slurm_wraps_the_command_in_srun_once_per_node():
    d = _dpo_dict(num_processes=16, num_machines=2, main_process_ip="node-a", main_process_port=29511,
                  launch_profile="zero2")
    argv, env = launch_command(STAGES["dpo"], "runs/x y/c.yaml", d, root=Path("."), launcher="slurm")
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    assert argv[6] == (".venv-train/bin/accelerate launch --num_machines 2 --machine_rank \"$SLURM_NODEID\" "
                       "--main_process_ip node-a --main_process_port 29511 --config_file configs/accelerate/zero2.yaml "
                       "--num_processes 16 dpo_iteration/run_dpo.py --config 'runs/x y/c.yaml'")
    # the words each node's shell runs: its own rank, the path with a space kept whole
    for node in ("0", "1"):
        words = subprocess.run(["bash", "-c", "f() { printf '%s\\n' \"$@\"; }; f " + argv[6]], capture_output=True,
                               text=True, env={**os.environ, "SLURM_NODEID": node}).stdout.splitlines()
        assert words[words.index("--machine_rank") + 1] == node and words[-1] == "runs/x y/c.yaml"
    g = GenerateConfig(prompts="p", output="o.jsonl", num_shards=4, num_machines=2).model_dump(mode="json")
    argv, _ = launch_command(STAGES["generate"], "g.yaml", g, root=Path("."), launcher="slurm")
    assert argv[-1] == '.venv-infer/bin/python generation/launch.py --config g.yaml machine_rank="$SLURM_NODEID"'


# --- the plan and loop exec -----------------------------------------------------------------------------

def _plan(tmp_path, *extra):
    from online_rlhf.loop import plan

    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i}"}) + "\n" for i in range(4)))
    (tmp_path / "pol").mkdir(exist_ok=True)
    return plan(None, [f"output_root={tmp_path}", "run_name=r", f"policy={tmp_path / 'pol'}",
                       f"train_prompts={prompts}", f"eval_prompts={prompts}", "iterations=1", "reward.source=reward_model",
                       f"reward.reward_model={tmp_path / 'pol'}", "generation_shards=4", *extra])


def test_plan_writes_machine_keys_into_the_distributed_stages(tmp_path, capsys):
    run = _plan(tmp_path, *TWO, "num_processes=4")
    for stage in ("dpo", "rewards", "eval_rewards"):
        d = yaml.safe_load((run / "iter_1" / "configs" / f"{stage}.yaml").read_text())
        assert (d["num_machines"], d["main_process_ip"], d["main_process_port"], d["num_processes"]) == (
            2, "10.1.2.3", 29511, 4), stage
    text = (run / "iter_1" / "configs" / "dpo.yaml").read_text()
    assert "--num_machines 2 --machine_rank 0 --main_process_ip 10.1.2.3 --main_process_port 29511" in text
    assert f"loop exec {run} 1 dpo machine_rank=k" in text
    assert "num_machines: 2  <- loop key num_machines (command line: num_machines=2)" in text
    gen = yaml.safe_load((run / "iter_1" / "configs" / "generate.yaml").read_text())
    assert (gen["num_machines"], gen["machine_rank"], gen["num_shards"]) == (2, 0, 4)
    pairs = yaml.safe_load((run / "iter_1" / "configs" / "pairs.yaml").read_text())
    assert "num_machines" not in pairs


def test_plan_one_machine_leaves_address_and_port_unset(tmp_path):
    run = _plan(tmp_path, "num_processes=2", "main_process_port=29999")
    d = yaml.safe_load((run / "iter_1" / "configs" / "dpo.yaml").read_text())
    assert (d["num_machines"], d["main_process_ip"], d["main_process_port"]) == (1, None, None)


def test_plan_header_shows_the_srun_command_under_slurm(tmp_path):
    run = _plan(tmp_path, *TWO, "num_processes=4", "launcher=slurm")
    text = (run / "iter_1" / "configs" / "dpo.yaml").read_text()
    cmd = next(line for line in text.splitlines() if "srun" in line)
    assert cmd.startswith("#   ACCELERATE_USE_CPU=true srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
                          "'.venv-train/bin/accelerate launch --num_machines 2 --machine_rank \"$SLURM_NODEID\" ")
    assert "machine_rank=k" not in text  # srun starts every node's part
    assert json.loads((run / "iter_1" / "plan.json").read_text())["dpo"]["command"] == cmd[4:]


def test_loop_exec_on_another_machine(tmp_path, capsys):
    from online_rlhf import loop

    run = _plan(tmp_path, *TWO, "num_processes=4")
    loop.exec_stage(run, 1, "pairs", machine_rank=1)  # machine 0 only: returns, nothing started
    assert "runs on machine 0 only" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"machine_rank=2 must be in 0..1"):
        loop.exec_stage(run, 0, "eval_generate", machine_rank=2)
    assert loop.previous_stage(run, 1, "generate") == (0, "ifeval_score")  # IFEval ends iteration 0 (ifeval.when=ends)
    assert loop.previous_stage(run, 1, "dpo") == (1, "pairs")
    assert loop.previous_stage(run, 0, "eval_generate") is None
    slurm = _plan(tmp_path / "s", *TWO, "num_processes=4", "launcher=slurm")
    with pytest.raises(ConfigError, match="launcher=slurm"):
        loop.exec_stage(slurm, 1, "dpo", machine_rank=1)
    assert loop.main(["exec", str(run), "1", "dpo", "machine_rank=one"]) == 2
    assert "machine_rank='one' is not an integer" in capsys.readouterr().err


# --- two "machines" on this host -------------------------------------------------------------------------

def _run_machines(stage: str, cfg_path: Path, d: dict, tmp_path: Path, machines: int) -> None:
    """Start the stage's launch command once per machine rank (all at once, as on real machines),
    from the project root, and wait for all; fail with the logs of a failed one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = []
    for rank in range(machines):
        argv, extra = launch_command(STAGES[stage], str(cfg_path), d, machine_rank=rank)
        if machines == 1 and argv[1] == "launch":  # one machine on a shared box: a free port, not 29500
            argv[2:2] = ["--main_process_port", str(free_port())]
        log = open(tmp_path / f"{cfg_path.stem}.rank{rank}.log", "w")
        procs.append((subprocess.Popen(argv, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT),
                      log))
    for p, log in procs:
        try:
            p.wait(timeout=900)
        finally:
            log.close()
    for p, log in procs:
        assert p.returncode == 0, Path(log.name).read_text()[-5000:]


def _pair(i: int) -> dict:
    return {"id": str(i), "prompt": [{"role": "user", "content": f"Question {i}: is the sky blue?"}],
            "chosen": [{"role": "assistant", "content": f"yes {i}"}],
            "rejected": [{"role": "assistant", "content": "no, the sky is green"}], "chosen_reward": 1.0,
            "rejected_reward": 0.0}


@pytest.mark.slow
def test_dpo_on_two_machines_equals_one_machine(tmp_path):
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    from online_rlhf.stats import DPOStats, stats_path
    from online_rlhf.testing import make_tiny_policy

    policy = make_tiny_policy(tmp_path / "policy", seed=1)
    ref = make_tiny_policy(tmp_path / "ref", seed=0)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(_pair(i)) + "\n" for i in range(4)))
    runs = {}
    for name, machines in (("one", 1), ("two", 2)):
        extra = ({"num_machines": 2, "main_process_ip": "127.0.0.1", "main_process_port": free_port()}
                 if machines == 2 else {})
        cfg = DPOStageConfig(policy=str(policy), reference=str(ref), pairs=str(pairs), output_dir=str(tmp_path / name),
                             train_batch_size=4, num_processes=2, **extra,
                             training={"max_steps": 2, "learning_rate": 1e-4, "beta": 2.0, "max_length": 128,
                                       "gradient_checkpointing": False})
        d = cfg.model_dump(mode="json")
        cfg_path = tmp_path / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(d))
        _run_machines("dpo", cfg_path, d, tmp_path, machines)
        runs[name] = DPOStats.read(stats_path(tmp_path / name))
    one, two = runs["one"], runs["two"]
    assert one.num_processes == two.num_processes == 2 and one.steps == two.steps == 2
    losses = {k: [h["loss"] for h in v.history if "loss" in h] for k, v in runs.items()}
    print("DPO losses per step (one machine, two machines):", losses["one"], losses["two"])
    assert abs(one.train_loss_first - 0.6931) > 0.01  # policy != reference: a real loss, not log 2
    assert two.train_loss_first == pytest.approx(one.train_loss_first, rel=1e-5)
    assert losses["two"] == pytest.approx(losses["one"], rel=1e-5)
    w1, w2 = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    print(f"max |weight difference| after 2 steps: {diff:.3g}")
    assert set(w1) == set(w2) and diff <= 1e-6


@pytest.mark.slow
def test_reward_model_scoring_on_two_machines_equals_one_machine(tmp_path):
    pytest.importorskip("transformers")
    from online_rlhf.jsonl import read_jsonl, write_jsonl
    from online_rlhf.stats import RewardStats, stats_path
    from online_rlhf.testing import make_tiny_reward_model

    rm = make_tiny_reward_model(tmp_path / "rm")
    recs = [{"id": str(i), "prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
             "responses": [f"{2 * i}", f"It is {2 * i + 1}.", "I do not know " * (i + 1)],
             "finish_reasons": ["stop"] * 3, "response_tokens": [3] * 3} for i in range(7)]  # 21: uneven split
    write_jsonl(tmp_path / "generated.jsonl", recs)
    out = {}
    for name, machines in (("one", 1), ("two", 2)):
        extra = ({"num_machines": 2, "main_process_ip": "127.0.0.1", "main_process_port": free_port()}
                 if machines == 2 else {})
        cfg = RewardConfig(input=str(tmp_path / "generated.jsonl"), output=str(tmp_path / f"{name}.jsonl"),
                           source="reward_model", reward_model=str(rm), batch_size=3, num_processes=2, **extra)
        d = cfg.model_dump(mode="json")
        cfg_path = tmp_path / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(d))
        _run_machines("rewards", cfg_path, d, tmp_path, machines)
        out[name] = read_jsonl(tmp_path / f"{name}.jsonl")
        assert RewardStats.read(stats_path(tmp_path / f"{name}.jsonl")).num_processes == 2
    assert [r["id"] for r in out["two"]] == [r["id"] for r in recs]
    diff = max(abs(a - b) for ra, rb in zip(out["one"], out["two"]) for a, b in zip(ra["rewards"], rb["rewards"]))
    print(f"max |reward difference| two machines vs one: {diff:.3g}")
    for ra, rb in zip(out["one"], out["two"]):
        assert rb["rewards"] == pytest.approx(ra["rewards"], abs=1e-6)


# --- scripts ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["scripts/slurm_loop.sbatch", "scripts/other_machine.sh"])
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("gpus", ["8", ""])
def test_slurm_batch_script_runs_the_loop_on_the_first_node(tmp_path, gpus):
    # SLURM's scontrol and run_loop.sh replaced by stand-ins that print what they were given
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    (bin_dir / "scontrol").chmod(0o755)
    stub = tmp_path / "run_loop_stub.sh"
    stub.write_text('printf "%s\\n" "$@"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "12345", "SLURM_GPUS_ON_NODE": gpus, "SLURM_SUBMIT_DIR": str(ROOT),
           "ONLINE_RLHF_RUN_LOOP": str(stub)}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_loop.sbatch"), "configs/loop.yaml", "iterations=3"],
                       env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    args = r.stdout.splitlines()[1:]
    assert "machine 0: gpu-node-07" in r.stdout.splitlines()[0]
    expected = [*(["num_processes=16", "generation_shards=16"] if gpus else []), "configs/loop.yaml", "iterations=3",
                "launcher=slurm", "num_machines=2", "machine_rank=0", "main_process_ip=gpu-node-07",
                "main_process_port=32345"]
    assert args == expected
    # a key given as an argument replaces the script's default (not given twice: the loop refuses that)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_loop.sbatch"), "configs/loop.yaml", "num_processes=4"],
                       env=env, capture_output=True, text=True, cwd=tmp_path)
    args = r.stdout.splitlines()[1:]
    head = [*(["generation_shards=16"] if gpus else []), "configs/loop.yaml", "num_processes=4"]
    assert args[:len(head)] == head
    assert sum(a.startswith("num_processes=") for a in args) == 1


@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_other_machine_script_takes_part_in_every_planned_stage(tmp_path, algorithm):
    # every stage of a planned two-machine run done (outputs made up, markers written), with KL and
    # IFEval on and a reward model: machine 1's script goes through every stage the plan holds, in
    # the stage table's order (GRPO, kl_generate and ifeval_generate included: a hand-written list
    # had missed them), takes part in every distributed one, and starts nothing
    from online_rlhf import loop

    run = _plan(tmp_path, *TWO, "num_processes=4", f"algorithm={algorithm}", "kl_samples=1", "ifeval.when=every")
    planned = []
    for i in (0, 1):
        for name, e in json.loads((run / f"iter_{i}" / "plan.json").read_text()).items():
            planned.append(f"iteration {i} · {name}")
            for out in map(Path, e["outputs"]):
                if out.suffix:
                    out.write_text("{}\n")
                else:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "config.json").write_text("{}")
                    (out / "model.safetensors").write_text("")
                example_stats(STAGES[name].stats).write(stats_path(out))  # a finished stage has its stats
            loop.mark(run, i, name, 1.0)
    assert {algorithm, "kl_generate", "ifeval_generate"} <= {p.split(" · ")[1] for p in planned}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "other_machine.sh"), str(run), "1"], capture_output=True,
                       text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    visited = [ln.split("] ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("[machine 1] iteration")]
    assert visited == planned
    assert "+ " not in r.stdout and "all stages done" in r.stdout  # no command started
    # machine 1 takes part in every distributed stage (generation shards, the reward model, the
    # update) and finds it done; the others are machine 0's
    distributed = {"generate", "rewards", algorithm, "eval_generate", "eval_rewards", "kl_generate", "ifeval_generate"}
    assert distributed <= {p.split(" · ")[1] for p in planned}
    for p in planned:
        i, name = int(p.split(" · ")[0].split()[1]), p.split(" · ")[1]
        said = ("is done and fresh; nothing to run on machine 1" if name in distributed else "runs on machine 0 only")
        assert f"stage {name} of iteration {i} {said}" in r.stdout, p


def test_no_script_keeps_its_own_list_of_stages():
    """The stage table is the only list: run_loop.sh and other_machine.sh name no stage of it."""
    for script in ("run_loop.sh", "scripts/other_machine.sh"):
        text = (ROOT / script).read_text()
        assert "online_rlhf.loop stages" in text, script
        for name in STAGES:  # no `run_stage 0 eval_generate` / `stage "$i" dpo` line of its own
            assert not re.search(rf"^\s*(run_stage|stage)\s+\S+\s+{name}\s*$", text, re.M), (script, name)


def test_threads_are_split_between_the_ranks_of_this_machine():
    from online_rlhf.hardware import processes_here

    assert processes_here(4, env={"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}) == 2  # 2 machines x 2 ranks
    assert processes_here(4, env={}) == 4  # not launched by accelerate: as given


def test_review_fixes_dry_run_ip_and_rank_are_checked_up_front(tmp_path):
    """A dry run is measured on one machine; a host:port address and an out-of-range rank are
    refused before anything waits or starts."""
    from online_rlhf import loop

    with pytest.raises(ConfigError, match=r"dry_run=true with num_machines=2.*num_machines=1"):
        _plan(tmp_path / "d", *TWO, "num_processes=4", "dry_run=true")
    with pytest.raises(ConfigError, match=r"main_process_ip='10\.0\.0\.1:29500' must be one host name"):
        _plan(tmp_path / "p", "num_machines=2", "main_process_ip=10.0.0.1:29500", "num_processes=4")
    run = _plan(tmp_path, *TWO, "num_processes=4")
    with pytest.raises(ConfigError, match=r"machine_rank=2 must be in 0\.\.1"):
        loop.exec_stage(run, 1, "dpo", machine_rank=2)  # no wait for machine 0's pairs first
