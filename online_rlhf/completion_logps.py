"""DPO log-probs from the completion positions only, on unpadded sequences (the DPO stage's fast path).

TRL 1.9's ``DPOTrainer._compute_loss`` runs the policy on one batch of ``2B`` rows (B chosen, then
B rejected: ``trl.trainer.dpo_trainer.DataCollatorForPreference``), every row right-padded to the
longest of all ``2B``, then computes the LM head, a float32 log-softmax over the vocabulary and the
entropy at every position, prompt and padding included, and masks all but the completion tokens
out. With SmolLM2-135M the LM head is ~28M of the 135M parameters and its vocabulary 49,152: on a
CPU the per-position vocabulary work is a large share of a DPO step.

Here the same rows are run as :func:`row_groups` says (``"sequence"``: each row alone, no
padding at all; ``"side"``: the chosen rows together and the rejected rows together, each padded
to its own longest; ``"packed"``: all 2B rows, unpadded, one after another in one sequence, each
attending only to itself: :func:`packed_sdpa_attention`), and the LM head runs only where a logit
predicts a completion token (the
model's ``logits_to_keep``, a transformers causal-LM argument). Everything TRL computes from those
positions is then the same numbers: per-token log-probs (``trl.trainer.utils.selective_log_softmax``,
float32), their per-sequence sums, TRL's metrics, and the loss: each ``loss_type`` is one function of
:mod:`online_rlhf.dpo_loss`, the same for every layout; only the positions TRL masks out are never
computed. tests/test_completion_logps.py checks loss, log-probs and
gradients against TRL's own ``_compute_loss`` on one batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from .dpo_loss import LOSSES, PairLogps, combined

LAYOUTS = ("sequence", "side", "packed")
# the attention implementation a packed forward runs under (transformers AttentionInterface name)
PACKED_ATTENTION = "sdpa_packed"
# the model attention implementations the packed layout stands in for (it runs sdpa per sequence)
PACKED_FOR = ("sdpa", "eager")


def row_groups(n_rows: int, layout: str) -> list[list[int]]:
    """Which rows of a ``[chosen..., rejected...]`` batch of ``n_rows`` (= 2B) run in one forward.

    ``"sequence"``: one forward per row (no padding); ``"side"``: two forwards, the B chosen rows
    and the B rejected rows, each padded to its own longest row (fewer, larger products, for a
    GPU); ``"packed"``: one forward of all rows, concatenated without padding
    (:func:`completion_logits` packs them).

    Raises:
        ValueError: an unknown layout, or an odd ``n_rows``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    if n_rows % 2:
        raise ValueError(f"a DPO batch has chosen and rejected rows, 2B of them; got {n_rows}")
    if layout == "sequence":
        return [[i] for i in range(n_rows)]
    if layout == "packed":
        return [list(range(n_rows))]
    half = n_rows // 2
    return [list(range(half)), list(range(half, n_rows))]


@dataclass
class CompletionLogits:
    """The logits at the positions that predict a completion token, all rows' tokens concatenated.

    ``logits``: (M, V) float32, M = completion tokens of the batch; ``labels``: (M,) the token each
    row of ``logits`` predicts; ``rows``: (M,) the batch row (0..2B-1) each token belongs to, in order.
    """

    logits: Any
    labels: Any
    rows: Any
    n_rows: int

    def token_logps(self):
        """(M,) float32 log p(label | prefix), TRL's ``selective_log_softmax`` (fp32 logsumexp)."""
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax(self.logits.unsqueeze(0), self.labels.unsqueeze(0))[0]

    def per_row(self, values):
        """(2B,) sums over each row's tokens of ``values`` (M,)."""
        import torch

        out = torch.zeros(self.n_rows, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.rows, values)


