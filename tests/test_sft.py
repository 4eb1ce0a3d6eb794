"""SFT stage (sft/run_sft.py, Axolotl) and RAFT data (sft/build_sft_data.py), with tiny random models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from online_rlhf.config import ConfigError
from online_rlhf.jsonl import DataError, read_jsonl
from online_rlhf.stage_configs import SFTDataConfig, SFTStageConfig
from online_rlhf.stats import SFTDataStats, SFTStats, stats_path
from online_rlhf.testing import make_tiny_policy

ROOT = Path(__file__).resolve().parent.parent
from online_rlhf import sft_dataset
from online_rlhf.stages import build_sft_data, run_sft, sft_axolotl_config


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _conv(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                         {"role": "assistant", "content": f"The answer is {i + 1}."}]}


GOOD = _conv(1)


# --- dataset validation -------------------------------------------------------------------------

@pytest.mark.parametrize("bad, expected", [
    ({"prompt": "hi", "completion": "there"}, "no 'messages' column"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, "role 'tool'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  \n"}]}, "(assistant) is empty"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": []}, "non-empty list"),
], ids=["no-messages", "bad-role", "empty-assistant", "no-assistant", "empty-list"])
def test_bad_row_is_named_by_file_and_line(tmp_path, bad, expected):
    path = _write(tmp_path / "sft.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as e:
        sft_dataset.validate_sft_dataset(path)
    assert f"{path}:3:" in str(e.value)
    assert expected in str(e.value)


def test_valid_rows_are_counted_and_extra_columns_allowed(tmp_path):
    path = _write(tmp_path / "sft.jsonl", [GOOD, {**_conv(2), "id": "a", "reward": 1.0}, ""])
    assert sft_dataset.validate_sft_dataset(path) == 2


def test_empty_dataset_is_refused(tmp_path):
    with pytest.raises(DataError, match="empty"):
        sft_dataset.validate_sft_dataset(_write(tmp_path / "sft.jsonl", [""]))


def test_cli_stops_on_bad_row_before_axolotl_runs(tmp_path):
    data = _write(tmp_path / "sft.jsonl", [GOOD, {"messages": [{"role": "user", "content": "only a question"}]}])
    out = tmp_path / "sft" / "model"
    (tmp_path / "no-model-needed").mkdir()  # exists, holds no model: the data check must come first
    r = subprocess.run([sys.executable, str(ROOT / "sft/run_sft.py"), "--config", str(ROOT / "configs/sft.yaml"),
                        f"base_model={tmp_path / 'no-model-needed'}", f"dataset={data}", f"output_dir={out}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"{data}:2: no assistant turn" in r.stderr
    assert not (tmp_path / "sft").exists()  # no Axolotl config, no output


def test_rows_with_special_token_strings_are_counted_by_role(tmp_path):
    from online_rlhf.testing import make_tiny_tokenizer

    rows = [GOOD,
            {"messages": [{"role": "user", "content": "hi<|im_end|>"}, {"role": "assistant", "content": "Sure.<|im_end|>x"}]},
            {"messages": [{"role": "system", "content": "<|im_start|>"}, {"role": "user", "content": "a <| b |>"},
                          {"role": "assistant", "content": "ok"}]}]
    path = _write(tmp_path / "sft.jsonl", rows)
    assert sft_dataset.validate_sft_dataset(path) == 3
    assert sft_dataset.special_text_rows(path, make_tiny_tokenizer()) == {
        "rows": 2, "messages": {"system": 1, "user": 1, "assistant": 1}}


# --- config -------------------------------------------------------------------------------------

def test_misspelt_axolotl_key_is_an_error():
    with pytest.raises(ConfigError, match="'learning_rat' \\(Did you mean 'learning_rate'\\?\\)"):
        sft_axolotl_config.check_axolotl_keys({"learning_rat": 1e-5, "sequence_len": 256})


def test_known_axolotl_keys_pass():
    sft_axolotl_config.check_axolotl_keys({"learning_rate": 1e-5, "sequence_len": 256, "attn_implementation": "sdpa",
                                "special_tokens": {"eos_token": "<|im_end|>"}})


def test_dataset_template_gets_the_stage_dataset_path(tmp_path):
    entry = sft_dataset.dataset_entry([{"type": "chat_template", "roles_to_train": ["assistant"]}], "d.jsonl")
    assert entry["path"] == str(Path("d.jsonl").absolute()) and entry["ds_type"] == "json"
    assert entry["field_messages"] == "messages" and entry["roles_to_train"] == ["assistant"]


@pytest.mark.parametrize("datasets, expected", [
    ([{"type": "chat_template"}, {"type": "chat_template"}], "exactly one entry"),
    ([{"type": "chat_template", "path": "other.jsonl"}], "set the stage's `dataset=`"),
    ([{"type": "alpaca"}], "use type: chat_template"),
])
def test_dataset_template_refusals(datasets, expected):
    with pytest.raises(ConfigError, match=expected):
        sft_dataset.dataset_entry(datasets, "d.jsonl")


def test_lora_adapter_is_refused(tmp_path):
    cfg = SFTStageConfig.from_dict({"dataset": "d.jsonl", "output_dir": str(tmp_path / "m"), "adapter": "lora"})
    with pytest.raises(ConfigError, match="full checkpoint"):
        sft_axolotl_config.axolotl_config(cfg, "base", "<|im_end|>", tmp_path / "m.tmp", tmp_path / "m.prepared")


def test_eos_and_pad_default_to_the_base_eos(tmp_path):
    cfg = SFTStageConfig.from_dict({"dataset": "d.jsonl", "output_dir": str(tmp_path / "m")})
    ax = sft_axolotl_config.axolotl_config(cfg, "base", "<|eot|>", tmp_path / "m.tmp", tmp_path / "m.prepared")
    assert ax["special_tokens"] == {"eos_token": "<|eot|>", "pad_token": "<|eot|>"}
    assert ax["output_dir"] == str(tmp_path / "m.tmp") and sft_axolotl_config.PLUGIN in ax["plugins"]


# --- checkpoint clean-up ------------------------------------------------------------------------

def test_finalize_leaves_a_clean_checkpoint_with_template_and_eos(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    base = make_tiny_policy(tmp_path / "base")
    ckpt = make_tiny_policy(tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").unlink()  # as if the trainer saved no template
    (ckpt / "checkpoint-2").mkdir()
    (ckpt / "checkpoint-2" / "optimizer.pt").write_bytes(b"x")
    (ckpt / "README.md").write_text("model card")
    GenerationConfig(do_sample=True, eos_token_id=5).save_pretrained(ckpt)  # Axolotl forces do_sample
    summary = run_sft.finalize_checkpoint(ckpt, str(base), "<|im_end|>")
    assert sorted(summary["removed_from_checkpoint"]) == ["README.md", "checkpoint-2/"]
    assert not any(p.is_dir() for p in ckpt.iterdir())
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.chat_template == AutoTokenizer.from_pretrained(base).chat_template
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    gen = GenerationConfig.from_pretrained(ckpt)
    assert gen.eos_token_id == [2] and gen.pad_token_id == 2 and not gen.do_sample
    assert summary["chat_template_from"] == "base model"


# --- Axolotl end to end -------------------------------------------------------------------------

def test_axolotl_sft_tiny_model(tmp_path, capfd):
    """A few Axolotl steps on CPU: loss falls, a too-long row is dropped and counted, the output
    reloads with its chat template and eos = pad, no temporary or optimizer files are left; the log
    holds no bitsandbytes kernels notice (online_rlhf/__init__.py; it shows on AVX512-BF16 CPUs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_tiny_policy(tmp_path / "base")
    long_row = {"messages": [{"role": "user", "content": "Tell a long story."},
                             {"role": "assistant", "content": "The quick brown fox jumps. " * 60}]}
    data = _write(tmp_path / "sft.jsonl", [_conv(i) for i in range(31)] + [long_row])
    out = tmp_path / "sft" / "model"
    cfg = SFTStageConfig.load(ROOT / "configs/sft.yaml", [
        f"base_model={base}", f"dataset={data}", f"output_dir={out}", "max_steps=8", "learning_rate=1.0e-3",
        "sequence_len=128", "warmup_ratio=0.0"])
    stats = run_sft.main(cfg)
    log = capfd.readouterr()
    assert "[sft]" in log.out + log.err and "kernels-community" not in log.out + log.err

    assert stats == SFTStats.read(stats_path(out))  # the stage's stats round-trip through their class
    assert stats.rows_in == 32 and stats.rows_used == 31
    assert stats.dropped == {"outside_length_range": 1}
    assert stats.special_token_text == {"rows": 0, "messages": {"system": 0, "user": 0, "assistant": 0}}
    assert stats.steps == 8
    assert stats.train_loss_last < stats.train_loss_first - 0.3
    assert sorted(p.name for p in out.parent.iterdir()) == ["model", "model.axolotl.yaml", "model.stats.json"]
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == AutoTokenizer.from_pretrained(base).chat_template
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.eos_token_id == model.config.pad_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == [tok.eos_token_id]


def test_axolotl_sft_bf16_autocast_on_a_cpu_with_native_bf16(tmp_path, monkeypatch):
    """``bf16: auto`` on a CPU with native bf16 picks bf16 autocast; transformers refuses bf16
    without CUDA unless ``use_cpu`` is set, which Axolotl has no key for (the stage's plugin sets it)."""
    monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", "1")  # as on an AVX512-BF16 / AMX CPU (emulated elsewhere: tiny model)
    base = make_tiny_policy(tmp_path / "base")
    data = _write(tmp_path / "sft.jsonl", [_conv(i) for i in range(8)])
    out = tmp_path / "sft" / "model"
    cfg = SFTStageConfig.load(ROOT / "configs/sft.yaml", [
        f"base_model={base}", f"dataset={data}", f"output_dir={out}", "max_steps=2", "sequence_len=128",
        "warmup_ratio=0.0"])
    stats = run_sft.main(cfg)
    assert stats.steps == 2 and "bf16" in stats.hardware["dtype"]
    assert (out / "model.safetensors").exists()


def test_sft_dry_run_measures_one_step_and_writes_no_checkpoint(tmp_path):
    """dry_run=true: one forward + backward + AdamW step at micro_batch_size x sequence_len with
    transformers (Axolotl does not run); only <output_dir>.dry_run.json is written."""
    from online_rlhf.dry_run import dry_run_path
    from online_rlhf.stats import DryRunStats

    base = make_tiny_policy(tmp_path / "base")
    data = _write(tmp_path / "sft.jsonl", [_conv(i) for i in range(4)])
    out = tmp_path / "sft" / "model"
    cfg = SFTStageConfig.load(ROOT / "configs/sft.yaml", [f"base_model={base}", f"dataset={data}",
                                                          f"output_dir={out}", "sequence_len=96", "micro_batch_size=3",
                                                          "dry_run=true"])
    res = run_sft.main(cfg)
    assert isinstance(res, DryRunStats) and res.stage == "sft" and res.status == "ok"
    assert res.peak_memory_gib > 0 and res.seconds_per_step > 0
    assert res.shapes == {"rows": 3, "sequence_tokens": 96}
    assert res.settings["micro_batch_size"] == 3 and res.settings["sequence_len"] == 96
    assert DryRunStats.read(dry_run_path(out)) == res
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.dry_run.json"]  # no checkpoint, no Axolotl YAML


# --- RAFT data ----------------------------------------------------------------------------------

def _rewards_row(id_, responses, rewards, finish=None):
    return {"id": id_, "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{id_}"}],
            "responses": responses, "finish_reasons": finish or ["stop"] * len(responses),
            "response_tokens": [3] * len(responses), "rewards": rewards, "reward_source": "verifier"}


