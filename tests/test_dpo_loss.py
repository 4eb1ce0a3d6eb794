"""The DPO losses (online_rlhf/dpo_loss.py): each one's formula on a hand-made batch, the registry
as the one list of names the stage's own path computes (tied to TRL's list), the config check of
``training.loss_type``, and a loss added in one function, trained by the stage's trainer in every
layout (the test to copy when you add one: docs/dpo.md, "Change the loss")."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

torch = pytest.importorskip("torch")

from online_rlhf import dpo_loss  # noqa: E402
from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.dpo_loss import LOSSES, TRL_LOSS_TYPES, PairLogps, combined, register  # noqa: E402
from online_rlhf.dpo_config import check_dpo_training  # noqa: E402


def _pairs() -> PairLogps:
    """2 pairs: policy and reference summed log-probs (B,) = (2,), 3 + 2 chosen completion tokens."""
    return PairLogps(chosen=torch.tensor([-4.0, -6.0]), rejected=torch.tensor([-5.0, -5.0]),
                     ref_chosen=torch.tensor([-4.5, -6.0]), ref_rejected=torch.tensor([-4.0, -5.5]),
                     chosen_tokens=torch.tensor([3, 2]), rejected_tokens=torch.tensor([4, 0]),
                     chosen_token_logps=torch.tensor([-1.0, -2.0, -1.0, -3.0, -3.0]))


def test_each_loss_is_its_formula():
    p, beta = _pairs(), 0.5
    d = [(-4.0 + 4.5) - (-5.0 + 4.0), (-6.0 + 6.0) - (-5.0 + 5.5)]  # (chosen - ref) - (rejected - ref) = [1.5, -0.5]
    assert p.delta.tolist() == pytest.approx(d)
    assert LOSSES["sigmoid"](p, beta).item() == pytest.approx(sum(math.log1p(math.exp(-beta * x)) for x in d) / 2)
    assert LOSSES["hinge"](p, beta).item() == pytest.approx(sum(max(0.0, 1 - beta * x) for x in d) / 2)
    norm = [0.5 / 3 - (-1.0) / 4, 0.0 / 2 - 0.5 / 1]  # each side's log-ratio per token (0 tokens count as 1)
    assert LOSSES["ipo"](p, beta).item() == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in norm) / 2)
    assert LOSSES["sft"](p, beta).item() == pytest.approx(10.0 / 5)
    both = combined(["sigmoid", "sft"], [1.0, 0.5], p, beta).item()
    assert both == pytest.approx(LOSSES["sigmoid"](p, beta).item() + 0.5 * 2.0)
    with pytest.raises(ValueError, match="registered: sigmoid, hinge, ipo, sft"):
        combined(["robust"], [1.0], p, beta)


def test_trl_loss_types_are_the_names_trls_dpo_config_lists():
    trl = pytest.importorskip("trl")
    help_text = {f.name: f for f in dataclasses.fields(trl.DPOConfig)}["loss_type"].metadata["help"]
    assert set(re.findall(r"`'(\w+)'`", help_text)) == set(TRL_LOSS_TYPES)
    assert set(LOSSES) <= set(TRL_LOSS_TYPES)  # the project's own built-in losses are TRL's, with TRL's numbers


def test_a_loss_type_nobody_computes_is_refused_before_training():
    pytest.importorskip("trl")
    assert check_dpo_training({"loss_type": ["sigmoid", "sft"]})["loss_type"] == ["sigmoid", "sft"]
    check_dpo_training({"loss_type": "robust"})  # TRL computes it (its own path)
    with pytest.raises(ConfigError, match=r"training\.loss_type: 'sigmod' is neither a loss TRL computes .* nor one "
                                          r"of online_rlhf/dpo_loss\.py .*@register"):
        check_dpo_training({"loss_type": ["sigmod"]})


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'sigmoid' is registered already"):
        register("sigmoid")(lambda p, beta: p.delta.mean())


# ---------------------------------------------------------------- a new loss: copy from here

@pytest.fixture
def margin_loss():
    """A loss of one function: DPO with a margin of 1 in the sigmoid, -log sigmoid(beta d - 1)."""
    if "sigmoid_margin" in LOSSES:  # added to online_rlhf/dpo_loss.py as docs/dpo.md shows: test that one
        yield LOSSES["sigmoid_margin"]
        return

    @register("sigmoid_margin")
    def sigmoid_margin(p: PairLogps, beta: float):
        import torch.nn.functional as F

        return (-F.logsigmoid(beta * p.delta - 1.0)).mean()

    yield sigmoid_margin
    del LOSSES["sigmoid_margin"]  # the registry is module state: leave it as the other tests find it


@pytest.mark.parametrize("layout", ["sequence", "side", "packed"])
def test_a_loss_added_in_one_function_trains(tmp_path, margin_loss, layout):
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from online_rlhf import completion_logps
    from online_rlhf.stages.dpo_trainer import timed_trainer_class
    from online_rlhf.testing import make_tiny_policy

    # its value: the function itself
    p = _pairs()
    assert margin_loss(p, 0.5).item() == pytest.approx(sum(math.log1p(math.exp(1 - 0.5 * x)) for x in (1.5, -0.5)) / 2)
    # the stage's config check accepts its name (TRL does not know it)
    assert check_dpo_training({"loss_type": ["sigmoid_margin", "sft"]})["loss_type"] == ["sigmoid_margin", "sft"]
    # the stage's trainer computes it from the batch's log-probs, in the layout asked for
    path = str(make_tiny_policy(tmp_path / "policy", seed=0, initializer_range=0.2))
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(make_tiny_policy(tmp_path / "ref", seed=1)), dtype=torch.float32)
    rows = [{"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10, 11], "rejected_ids": [12, 13]},
            {"prompt_ids": [14, 15], "chosen_ids": [16], "rejected_ids": [17, 18, 19]}]
    args = DPOConfig(output_dir=str(tmp_path / "work"), per_device_train_batch_size=2, loss_type=["sigmoid_margin"],
                     beta=0.5, max_length=32, report_to="none", use_cpu=True, bf16=False)
    trainer = timed_trainer_class(layout)(model=policy, ref_model=ref, args=args, processing_class=AutoTokenizer.
                                          from_pretrained(path), train_dataset=datasets.Dataset.from_list(rows))
    batch = trainer.data_collator(rows)
    loss = trainer.compute_loss(trainer.model, batch)
    assert trainer.completion_layout() == layout
    c, token_logps, logps = completion_logps.policy_logps(trainer.model, batch, layout)
    ref_logps = completion_logps.reference_logps(trainer, ref, batch, layout)
    counts = batch["completion_mask"][:, 1:].sum(dim=1)
    expect = margin_loss(PairLogps(*logps.chunk(2), *ref_logps.chunk(2), *counts.chunk(2), token_logps[c.rows < 2]), 0.5)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-6)
    loss.backward()  # it trains: gradients reach the policy
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in trainer.model.parameters())


def test_a_loss_only_this_project_computes_is_refused_with_trls_own_path(margin_loss):
    from pydantic import ValidationError

    from online_rlhf.stage_configs import DPOStageConfig

    keys = {"policy": "p", "pairs": "pairs.jsonl", "output_dir": "out", "training": {"loss_type": ["sigmoid_margin"]}}
    assert DPOStageConfig(**keys).log_probs == "auto"
    with pytest.raises(ValidationError, match="sigmoid_margin is computed only by online_rlhf/dpo_loss.py"):
        DPOStageConfig(**keys, log_probs="trl")
    # a setting that needs TRL's own computation: refused by the config, so the plan refuses it before any stage
    for setting, named in (({"ld_alpha": 0.5}, "ld_alpha"), ({"use_weighting": True}, "use_weighting"),
                           ({"f_divergence_type": "alpha_divergence"}, "f_divergence_type=alpha_divergence")):
        with pytest.raises(ValidationError, match=f"sigmoid_margin is computed only by .*training.{named} needs TRL"):
            DPOStageConfig(**{**keys, "training": {**keys["training"], **setting}})
    DPOStageConfig(**{**keys, "training": {"loss_type": ["sigmoid", "sft"], "ld_alpha": 0.5}})  # TRL's names: TRL's path
    assert dpo_loss.project_only_loss_types(["sigmoid", "sigmoid_margin"]) == ["sigmoid_margin"]
