"""The plan builds each iteration's trl.DPOConfig dry (issue 24, item 5): values TRL refuses together
stop the plan before the first stage, naming the keys and where they were set, instead of the DPO
stage after generation, rewards and pairs."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from online_rlhf import loop  # noqa: E402
from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.jsonl import write_jsonl  # noqa: E402


@pytest.fixture
def args(tmp_path):
    train = tmp_path / "train.jsonl"
    write_jsonl(train, [{"id": f"p{j}", "prompt": f"question {j}", "answer": str(j)} for j in range(6)])
    (tmp_path / "models" / "start").mkdir(parents=True)
    return [f"train_prompts={train}", f"eval_prompts={train}", f"output_root={tmp_path / 'runs'}", "run_name=t",
            f"policy={tmp_path / 'models' / 'start'}", "iterations=2"]


def test_a_loss_type_that_does_not_fit_the_recipes_weights_is_refused_by_the_plan(args, tmp_path):
    # the report's input: the recipe (configs/dpo.yaml) has loss_weights [1, 1] for [sigmoid, sft]
    with pytest.raises(ConfigError) as e:
        loop.plan(None, args + ["dpo.training.loss_type=sigmoid"])
    msg = str(e.value)
    assert msg.startswith("iteration 1, stage dpo: trl.DPOConfig refused the values: `loss_weights` must have the "
                          "same length as `loss_type`")
    assert 'dpo.training.loss_type="sigmoid" (command line: dpo.training.loss_type=sigmoid)' in msg
    assert "dpo.training.loss_weights=[1.0, 1.0] (configs/dpo.yaml)" in msg
    assert not (tmp_path / "runs" / "t").exists()  # refused before anything is written


def test_the_iteration_that_breaks_it_is_named(args):
    with pytest.raises(ConfigError, match=r"^iteration 2, stage dpo: .*loss_weights=\[1\.0\] \(command line: per_iteration="):
        loop.plan(None, args + ["per_iteration={2: {dpo: {training: {loss_weights: [1.0]}}}}"])


def test_values_trl_accepts_pass_and_match_the_stage(args):
    run_dir = loop.plan(None, args + ["dpo.training.loss_type=sigmoid", "dpo.training.loss_weights=null"])
    assert (run_dir / "iter_2" / "configs" / "dpo.yaml").is_file()
