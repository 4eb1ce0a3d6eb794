"""The DPO stage's completion-only log-probs (online_rlhf/completion_logps.py) against TRL's own
``DPOTrainer._compute_loss`` / ``compute_ref_log_probs`` on the same batch, in float32.

Tolerances (float32; the two paths differ in summation order and in the attention of padded vs
unpadded rows): loss and summed log-probs within 1e-5 relative (+1e-5 absolute), every gradient
within 1e-4 of the largest gradient entry of its tensor, metrics within 1e-4.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from online_rlhf import completion_logps as cl  # noqa: E402
from online_rlhf.stages import dpo_trainer  # noqa: E402
from online_rlhf.testing import make_tiny_policy  # noqa: E402

LOSS_CASES = [(["sigmoid"], None), (["ipo"], None), (["sigmoid", "sft"], [1.0, 1.0]), (["hinge"], None),
              (["sigmoid", "sft"], [0.7, 0.3])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    # a larger init than the default 0.02, so the policy's logits are far from uniform and the
    # log-probs, losses and gradients of the two paths differ if any position is wrong
    return {"policy": str(make_tiny_policy(d / "p", seed=0, initializer_range=0.2)),
            "reference": str(make_tiny_policy(d / "r", seed=1, initializer_range=0.2))}


def _examples(n: int, seed: int = 0, vocab: int = 500) -> list[dict]:
    """Pairs of different prompt, chosen and rejected lengths (so TRL pads each row differently)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(5, vocab) for _ in range(rng.randint(3, 20))]
        c = [rng.randrange(5, vocab) for _ in range(rng.randint(1, 25))]
        r = [rng.randrange(5, vocab) for _ in range(rng.randint(1, 25))]
        out.append({"prompt_ids": p, "chosen_ids": c, "rejected_ids": r})
    return out


def _trainer(tmp_path, models, loss_type, loss_weights=None, precompute=False, layout="sequence", max_length=40,
             **training):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    policy = AutoModelForCausalLM.from_pretrained(models["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(models["reference"], dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp_path / "work"), per_device_train_batch_size=4, loss_type=loss_type,
                     loss_weights=loss_weights, beta=0.5, max_length=max_length, report_to="none", use_cpu=True,
                     precompute_ref_log_probs=precompute, bf16=False, **training)
    ds = datasets.Dataset.from_list(_examples(8))
    cls = dpo_trainer.timed_trainer_class(layout)
    return cls(model=policy, ref_model=ref, args=args, train_dataset=ds,
               processing_class=AutoTokenizer.from_pretrained(models["policy"]))


def _batch(trainer, seed=1):
    batch = trainer.data_collator(_examples(4, seed=seed))
    assert (batch["attention_mask"] == 0).any()  # rows are padded: the check means something
    return batch


def _loss_and_grads(trainer, fn, batch):
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0  # num_tokens is a running total
    trainer.model.train()
    loss = fn(batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def test_every_built_in_loss_is_compared_with_trl():
    """The loss functions of online_rlhf/dpo_loss.py that TRL also computes are each checked against
    TRL below (a loss added to the registry is added to LOSS_CASES too)."""
    from online_rlhf.dpo_loss import LOSSES, TRL_LOSS_TYPES

    assert {name for names, _ in LOSS_CASES for name in names} == set(LOSSES) & set(TRL_LOSS_TYPES)


@pytest.mark.parametrize("loss_type,loss_weights", LOSS_CASES)
@pytest.mark.parametrize("layout", ["sequence", "side", "packed"])
def test_loss_logps_and_gradients_equal_trl(tmp_path, models, loss_type, loss_weights, layout):
    from trl import DPOTrainer

    trainer = _trainer(tmp_path, models, loss_type, loss_weights, layout=layout)
    assert trainer.completion_layout() == layout and trainer.completion_logps_refused is None
    batch = _batch(trainer)
    ours = _loss_and_grads(trainer, lambda b: trainer.compute_loss(trainer.model, b), batch)
    theirs = _loss_and_grads(trainer, lambda b: DPOTrainer._compute_loss(trainer, trainer.model, b, False), batch)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-5, abs=1e-5)
    assert set(ours[1]) == set(theirs[1]) and len(ours[1]) > 5
    for name, g in theirs[1].items():
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (ours[1][name] - g).abs().max().item() <= 1e-4 * scale, name
    assert set(ours[2]) == set(theirs[2])
    for key, v in theirs[2].items():
        assert ours[2][key] == pytest.approx(v, rel=1e-4, abs=1e-4), key
    # the reference mattered: a different model, so its log-ratios are far from 0
    assert abs(theirs[2]["rewards/chosen"]) > 0.1


@pytest.mark.parametrize("layout", ["sequence", "side", "packed"])
def test_reference_log_probs_equal_trl(tmp_path, models, layout):
    from trl import DPOTrainer

    trainer = _trainer(tmp_path, models, ["sigmoid"], layout=layout)
    batch = _batch(trainer, seed=2)
    ours = trainer.compute_ref_log_probs(trainer.ref_model, batch)
    theirs = DPOTrainer.compute_ref_log_probs(trainer, trainer.ref_model, batch)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape == (4,)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a, b)
    # and the policy's own summed log-probs, as TRL sums them, through the same function
    _, _, logps = cl.policy_logps(trainer.model, batch, layout)
    expect = DPOTrainer.compute_ref_log_probs(trainer, trainer.model, batch)
    assert torch.allclose(logps.detach(), torch.cat(expect), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["sequence", "packed"])