def completion_logits(model, input_ids, attention_mask, completion_mask, layout: str = "sequence",
                      **model_kwargs) -> CompletionLogits:
    """Run ``model`` on the rows of a TRL preference batch without their padding; LM head only at
    completion positions.

    Args:
        model: a transformers causal LM whose ``forward`` takes ``logits_to_keep`` as a 1-D index
            tensor (Llama, Qwen2, Mistral, ...; also wrapped by DDP, DeepSpeed or PEFT).
        input_ids, attention_mask, completion_mask: (2B, T) as ``DataCollatorForPreference`` makes
            them (right padding; ``completion_mask`` 1 on chosen/rejected tokens).
        layout: see :func:`row_groups`.
        model_kwargs: passed to every forward (e.g. ``use_cache=False``).
    Returns:
        :class:`CompletionLogits`; logits in float32 (the product itself runs in the autocast dtype).
    Raises:
        ValueError: a row's attention mask is not one block of ones from position 0 (left padding,
            or a gap), which the unpadding cannot represent.
    """
    import torch

    lengths = attention_mask.sum(dim=1)
    width = attention_mask.shape[1]
    expect = torch.arange(width, device=attention_mask.device)[None, :] < lengths[:, None]
    if not torch.equal(attention_mask.bool(), expect):
        raise ValueError("completion_logits: every row's attention mask must be ones from position 0 then zeros "
                         "(right padding, as trl's DataCollatorForPreference makes it)")
    if layout == "packed":
        row_groups(input_ids.shape[0], layout)  # ValueError on an odd row count
        return _packed_logits(model, input_ids, attention_mask.bool(), completion_mask, lengths, model_kwargs)
    logits, labels, rows = [], [], []
    for group in row_groups(input_ids.shape[0], layout):
        idx = torch.tensor(group, device=input_ids.device)
        w = int(lengths[idx].max())
        ids, attn = input_ids[idx, :w], attention_mask[idx, :w]
        target = completion_mask[idx, 1:w].bool()  # (g, w-1): position t's logits predict token t+1
        keep = target.any(dim=0).nonzero().squeeze(1)  # positions whose logits some row of the group needs
        if keep.numel() == 0:
            continue
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep, **model_kwargs)
        lg = out.logits.float()  # (g, len(keep), V)
        sel = target[:, keep]  # (g, len(keep))
        logits.append(lg[sel])
        labels.append(ids[:, 1:][:, keep][sel])
        rows.append(idx[:, None].expand_as(sel)[sel])
    if not logits:
        raise ValueError("completion_logits: the batch has no completion token")
    return CompletionLogits(torch.cat(logits), torch.cat(labels), torch.cat(rows), input_ids.shape[0])


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: Optional[float] = None, cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
    """Attention for a packed forward (a transformers ``AttentionInterface`` function, registered as
    :data:`PACKED_ATTENTION`): each sequence of the pack attends causally to itself only.

    ``query`` (1, H, N, D), ``key``/``value`` (1, Hkv, N, D), N the packed length; ``cu_seq_lens_q``
    (S+1,) int, the sequences' start offsets and N (the flash-attention varlen convention, passed to
    the model's ``forward`` as ``cu_seq_lens_q``/``cu_seq_lens_k``). Each sequence runs through
    transformers' own ``sdpa_attention_forward`` with ``is_causal=True``, so the result equals the
    sequences run one by one; a call without ``cu_seq_lens_q`` is plain sdpa. Returns
    ``(output (1, N, H, D), None)``. The packed block-causal mask transformers would build for sdpa
    from the position ids costs N^2 attention; this costs the sum of the squared lengths.

    Raises:
        ValueError: a batch of more than one packed row, ``cu_seq_lens_k`` unlike ``cu_seq_lens_q``, a
            sequence longer than the layer's sliding window, or attention logit soft-capping,
            attention sinks (``s_aux``) or a position bias (none of which this applies; use
            ``log_probs=sequence``).
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1 or (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("packed_sdpa_attention: one packed row with the same sequences for queries and keys")
    extras = [name for name in ("softcap", "s_aux", "position_bias") if kwargs.get(name) is not None]
    if extras:
        raise ValueError(f"packed_sdpa_attention: this model's attention takes {', '.join(extras)}, which the "
                         f"packed layout does not apply; use log_probs=sequence")
    bounds = cu_seq_lens_q.tolist()
    window = kwargs.pop("sliding_window", None)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if window is not None and longest > window:
        raise ValueError(f"packed_sdpa_attention: a {longest}-token sequence is longer than the sliding window "
                         f"({window}), which the packed layout does not apply; use log_probs=sequence")
    kwargs.pop("is_causal", None)
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, dropout,
                                   scaling, is_causal=True, **kwargs)[0]
            for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=1), None


def _base_config(model):
    """The transformers config of ``model`` under its DDP, DeepSpeed, accelerate or PEFT wrappers."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel):
        if hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        elif hasattr(model, "module"):  # DDP, DeepSpeed
            model = model.module
        else:
            break
    return model.config


