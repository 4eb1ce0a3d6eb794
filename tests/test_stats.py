"""online_rlhf.stats: the stats path rule, and each stage's stats model refusing missing/unknown keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from online_rlhf import stats as S
from online_rlhf.jsonl import DataError, write_json
from online_rlhf.stage_configs import DPOStageConfig, GenerateConfig, PairsConfig, RewardConfig, SFTDataConfig, SFTStageConfig
from online_rlhf.testing import example_stats

ROOT = Path(__file__).resolve().parent.parent
CLASSES = [S.GenerateShardStats, S.GenerateStats, S.RewardStats, S.PairsStats, S.DPOStats, S.SFTStats, S.SFTDataStats]


@pytest.mark.parametrize("output,expected", [
    ("runs/x/iter_1/generated.jsonl", "runs/x/iter_1/generated.jsonl.stats.json"),
    ("runs/x/iter_1/generated/shard_00.jsonl", "runs/x/iter_1/generated/shard_00.jsonl.stats.json"),
    ("runs/x/iter_1/model", "runs/x/iter_1/model.stats.json"),
    ("runs/x/iter_1/model/", "runs/x/iter_1/model.stats.json"),
    ("/abs/sft/model", "/abs/sft/model.stats.json"),
])
def test_stats_path_is_beside_the_output(output, expected):
    assert S.stats_path(output) == Path(expected)


@pytest.mark.parametrize("bad", ["", "/", "."])
def test_stats_path_needs_a_name(bad):
    with pytest.raises(ValueError, match="names no file or folder"):
        S.stats_path(bad)


@pytest.mark.parametrize("cls", [GenerateConfig, RewardConfig, PairsConfig, DPOStageConfig, SFTStageConfig, SFTDataConfig])
def test_no_stage_config_has_a_stats_output_override(cls):
    assert "stats_output" not in cls.model_fields


@pytest.mark.parametrize("cls", CLASSES)
def test_round_trip(cls, tmp_path):
    st = example_stats(cls)
    path = st.write(tmp_path / "out.jsonl.stats.json")
    assert cls.read(path) == st
    assert json.loads(path.read_text()) == st.model_dump(mode="json")


@pytest.mark.parametrize("cls", CLASSES)
def test_missing_key_is_refused_naming_file_key_and_writer(cls, tmp_path):
    data = example_stats(cls).model_dump(mode="json")
    key = next(k for k in data if k != "stage")
    del data[key]
    path = tmp_path / "x.stats.json"
    write_json(path, data)
    with pytest.raises(DataError) as e:
        cls.read(path)
    msg = str(e.value)
    assert str(path) in msg and f"missing key {key!r}" in msg and cls.WRITTEN_BY in msg


@pytest.mark.parametrize("cls", CLASSES)
def test_unknown_key_is_refused(cls, tmp_path):
    data = {**example_stats(cls).model_dump(mode="json"), "stats_outptu": 1}
    path = tmp_path / "x.stats.json"
    write_json(path, data)
    with pytest.raises(DataError, match=rf"{path}.*unknown key 'stats_outptu'"):
        cls.read(path)


def test_renamed_key_names_both_and_nested_keys_are_checked(tmp_path):
    data = example_stats(S.DPOStats).model_dump(mode="json")
    data["train_loss_final"] = data.pop("train_loss_last")
    del data["seconds"]["save"]
    path = tmp_path / "model.stats.json"
    write_json(path, data)
    with pytest.raises(DataError) as e:
        S.DPOStats.read(path)
    msg = str(e.value)
    assert "missing key 'train_loss_last'" in msg and "unknown key 'train_loss_final'" in msg
    assert "missing key 'seconds.save'" in msg and "run_dpo.py" in msg


def test_wrong_type_and_wrong_stage_are_refused(tmp_path):
    path = tmp_path / "pairs.jsonl.stats.json"
    example_stats(S.PairsStats).write(path)
    with pytest.raises(DataError, match=r"not valid RewardStats.*key 'stage'"):
        S.RewardStats.read(path)  # another stage's file
    write_json(path, {**example_stats(S.PairsStats).model_dump(mode="json"), "pairs_out": "many"})
    with pytest.raises(DataError, match=r"key 'pairs_out'.*'many'"):
        S.PairsStats.read(path)
    write_json(path, [1, 2])
    with pytest.raises(DataError, match="expected a JSON object of PairsStats"):
        S.PairsStats.read(path)


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.stats.json"):
        S.RewardStats.read(tmp_path / "nope.stats.json")


def test_null_where_a_value_is_required_is_refused(tmp_path):
    path = tmp_path / "r.stats.json"
    write_json(path, {**example_stats(S.RewardStats).model_dump(mode="json"), "seconds": None})
    with pytest.raises(DataError, match="key 'seconds'"):
        S.RewardStats.read(path)


def test_write_is_atomic_and_refuses_nan(tmp_path):
    path = tmp_path / "p.stats.json"
    example_stats(S.PairsStats).write(path)
    before = path.read_text()
    with pytest.raises(ValueError):
        example_stats(S.PairsStats, margin_mean=float("nan")).write(path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["p.stats.json"]


def test_stats_module_imports_without_torch_or_vllm():
    code = ("import sys; import online_rlhf.stats, online_rlhf.loop; "
            "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


def test_build_sft_data_stats_round_trip(tmp_path):
    from online_rlhf.jsonl import write_jsonl
    from online_rlhf.stages import build_sft_data

    rewards = tmp_path / "rewards.jsonl"
    write_jsonl(rewards, [{"id": "a", "prompt": [{"role": "user", "content": "q"}], "responses": ["x", "y"],
                           "finish_reasons": ["stop", "stop"], "rewards": [1.0, 0.0]}])
    out = tmp_path / "sft.jsonl"
    st = build_sft_data.main(SFTDataConfig.from_dict({"rewards": str(rewards), "output": str(out)}))
    assert S.SFTDataStats.read(S.stats_path(out)) == st and st.kept == 1