def test_truncated_rows_and_precomputed_reference_equal_trl(tmp_path, models, layout):
    """max_length cuts some rows (keep_start): the cut rows' completions end at max_length; with
    precomputed reference log-probs the batch carries them (the stage's default)."""
    from trl import DPOTrainer

    trainer = _trainer(tmp_path, models, ["sigmoid", "sft"], [1.0, 1.0], precompute=True, max_length=24,
                       layout=layout)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert "ref_chosen_logps" in batch and batch["input_ids"].shape[1] == 24
    ours = _loss_and_grads(trainer, lambda b: trainer.compute_loss(trainer.model, b), batch)
    theirs = _loss_and_grads(trainer, lambda b: DPOTrainer._compute_loss(trainer, trainer.model, b, False), batch)
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-5, abs=1e-5)
    for name, g in theirs[1].items():
        assert (ours[1][name] - g).abs().max().item() <= 1e-4 * g.abs().max().item(), name


@pytest.mark.parametrize("training,reason", [
    ({"loss_type": ["robust"], "label_smoothing": 0.1}, "loss_type robust"),
    ({"loss_type": ["sigmoid"], "ld_alpha": 0.5}, "ld_alpha"),
    ({"loss_type": ["sigmoid"], "use_weighting": True}, "use_weighting"),
    ({"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"}, "f_divergence_type=js_divergence"),
])
def test_settings_it_does_not_cover_run_trls_code(tmp_path, models, training, reason):
    from trl import DPOTrainer

    loss_type = training.pop("loss_type")
    trainer = _trainer(tmp_path, models, loss_type, **training)
    assert trainer.completion_layout() is None and trainer.completion_logps_refused == reason
    batch = _batch(trainer)
    ours = trainer.compute_loss(trainer.model, batch)
    theirs = DPOTrainer._compute_loss(trainer, trainer.model, batch, False)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_layout_none_is_trls_code_and_bad_layout_is_refused(tmp_path, models):
    trainer = _trainer(tmp_path, models, ["sigmoid"], layout=None)
    assert trainer.completion_layout() is None and trainer.completion_logps_refused == "turned off"
    with pytest.raises(ValueError, match="layout='stacked'"):
        dpo_trainer.timed_trainer_class("stacked")


def test_left_padded_rows_are_refused():
    ids = torch.ones((2, 4), dtype=torch.long)
    attn = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right padding"):
        cl.completion_logits(None, ids, attn, attn, "sequence")


def test_row_groups():
    assert cl.row_groups(4, "sequence") == [[0], [1], [2], [3]]
    assert cl.row_groups(4, "side") == [[0, 1], [2, 3]]
    assert cl.row_groups(4, "packed") == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="2B"):
        cl.row_groups(3, "side")


def test_packed_attention_is_each_sequence_alone_and_refuses_what_it_cannot_do():
    """Two sequences (2 and 4 tokens) in one pack: the output equals causal sdpa run on each alone,
    and differs from causal attention over the whole pack (the second sequence would see the first)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    module = torch.nn.Module()
    out, weights = cl.packed_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert weights is None and out.shape == (1, 6, 2, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    alone = torch.cat([sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True) for a, b in ((0, 2), (2, 6))],
                      dim=2).transpose(1, 2)
    assert torch.allclose(out, alone, atol=1e-6)
    assert not torch.allclose(out, sdpa(q, k, v, is_causal=True).transpose(1, 2), atol=1e-3)
    with pytest.raises(ValueError, match="sliding window"):
        cl.packed_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, sliding_window=3)
    with pytest.raises(ValueError, match="softcap"):  # Gemma-2's attention logit soft-capping
        cl.packed_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, softcap=50.0)
    with pytest.raises(ValueError, match="one packed row"):
        cl.packed_sdpa_attention(module, q.expand(2, -1, -1, -1), k, v, None, cu_seq_lens_q=cu)


def test_packed_layout_restores_the_attention_and_refuses_other_kernels(tmp_path, models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["policy"], dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    done = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    packed = cl.completion_logits(model, ids, attn, done, "packed")
    single = cl.completion_logits(model, ids, attn, done, "sequence")
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(packed.rows, single.rows) and torch.equal(packed.labels, single.labels)
    assert torch.allclose(packed.logits, single.logits, atol=1e-5)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        cl.completion_logits(model, ids, attn, done, "packed")