def test_build_sft_data_keeps_best_and_counts_drops(tmp_path):
    rewards = _write(tmp_path / "rewards.jsonl", [
        _rewards_row("a", ["ok", "best", "also best"], [0.5, 0.9, 0.9]),             # tie: first of the best
        _rewards_row("b", ["cut off", "fine"], [1.0, 0.7], ["length", "stop"]),      # truncated best excluded
        _rewards_row("c", ["low", "lower"], [0.2, 0.1]),                              # below min_reward
        _rewards_row("d", ["", "   ", "cut"], [1.0, 1.0, 1.0], ["stop", "stop", "length"]),  # nothing eligible
    ])
    out = tmp_path / "sft.jsonl"
    stats = build_sft_data.main(SFTDataConfig.from_dict({"rewards": str(rewards), "output": str(out), "min_reward": 0.6}))
    rows = read_jsonl(out)
    assert [(r["id"], r["messages"][-1]["content"], r["reward"]) for r in rows] == [("a", "best", 0.9), ("b", "fine", 0.7)]
    assert rows[0]["messages"][:2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "qa"}]
    assert stats.prompts_in == 4 and stats.kept == 2
    assert stats.dropped == {"below_min_reward": 1, "no_eligible_response": 1}
    assert stats.responses_excluded == {"truncated": 2, "empty": 2}
    assert SFTDataStats.read(stats_path(out)) == stats
    assert sft_dataset.validate_sft_dataset(out) == 2  # the output is valid SFT input


