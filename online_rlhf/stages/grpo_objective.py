"""The GRPO stage's objective: micro-batches laid out as TRL does, per-token log-probs of the
completions, the clipped policy-gradient loss with the optional KL term (TRL 1.9's loss types), and
the old/reference log-probs over all completions (each process its share, gathered).
"""

from __future__ import annotations

import math


def collate(completions: list[dict], pad_id: int, device=None) -> dict:
    """Pad a micro-batch as TRL lays it out: prompts left-padded, completions right-padded, so the
    completion tokens share columns.

    Returns:
        ``input_ids`` (B, P + C), ``attention_mask`` (B, P + C), ``position_ids`` (B, P + C) counting
        real tokens only (left padding does not shift positions), ``completion_mask`` (B, C) float,
        ``advantages`` (B,) float, ``prompt_len`` P.
    """
    import torch

    P = max(len(c["prompt_ids"]) for c in completions)
    C = max(len(c["completion_ids"]) for c in completions)
    ids, att, cmask = [], [], []
    for c in completions:
        p, r = c["prompt_ids"], c["completion_ids"]
        ids.append([pad_id] * (P - len(p)) + p + r + [pad_id] * (C - len(r)))
        att.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (C - len(r)))
        cmask.append([1.0] * len(r) + [0.0] * (C - len(r)))
    input_ids = torch.tensor(ids, device=device)  # (B, P + C)
    attention_mask = torch.tensor(att, device=device)  # (B, P + C)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P + C)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "completion_mask": torch.tensor(cmask, device=device),  # (B, C)
            "advantages": torch.tensor([c["advantage"] for c in completions], device=device),  # (B,)
            "prompt_len": P}


def completion_log_probs(model, batch: dict, temperature: float = 1.0):
    """Per-token log-probs of the completion tokens under ``model``: (B, C), float32 whatever the
    weights' dtype.

    Logits divided by the sampling ``temperature`` first (the distribution the tokens were drawn
    from, as TRL does); ``trl.trainer.utils.selective_log_softmax`` for the log-softmax + gather,
    on the logits cast to float32 and outside autocast: a bf16 log-softmax is off by ~0.01 nats per
    token, which the ratio and the k3 KL (differences of log-probs near 0) cannot absorb (OpenRLHF
    PR #634; the DPO and KL stages cast the same way).
    """
    import torch
    from trl.trainer.utils import selective_log_softmax

    P = batch["prompt_len"]
    C = batch["input_ids"].size(1) - P
    # only the last C + 1 positions' logits (the prompt's would cost a (B, P, V) tensor and its gradient)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False, logits_to_keep=C + 1).logits  # (B, C + 1, V)
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logits = logits[:, :-1, :].float()  # (B, C, V): position t predicts token t + 1
        if temperature != 1.0:
            logits = logits / temperature
        return selective_log_softmax(logits, batch["input_ids"][:, P:])  # (B, C)


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, beta: float, epsilon: float,
              epsilon_high: float, loss_type: str, max_completion_length: int,
              num_items_in_batch=None, num_processes: int = 1):
    """The clipped group-relative surrogate with an optional k3 KL term, as TRL 1.9's
    ``GRPOTrainer._compute_loss`` computes it (token-level importance sampling, no entropy terms,
    before its division by the gradient accumulation steps).

    Per token: ``rho = exp(logp - old)``, ``-min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)
    + beta * (exp(ref - logp) - (ref - logp) - 1)`` (Shao et al. 2024, arXiv 2402.03300, eq. 3-4;
    k3 estimator: Schulman 2020, "Approximating KL divergence"). Aggregation by ``loss_type``:
    ``grpo`` mean over each row's masked tokens then over rows; ``bnpo`` masked token mean;
    ``dr_grpo`` masked sum / (B x max_completion_length) (Liu et al. 2025, arXiv 2503.20783);
    ``dapo`` masked sum / (num_items_in_batch / num_processes) (Yu et al. 2025, arXiv 2503.14476).

    Computed in float32: every input is cast to it first (in bf16, ``exp(x) - x - 1`` at x = 0.01
    comes out -0.0039 instead of 5.0e-5).

    Args:
        logps, old_logps: (B, C) log-probs of the completion tokens now / under the sampling policy.
        ref_logps: (B, C) under the reference model, or None when ``beta == 0``.
        advantages: (B,).  mask: (B, C) float, 1 on completion tokens.
        num_items_in_batch: ``dapo`` only: completion tokens of the whole optimizer step, all processes.
    Returns:
        (loss scalar, metrics: ``kl`` (masked mean, None with beta 0), ``clip_fraction`` (share of
        masked tokens whose ratio is clipped in the direction of its advantage), ``ratio_max_dev``
        (max |rho - 1| over masked tokens)), metrics as detached tensors.
    Raises:
        ValueError: an unknown ``loss_type``, or ``dapo`` without ``num_items_in_batch``.
    """
    import torch

    logps, old_logps, advantages, mask = (t.float() for t in (logps, old_logps, advantages, mask))
    ref_logps = None if ref_logps is None else ref_logps.float()
    adv = advantages.unsqueeze(1)  # (B, 1)
    ratio = torch.exp(logps - old_logps)  # (B, C)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # (B, C)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, C)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # (B, C)
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    elif loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type=dapo needs num_items_in_batch (completion tokens of the optimizer step)")
        loss = (per_token * mask).sum() / (torch.as_tensor(num_items_in_batch, dtype=mask.dtype).clamp(min=1.0)
                                           / num_processes)
    else:
        raise ValueError(f"loss_type={loss_type!r}: expected grpo, bnpo, dr_grpo or dapo.")
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))  # (B, C)
        metrics = {"kl": None if kl is None else (kl * mask).sum() / n,
                   "clip_fraction": (is_clipped.float() * mask).sum() / n,
                   "ratio_max_dev": ((ratio - 1).abs() * mask).max()}
    return loss, metrics


