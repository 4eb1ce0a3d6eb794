"""Compute dtype and thread choices from the hardware (online_rlhf/hardware.py), and where the
stages use them: the DPO stage's mixed precision and batch split, the loop's process count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from online_rlhf import hardware
from online_rlhf.config import ConfigError
from online_rlhf.loop import auto_processes
from online_rlhf.stage_configs import DPOStageConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cpu(monkeypatch):
    """Set what the (mocked) CPU can do: ``cpu(native_bf16=True)``."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("ONLINE_RLHF_CPU_BF16", raising=False)
    hardware._warned.clear()

    def set_(native_bf16: bool, amx: bool = False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return set_


def test_auto_on_cpu_is_bf16_only_with_native_bf16(cpu):
    cpu(native_bf16=False)
    assert hardware.compute_dtype("cpu") == "float32"
    cpu(native_bf16=True)
    assert hardware.compute_dtype("cpu") == "bfloat16"
    cpu(native_bf16=False, amx=True)  # AMX tiles count as native bf16 too
    assert hardware.compute_dtype("cpu") == "bfloat16"


def test_auto_on_gpu_is_bf16_where_supported_else_fp16(monkeypatch):
    monkeypatch.setattr(hardware, "_cuda_bf16", lambda: True)
    assert hardware.compute_dtype("cuda") == "bfloat16"
    monkeypatch.setattr(hardware, "_cuda_bf16", lambda: False)
    assert hardware.compute_dtype("cuda") == "float16"


def test_explicit_dtype_wins_and_slow_bf16_warns_once(cpu, capsys):
    cpu(native_bf16=True)
    assert hardware.compute_dtype("cpu", "float32") == "float32"
    assert capsys.readouterr().err == ""
    cpu(native_bf16=False)
    assert hardware.compute_dtype("cpu", "bfloat16") == "bfloat16"
    assert hardware.compute_dtype("cpu", "bfloat16") == "bfloat16"
    err = capsys.readouterr().err
    assert err.count("warning: dtype=bfloat16 on a CPU without native bf16") == 1 and "100x slower" in err
    with pytest.raises(ValueError, match="dtype='fp8'"):
        hardware.compute_dtype("cpu", "fp8")


def test_env_override_of_native_bf16(cpu, monkeypatch):
    cpu(native_bf16=False)
    monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", "1")
    assert hardware.compute_dtype("cpu") == "bfloat16"
    monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", "0")
    cpu(native_bf16=True)
    assert hardware.compute_dtype("cpu") == "float32"


def test_stage_threads_use_free_cores_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    assert hardware.stage_threads(env={}, free_cores=4.0) == 4
    assert hardware.stage_threads(env={}, free_cores=2.6) == 3      # a core kept busy by another job is left out
    assert hardware.stage_threads(2, env={}, free_cores=4.0) == 2   # split between the processes
    assert hardware.stage_threads(8, env={}, free_cores=4.0) == 1   # at least one each
    assert hardware.stage_threads(env={}, free_cores=0.1) == 1
    assert hardware.stage_threads(env={"OMP_NUM_THREADS": "3"}, free_cores=1.0) == 3


def test_online_rlhf_cores_fixes_the_cores_instead_of_measuring_them(monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    monkeypatch.setattr(hardware, "idle_cores", lambda sample_s=0.3: 1.0)  # another job holds 3 cores
    assert hardware.stage_threads(env={}) == 1
    assert hardware.stage_threads(env={"ONLINE_RLHF_CORES": "4"}) == 4     # not measured: the same on every run
    assert hardware.stage_threads(2, env={"ONLINE_RLHF_CORES": "4"}) == 2  # split between the processes
    assert hardware.stage_threads(env={"ONLINE_RLHF_CORES": "16"}) == 4    # at most the usable cores
    assert hardware.stage_threads(env={"ONLINE_RLHF_CORES": "2", "OMP_NUM_THREADS": "3"}) == 3


def test_idle_cores_is_within_the_usable_cores():
    free = hardware.idle_cores(0.05)
    assert 0.0 <= free <= hardware.usable_cores() + 1e-6


def test_thread_env_defaults_do_not_override_the_user():
    env = {"GOMP_SPINCOUNT": "5"}
    hardware.setdefault_thread_env(env)
    assert env["GOMP_SPINCOUNT"] == "5"
    env = {}
    hardware.setdefault_thread_env(env)
    assert env == hardware.THREAD_ENV_DEFAULTS


def test_auto_processes_divides_the_dpo_batch():
    assert auto_processes("cpu", [(4, 1)], free=2) == 2
    assert auto_processes("cpu", [(4, 1)], free=3) == 2    # 4 pairs do not split over 3 ranks
    assert auto_processes("cpu", [(6, 1), (4, 1)], free=4) == 2
    assert auto_processes("cpu", [(4, 4)], free=2) == 1    # 4 pairs = 1 per rank x 4 accumulation steps
    assert auto_processes("cpu", [(None, 1)], free=3) == 3


def _run_dpo():
    from online_rlhf.stages import run_dpo

    return run_dpo


def _dpo_config():
    from online_rlhf import dpo_config

    return dpo_config


def test_dpo_batch_is_global_over_processes():
    dpo_config = _dpo_config()
    cfg = DPOStageConfig(policy="p", pairs="x.jsonl", output_dir="o", train_batch_size=8,
                         training={"gradient_accumulation_steps": 2})
    assert dpo_config.batch_args(cfg, 1) == {"per_device_train_batch_size": 4}
    assert dpo_config.batch_args(cfg, 2) == {"per_device_train_batch_size": 2}
    with pytest.raises(ConfigError, match="not a multiple of 3 process"):
        dpo_config.batch_args(cfg, 3)
    both = cfg.model_copy(update={"training": {"per_device_train_batch_size": 2}})
    with pytest.raises(ConfigError, match="both set"):
        dpo_config.batch_args(both, 1)


def test_dpo_mixed_precision_follows_the_cpu(cpu, monkeypatch):
    dpo_config = _dpo_config()
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    cpu(native_bf16=False)
    assert dpo_config.training_defaults(False, 1)["bf16"] is False
    cpu(native_bf16=True)
    assert dpo_config.training_defaults(False, 1)["bf16"] is True
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # DeepSpeed on CPU stays fp32
    assert dpo_config.training_defaults(False, 2)["bf16"] is False
    monkeypatch.setattr(hardware, "_cuda_bf16", lambda: False)
    assert dpo_config.training_defaults(True, 1)["fp16"] is True


def _pairs(path: Path) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"Question {i}: is the sky blue?"}],
             "chosen": [{"role": "assistant", "content": "yes yes yes"}],
             "rejected": [{"role": "assistant", "content": "no no no no"}]} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_dpo_bf16_autocast_first_loss_is_within_tolerance_of_fp32(tmp_path, monkeypatch):
    """Where the CPU has native bf16 the stage trains under bf16 autocast (fp32 weights); forced here
    (bf16 is emulated, slowly, on CPUs without it) to check the numbers, not the speed."""
    pytest.importorskip("trl")
    from online_rlhf.testing import make_tiny_policy

    run_dpo = _run_dpo()
    policy, ref = make_tiny_policy(tmp_path / "p0", seed=0), make_tiny_policy(tmp_path / "p1", seed=1)
    pairs = _pairs(tmp_path / "pairs.jsonl")
    losses = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", flag)
        cfg = DPOStageConfig(policy=str(policy), reference=str(ref), pairs=str(pairs),
                             output_dir=str(tmp_path / f"m{flag}"), train_batch_size=4,
                             training={"max_steps": 1, "beta": 2.0, "max_length": 128, "learning_rate": 1e-4})
        stats = run_dpo.main(cfg)
        assert stats.hardware["dtype"] == ("float32 + bf16 autocast" if flag == "1" else "float32")
        losses[flag] = stats.train_loss_first
    assert abs(losses["0"] - 0.6931) > 0.01, losses  # the two models differ: the loss is not log(2)
    assert losses["1"] == pytest.approx(losses["0"], abs=0.02), losses