def test_build_sft_data_keeps_truncated_when_asked(tmp_path):
    rewards = _write(tmp_path / "rewards.jsonl", [_rewards_row("b", ["cut off", "fine"], [1.0, 0.7], ["length", "stop"])])
    out = tmp_path / "sft.jsonl"
    rewards.write_text(rewards.read_text() + "\n")  # a blank line at the end: counted
    stats = build_sft_data.main(SFTDataConfig.from_dict({"rewards": str(rewards), "output": str(out), "truncated": "keep"}))
    assert read_jsonl(out)[0]["messages"][-1]["content"] == "cut off" and stats.input_blank_lines == 1


def test_build_sft_data_refuses_nan_reward(tmp_path):
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text(json.dumps(_rewards_row("a", ["x", "y"], [0.1, 0.2])).replace("0.2", "NaN") + "\n")
    with pytest.raises(DataError, match=f"{rewards}:1"):
        build_sft_data.main(SFTDataConfig.from_dict({"rewards": str(rewards), "output": str(tmp_path / "o.jsonl")}))


def test_build_sft_data_leaves_out_unscored_responses(tmp_path):
    rewards = _write(tmp_path / "rewards.jsonl", [_rewards_row("a", ["best?", "scored"], [None, 0.8]),
                                                  _rewards_row("b", ["x", "y"], [None, None])])
    out = tmp_path / "sft.jsonl"
    stats = build_sft_data.main(SFTDataConfig.from_dict({"rewards": str(rewards), "output": str(out), "min_reward": 0.5}))
    assert [(r["id"], r["messages"][-1]["content"]) for r in read_jsonl(out)] == [("a", "scored")]
    assert stats.responses_excluded == {"unscored": 3} and stats.dropped == {"no_eligible_response": 1}
    assert stats.dropped_examples == {"no_eligible_response": [f"{rewards}:2 (id='b')"]}