# ------------------------------------------------------------------------------ 4-7: model

def old_log_probs(model, completions: list[dict], indices: list[int], batch_size: int, pad_id: int, device,
                  temperature: float, batches: int | None = None) -> dict[int, list[float]]:
    """Log-probs of ``completions[i]`` for ``i`` in ``indices`` under ``model`` (no gradient, eval
    mode), in batches of ``batch_size``: ``{i: [one float per completion token]}``. ``batches``:
    run exactly this many forward passes (the extra ones on completion 0, discarded), so that every
    rank of a wrapped model (DDP broadcasts buffers, ZeRO-3 gathers weights) runs the same number."""
    import torch

    out = {}
    n = batches if batches is not None else math.ceil(len(indices) / batch_size)
    model.eval()
    with torch.no_grad():
        for b in range(n):
            chunk = indices[b * batch_size:(b + 1) * batch_size]
            if not chunk:  # a pass for the other ranks' sake
                completion_log_probs(model, collate([completions[0]], pad_id, device), temperature)
                continue
            batch = collate([completions[i] for i in chunk], pad_id, device)
            lp = completion_log_probs(model, batch, temperature).float().cpu()  # (b, C)
            for row, i in enumerate(chunk):
                out[i] = lp[row, :len(completions[i]["completion_ids"])].tolist()
    model.train()
    return out


def all_log_probs(accelerator, model, completions, batch_size, pad_id, temperature) -> list[list[float]]:
    """Every completion's log-probs under ``model``: each rank computes its share (i % ranks), then all
    ranks exchange them."""
    from accelerate.utils import gather_object

    world = accelerator.num_processes
    batches = math.ceil(math.ceil(len(completions) / world) / batch_size)  # the same on every rank
    mine = old_log_probs(model, completions, list(range(accelerator.process_index, len(completions), world)),
                         batch_size, pad_id, accelerator.device, temperature, batches)
    merged = {}
    for part in (gather_object([mine]) if accelerator.num_processes > 1 else [mine]):
        merged.update(part)
    return [merged[i] for i in range(len(completions))]


def pad_rows(rows: list[list[float]], C: int, device):
    """Per-token log-prob rows as one ``(len(rows), C)`` tensor on ``device``, right-padded with 0."""
    import torch

    return torch.tensor([r + [0.0] * (C - len(r)) for r in rows], device=device)  # (B, C)
