"""SFT trains the turn terminator when the tokenizer's eos is not it (issue 24, item 2; after axolotl #3754).

Qwen base checkpoints have eos ``<|endoftext|>`` and a ChatML template that ends turns with
``<|im_end|>``. Axolotl 0.19 trains only the ``eot_tokens`` at a turn's end, by default the eos, so
every assistant ``<|im_end|>`` got label -100. The stage now reads the terminator from the chat
template and sets ``eot_tokens``; the labels are checked with Axolotl's own chat-template strategy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("axolotl")

from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.stage_configs import SFTStageConfig  # noqa: E402
from online_rlhf.stages import run_sft, sft_axolotl_config  # noqa: E402
from online_rlhf.testing import make_qwen2_style_tokenizer, make_tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROW = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there"}]}


def _ax(tmp_path, tok, **keys):
    cfg = SFTStageConfig.from_dict({"dataset": str(tmp_path / "d.jsonl"), "output_dir": str(tmp_path / "m"),
                                    "sequence_len": 128, **keys})
    return sft_axolotl_config.axolotl_config(cfg, "base", tok.eos_token, tmp_path / "m.tmp", tmp_path / "m.prepared", tokenizer=tok)


def _terminator_labels(ax: dict, tok) -> list[int]:
    """Labels Axolotl's own chat-template strategy gives the ``<|im_end|>`` tokens of ROW's assistant turn."""
    from axolotl.prompt_strategies.chat_template import StrategyLoader
    from axolotl.utils.dict import DictDefault

    cfg = DictDefault({"train_on_inputs": False, "sequence_len": 128, **ax})
    strategy = StrategyLoader()(tok, cfg, ds_cfg=ax["datasets"][0])
    out = strategy.tokenize_prompt(ROW)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [k for k, t in enumerate(out["input_ids"]) if t == im_end]
    assert len(ends) == 2  # user turn, assistant turn
    assert [lab for lab in out["labels"][:ends[0] + 1]] == [-100] * (ends[0] + 1)  # the prompt is not trained
    return [out["labels"][ends[1]]]


def test_a_tokenizer_whose_eos_is_not_the_terminator_gets_eot_tokens_and_the_terminator_is_trained(tmp_path):
    tok = make_qwen2_style_tokenizer()
    assert tok.eos_token == "<|endoftext|>"
    ax = _ax(tmp_path, tok)
    assert ax["eot_tokens"] == ["<|im_end|>"] and ax["special_tokens"]["eos_token"] == "<|endoftext|>"
    assert _terminator_labels(ax, tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    # without the stage's eot_tokens (the config before the fix) Axolotl masks it
    before = {k: v for k, v in ax.items() if k != "eot_tokens"}
    assert _terminator_labels(before, tok) == [-100]


def test_eos_that_is_the_terminator_leaves_axolotls_default(tmp_path):
    tok = make_tiny_tokenizer()  # eos = <|im_end|>, the ChatML terminator
    ax = _ax(tmp_path, tok)
    assert "eot_tokens" not in ax
    assert _terminator_labels(ax, tok) == [tok.eos_token_id]


def test_a_users_eot_tokens_are_kept(tmp_path):
    tok = make_qwen2_style_tokenizer()
    assert _ax(tmp_path, tok, eot_tokens=["<|im_end|>", "<|im_start|>"])["eot_tokens"] == ["<|im_end|>", "<|im_start|>"]


@pytest.mark.parametrize("eot, says", [
    (["<|endoftext|>"], r"'<\|endoftext\|>' not in the chat template"),  # the Qwen eos: ChatML never writes it
    (["<|not_a_token|>"], r"'<\|not_a_token\|>' not in the chat template"),
    (["<|im_start|>"], r"leaves out '<\|im_end\|>'"),  # in the template, but not what ends an assistant turn
    ("<|im_end|>", r"expected a list of token strings"),
])
def test_a_users_eot_tokens_that_train_no_turn_end_are_refused_before_training(tmp_path, eot, says):
    """axolotl PR #2364: Axolotl only warns about an eot_tokens value the template lacks, trains, and
    no assistant turn end gets a label; the stage refuses it, naming the token and the terminator."""
    tok = make_qwen2_style_tokenizer()  # eos <|endoftext|>, ChatML turns end with <|im_end|>
    with pytest.raises(ConfigError, match=says) as e:
        _ax(tmp_path, tok, eot_tokens=eot)
    assert "the template ends an assistant turn with '<|im_end|>'" in str(e.value)
    assert "Set eot_tokens: ['<|im_end|>']" in str(e.value)


def test_a_template_with_no_turn_end_is_refused_saying_how(tmp_path):
    tok = make_qwen2_style_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"never learn to end a turn\. Set eot_tokens: "):
        _ax(tmp_path, tok)


def test_the_stage_turns_axolotl_telemetry_off_itself():
    """Without run_loop.sh's AXOLOTL_DO_NOT_TRACK (a by-hand run), importing the stage sets it, and
    so does the Axolotl key check the plan runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("AXOLOTL_DO_NOT_TRACK", "DO_NOT_TRACK")}
    env["PYTHONPATH"] = str(ROOT)
    for code in ("import online_rlhf.stages.run_sft",
                 "from online_rlhf.trl_args import check_axolotl_keys; check_axolotl_keys({'learning_rate': 1.0})"):
        r = subprocess.run([sys.executable, "-c", f"{code}; import os; print(os.environ['AXOLOTL_DO_NOT_TRACK'])"],
                           env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "1", r.stderr[-2000:]


def test_axolotl_run_on_a_qwen_style_base_trains_and_stops_at_the_terminator(tmp_path):
    """The stage end to end (2 Axolotl steps): the written Axolotl config has eot_tokens, the stats
    record them, and the checkpoint's generation_config stops at <|im_end|> as well as at the eos."""
    import json

    import yaml
    from transformers import GenerationConfig

    from online_rlhf.testing import make_tiny_policy

    base = make_tiny_policy(tmp_path / "base", tokenizer=make_qwen2_style_tokenizer())
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(ROW) + "\n" for _ in range(8)))
    out = tmp_path / "sft" / "model"
    cfg = SFTStageConfig.load(ROOT / "configs/sft.yaml", [f"base_model={base}", f"dataset={data}", f"output_dir={out}",
                                                          "max_steps=2", "sequence_len=64", "warmup_ratio=0.0"])
    stats = run_sft.main(cfg)
    assert stats.eot_tokens == ["<|im_end|>"] and stats.eos_token == "<|endoftext|>"
    written = yaml.safe_load(Path(stats.axolotl_config).read_text())
    assert written["eot_tokens"] == ["<|im_end|>"]
    tok = make_qwen2_style_tokenizer()
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