@contextmanager
def packed_attention(model):
    """While the block runs, ``model``'s attention layers run :func:`packed_sdpa_attention` (registered
    once in transformers' ``AttentionInterface``, with the flash-attention mask function: no mask, the
    sequence bounds come as ``cu_seq_lens_q``). Nests: an inner block leaves the outer one's setting.
    A backward that recomputes the layers (gradient checkpointing) must run inside the block too.

    Raises:
        ValueError: the model's attention is not sdpa or eager (flash-attention kernels differ in
            numerics; use ``log_probs=side`` or ``sequence``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, flash_attention_mask)
    config = _base_config(model)
    before = config._attn_implementation
    if before not in (*PACKED_FOR, PACKED_ATTENTION):
        raise ValueError(f"log_probs layout 'packed' runs sdpa attention per sequence; the model's attention is "
                         f"{before!r}: use log_probs=side or sequence")
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def _packed_logits(model, input_ids, mask, completion_mask, lengths, model_kwargs) -> CompletionLogits:
    """:func:`completion_logits` in the ``"packed"`` layout: the 2B rows' real tokens one after another
    in one (1, N) sequence, position ids restarting at 0 per row, one forward."""
    import torch

    n_rows = input_ids.shape[0]
    target = torch.zeros_like(mask)
    target[:, :-1] = completion_mask[:, 1:].bool()  # position t's logits predict token t+1
    following = torch.zeros_like(input_ids)
    following[:, :-1] = input_ids[:, 1:]
    flat_target = target[mask]  # (N,) row after row, the order of the other layouts
    keep = flat_target.nonzero().squeeze(1)
    if keep.numel() == 0:
        raise ValueError("completion_logits: the batch has no completion token")
    ids = input_ids[mask][None]  # (1, N)
    positions = (mask.long().cumsum(dim=1) - 1)[mask][None]
    cu = torch.nn.functional.pad(lengths.cumsum(dim=0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    with packed_attention(model):
        out = model(input_ids=ids, position_ids=positions, attention_mask=None, logits_to_keep=keep,
                    cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest, **model_kwargs)
    rows = torch.arange(n_rows, device=input_ids.device)[:, None].expand_as(mask)[mask]
    return CompletionLogits(out.logits.float()[0], following[mask][keep], rows[keep], n_rows)


def fast_path_refusal(trainer) -> Optional[str]:
    """Why :func:`completion_logits` cannot stand in for TRL's computation for ``trainer`` (a
    ``trl.DPOTrainer``), or None when it can. The reasons name the setting that needs TRL's own path."""
    import inspect

    if getattr(trainer, "use_liger_kernel", False):
        return "use_liger_kernel"
    if getattr(trainer, "_is_vlm", False) or getattr(trainer, "_is_vision_dataset", False):
        return "a vision-language model"
    if trainer.ld_alpha is not None:
        return "ld_alpha"
    if trainer.use_weighting:
        return "use_weighting"
    if trainer.aux_loss_enabled:
        return "a mixture-of-experts auxiliary loss"
    if trainer.f_divergence_type != "reverse_kl":
        return f"f_divergence_type={trainer.f_divergence_type}"
    other = [t for t in trainer.loss_types if t not in LOSSES]
    if other:
        return f"loss_type {', '.join(other)}"
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # the class's forward: an instance's may be a wrapper (dpo_trainer.prepared_forward, accelerate's autocast)
    if "logits_to_keep" not in inspect.signature(type(base).forward).parameters:
        return f"{type(base).__name__}.forward has no logits_to_keep"
    return None


def _row_counts(completion_mask):
    """(2B,) completion tokens per row (the tokens a log-prob is summed over)."""
    return completion_mask[:, 1:].sum(dim=1)


def policy_logps(model, inputs, layout: str):
    """``(CompletionLogits, token log-probs (M,), summed log-probs (2B,))`` of ``model`` (the policy,
    with gradients) on a TRL batch."""
    c = completion_logits(model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"], layout,
                          use_cache=False)
    token_logps = c.token_logps()
    return c, token_logps, c.per_row(token_logps)