def test_reward_model_bf16_scores_are_within_tolerance_of_fp32(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from online_rlhf.reward_model import RewardModel
    from online_rlhf.testing import make_tiny_reward_model

    rm_dir = make_tiny_reward_model(tmp_path / "rm")
    prompts = [[{"role": "user", "content": f"Tell me about item {i}."}] for i in range(6)]
    responses = [f"Item {i} is {'very ' * i}nice." for i in range(6)]
    scores = {}
    for dtype in ("float32", "bfloat16"):
        rm = RewardModel(str(rm_dir), dtype=dtype, device="cpu")
        scores[dtype] = rm.score(prompts, responses, batch_size=3)[0]
    spread = max(scores["float32"]) - min(scores["float32"])
    assert spread > 0
    for a, b in zip(scores["float32"], scores["bfloat16"]):
        assert b == pytest.approx(a, abs=0.05 + 0.02 * abs(a))


def test_slow_dtype_warning_only_for_bf16_on_a_cpu_without_it():
    info = {"device": "cpu", "dtype": "bfloat16", "cpu_native_bf16": False, "cpu_model": "X", "cpu_capability": "AVX2"}
    assert "100x slower" in hardware.slow_dtype_warning(info)
    assert hardware.slow_dtype_warning({**info, "cpu_native_bf16": True}) is None
    assert hardware.slow_dtype_warning({**info, "dtype": "float32"}) is None
    assert hardware.slow_dtype_warning({**info, "device": "cuda"}) is None


def test_stage_outputs_that_would_replace_their_input_are_refused(tmp_path):
    from online_rlhf.stage_configs import GenerateConfig

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    with pytest.raises(ValueError, match="is the prompt file"):
        GenerateConfig(prompts=str(prompts), output=str(prompts))
    model = tmp_path / "m"
    model.mkdir()
    with pytest.raises(ValueError, match="is the policy checkpoint"):
        DPOStageConfig(policy=str(model), pairs="x.jsonl", output_dir=str(model))
    with pytest.raises(ValueError, match="is the reference checkpoint"):
        DPOStageConfig(policy="default", reference=str(model), pairs="x.jsonl", output_dir=str(model) + "/")


def test_only_the_bitsandbytes_kernels_notice_is_dropped(caplog):
    """bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community" on every
    peft/trl import on an AVX512-BF16 CPU without `kernels`; online_rlhf drops that message alone."""
    import importlib.util
    import logging

    import online_rlhf

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                    "`pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        log.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]
    spec = importlib.util.find_spec("bitsandbytes")  # the installed version still logs that text from that module
    if spec is not None:
        ops = Path(spec.origin).parent / "backends" / "cpu" / "ops.py"
        assert online_rlhf._BNB_KERNELS_NOTICE in ops.read_text(), f"{ops}: the notice changed; update the filter"


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5"])
def test_a_bad_online_rlhf_cores_is_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=f"ONLINE_RLHF_CORES='{value}'.*whole number"):
        hardware.fixed_cores({"ONLINE_RLHF_CORES": value})
    with pytest.raises(ValueError, match="ONLINE_RLHF_CORES"):
        hardware.stage_threads(env={"ONLINE_RLHF_CORES": value})


def test_online_rlhf_cores_over_the_usable_cores_is_lowered_with_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 2)
    monkeypatch.setattr(hardware, "_warned", set())
    assert hardware.fixed_cores({"ONLINE_RLHF_CORES": "99"}) == 2
    assert "using 2" in capsys.readouterr().err
    assert hardware.fixed_cores({"ONLINE_RLHF_CORES": ""}) is None and hardware.fixed_cores({}) is None


def test_auto_processes_take_online_rlhf_cores_and_refuse_a_bad_one(monkeypatch):
    from online_rlhf.config import ConfigError

    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    monkeypatch.setenv("ONLINE_RLHF_CORES", "1")
    assert auto_processes("cpu", [(4, 1)]) == 1
    monkeypatch.setenv("ONLINE_RLHF_CORES", "two")
    with pytest.raises(ConfigError, match="ONLINE_RLHF_CORES='two'"):
        auto_processes("cpu", [(4, 1)])