def reference_logps(trainer, model, inputs, layout: str):
    """(2B,) summed completion log-probs of the reference for a TRL batch, without gradients.

    ``model`` is the reference model; or, when the trainer has none and trains a PEFT adapter,
    the policy with its adapter disabled (or switched to a ``ref`` adapter), as TRL does.
    """
    import torch
    from accelerate.utils import is_peft_model
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        if trainer.ref_model is None and is_peft_model(trainer.model):
            unwrapped = trainer.accelerator.unwrap_model(trainer.model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                c = completion_logits(model, inputs["input_ids"], inputs["attention_mask"],
                                      inputs["completion_mask"], layout, use_cache=False)
        else:
            c = completion_logits(model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"],
                                  layout, use_cache=False)
        return c.per_row(c.token_logps())


def compute_loss(trainer, model, inputs, layout: str):
    """The DPO loss of one TRL batch, and TRL's metrics for it (``trainer._metrics[mode]``: the
    same names and definitions as ``DPOTrainer._compute_loss`` logs, over completion tokens).

    Args:
        trainer: a ``trl.DPOTrainer`` for which :func:`fast_path_refusal` is None.
        model: the model ``compute_loss`` was given (the accelerate-prepared policy).
        inputs: the collated batch (``input_ids``, ``attention_mask``, ``completion_mask`` (2B, T);
            ``ref_chosen_logps`` / ``ref_rejected_logps`` (B,) when precomputed).
        layout: see :func:`row_groups`.
    Returns:
        scalar loss tensor (with gradients to the policy).
    """
    import torch
    from trl.trainer.utils import entropy_from_logits

    mode = "train" if trainer.model.training else "eval"
    acc = trainer.accelerator
    c, token_logps, logps = policy_logps(model, inputs, layout)
    chosen_logps, rejected_logps = logps.chunk(2)
    if trainer.precompute_ref_logps:
        ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        ref = trainer.ref_model if trainer.ref_model is not None else model
        ref_chosen, ref_rejected = reference_logps(trainer, ref, inputs, layout).chunk(2)
    counts = _row_counts(inputs["completion_mask"])
    half = counts.shape[0] // 2
    is_chosen = c.rows < half  # (M,)
    pairs = PairLogps(chosen_logps, rejected_logps, ref_chosen, ref_rejected, counts[:half], counts[half:],
                      token_logps[is_chosen])
    loss = combined(trainer.loss_types, trainer.loss_weights, pairs, trainer.beta)  # online_rlhf/dpo_loss.py

    m = trainer._metrics[mode]
    with torch.no_grad():
        logits = c.logits.detach()
        ent = entropy_from_logits(logits)  # (M,)
        total = acc.gather_for_metrics(torch.tensor(float(ent.numel()), device=ent.device)).sum()
        m["entropy"].append((acc.gather_for_metrics(ent.sum()).sum() / total).item() if total > 0 else 0.0)
        if mode == "train":
            trainer._total_train_tokens += acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        m["num_tokens"] = [trainer._total_train_tokens]
        mean_logit = logits.mean(dim=-1)  # (M,)
        for side, sel in (("chosen", is_chosen), ("rejected", ~is_chosen)):
            s = acc.gather_for_metrics(mean_logit[sel].sum()).sum().item()
            n = acc.gather_for_metrics(sel.sum()).sum().item()
            m[f"logits/{side}"].append(s / n if n > 0 else 0.0)
        correct = acc.gather_for_metrics(((logits.argmax(dim=-1) == c.labels) & is_chosen).sum()).sum()
        n_chosen = acc.gather_for_metrics(is_chosen.sum()).sum()
        m["mean_token_accuracy"].append((correct / n_chosen).item() if n_chosen > 0 else 0.0)
        chosen_rewards = trainer.beta * (chosen_logps.detach() - ref_chosen)
        rejected_rewards = trainer.beta * (rejected_logps.detach() - ref_rejected)
        m["rewards/chosen"].append(acc.gather(chosen_rewards).mean().item())
        m["rewards/rejected"].append(acc.gather(rejected_rewards).mean().item())
        m["rewards/accuracies"].append(acc.gather((chosen_rewards > rejected_rewards).float()).mean().item())
        m["rewards/margins"].append(acc.gather(chosen_rewards - rejected_rewards).mean().item())
        m["logps/chosen"].append(acc.gather(chosen_logps.detach()).mean().item())
        m["logps/rejected"].append(acc.gather(rejected_logps.detach()).mean().item())
    return loss
