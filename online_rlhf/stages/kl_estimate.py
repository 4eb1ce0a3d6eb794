"""Stage: KL(policy || reference) from responses sampled from the policy -> kl.jsonl (+ stats JSON).

    python annotate_data/kl_estimate.py input=iter_1/kl_generated.jsonl policy=runs/x/iter_1/model \
        reference=default output=iter_1/kl.jsonl

KL(pi || ref) = E_{x, y ~ pi(.|x)} [log pi(y|x) - log ref(y|x)]: with responses y sampled from the
policy (temperature 1, no top-p: the policy's own distribution), the mean of
``log pi(y|x) - log ref(y|x)`` over them is an unbiased Monte Carlo estimate (Schulman 2020,
"Approximating KL divergence", the k1 estimator). Greedy answers would bias it. Each term can be
negative; the mean is >= 0 only in expectation.

1. read the sampled records (``online_rlhf.stages.get_rewards.load_generated``);
2. token ids of prompt and response: the sampled ids when the record has them
   (``prompt_token_ids``/``response_token_ids``, written by the generation stage with
   ``save_token_ids: true``, as the loop's ``kl_generate`` does); otherwise exactly as the DPO
   stage builds them from the text (responses whose re-tokenized length is not
   the sampled ``response_tokens`` are counted, ``retokenized_length_differs``, with a warning
   above 10%: the estimate then scores other sequences than the policy drew)
   (``online_rlhf.chat_tokens.prompt_response_ids``: the policy's chat template, contents as
   plain text), cut to what was sampled: through the end-of-turn token for a finished response
   (``finish_reason`` stop), before it for one cut at ``max_tokens`` (``length``); a response
   whose ids cannot be built is left out and counted under ``ChatTokenError.reason``
   (docs/skip-reasons.md);
3. sum the response tokens' log-probs under the policy, then under the reference (one model in
   memory at a time, on the GPU when there is one; TRL's ``selective_log_softmax`` in float32;
   a policy that is a base plus a LoRA adapter (``adapter``) whose reference is that base: one
   model, the adapter on, then switched off), in batches of ``batch_size``; ``dtype: auto`` runs the forwards under bf16 autocast where the
   hardware has native bf16 (:func:`precision`), as the DPO stage's reference pass does;
4. write ``{id, logp_policy: [K], logp_reference: [K], kl: [K], response_tokens: [K]}`` per prompt
   and the stats (:class:`~online_rlhf.stats.KLStats`: mean and standard error in nats).

Config: ``KLConfig`` (online_rlhf/stage_configs.py).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from online_rlhf.chat_tokens import ChatTokenError, prompt_response_ids, turn_terminator
from online_rlhf.config import run_main
from online_rlhf.evaluation import kl_summary
from online_rlhf.hardware import stage_threads
from online_rlhf.jsonl import DataError, write_jsonl
from online_rlhf.paths import resolve_model, setup_cache_env
from online_rlhf.records import sampled_token_ids
from online_rlhf.stage_configs import KLConfig
from online_rlhf.stages.get_rewards import load_generated
from online_rlhf.stats import KLStats, stats_path


def response_token_ids(tokenizer: Any, prompt: list[dict], response: str, finish_reason: str
                       ) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)`` of one sampled response, as the policy generated them: the
    DPO stage's ids (``prompt_response_ids``) cut after the last end-of-turn id (the template's
    terminator, ``chat_tokens.turn_terminator``; the eos when it has none) for a finished response,
    before it for one cut at max_tokens (the template's text after the end-of-turn token was not
    sampled).

    Raises:
        ChatTokenError: the conversation cannot be tokenized with its contents as plain text.
    """
    prompt_ids, (ids,) = prompt_response_ids(tokenizer, prompt, [{"role": "assistant", "content": response}])
    end = tokenizer.eos_token_id
    terminator = turn_terminator(tokenizer)  # ChatML's <|im_end|> where the eos is <|endoftext|> (Qwen base)
    if terminator is not None:
        end = tokenizer.convert_tokens_to_ids(terminator)
    if end is not None and end in ids:
        last = len(ids) - 1 - ids[::-1].index(end)
        ids = ids[:last + 1] if finish_reason == "stop" else ids[:last]
    return prompt_ids, ids


def sequence_log_probs(model: Any, seqs: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int,
                       autocast: str | None = None) -> list[float]:
    """Sum of ``log p(response token | prefix)`` over each sequence's response tokens.

    Sequences are batched longest first (less padding), and the LM head runs only from the
    shortest prompt of a batch on (``logits_to_keep``): prompt positions before it predict no
    response token. Results come back in the input order.

    Args:
        model: a causal LM (``transformers``), in eval mode.
        seqs: ``(prompt ids, response ids)`` per sequence.
        pad_id: the id right padding uses (masked out).
        autocast: ``"bfloat16"`` / ``"float16"``: the forward runs under ``torch.autocast`` in that
            dtype on the model's device (matrix products in half precision); the logits are cast
            to float32 before the log-softmax either way (a bf16 log-softmax over the vocabulary
            is off by ~0.05 nats per token). None: the model's own dtype.
    Returns:
        one float (nats, <= 0) per sequence, in order.
    """
    import contextlib

    import torch
    from trl.trainer.utils import selective_log_softmax

    out: list[float] = [0.0] * len(seqs)
    device = next(model.parameters()).device
    amp = (lambda: torch.autocast(device.type, dtype=getattr(torch, autocast))) if autocast else contextlib.nullcontext
    order = sorted(range(len(seqs)), key=lambda i: -(len(seqs[i][0]) + len(seqs[i][1])))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [seqs[i] for i in idx]
        full = [p + r for p, r in batch]
        width = max(len(f) for f in full)
        first = max(min(len(p) for p, _ in batch) - 1, 0)  # first position whose logits predict a response token
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, T)
        attn = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
        resp = torch.zeros((len(batch), width), dtype=torch.bool)  # (B, T): response positions
        for j, ((p, r), f) in enumerate(zip(batch, full)):
            ids[j, :len(f)] = torch.tensor(f)
            attn[j, :len(f)] = 1
            resp[j, len(p):len(f)] = True
        ids, attn, resp = ids.to(device), attn.to(device), resp.to(device)
        keep = torch.arange(first, width - 1, device=device)  # logits at positions first..T-2 predict first+1..T-1
        with torch.no_grad():
            with amp():
                logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep).logits
            logits = logits.float()  # (B, T-1-first, V)
            logps = selective_log_softmax(logits, ids[:, first + 1:])  # (B, T-1-first)
        sums = (logps * resp[:, first + 1:]).sum(dim=1).tolist()  # (B,)
        for i, v in zip(idx, sums):
            out[i] = v
    return out


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def precision(dtype: str, device_type: str) -> tuple[str, str | None]:
    """``(weights dtype, autocast dtype or None)`` of the log-prob passes for ``KLConfig.dtype``.

    ``auto``: float32 weights, autocast in :func:`online_rlhf.hardware.compute_dtype`'s choice
    where that is a half type (bf16 on a CPU with native bf16 and on Ampere+ GPUs, fp16 on older
    GPUs), else no autocast; ``float32``: no autocast; ``bfloat16``: bf16 weights, no autocast.
    """
    from online_rlhf.hardware import compute_dtype

    if dtype != "auto":
        return dtype, None
    fast = compute_dtype(device_type)
    return "float32", (None if fast == "float32" else fast)


def precision_label(weights: str, autocast: str | None) -> str:
    """The stats' dtype text: ``"float32 + bf16 autocast"`` as the DPO stage writes it, or the weights dtype."""
    return weights if autocast is None else f"{weights} + {autocast.replace('bfloat', 'bf').replace('float', 'fp')} autocast"


def _log_probs_under(path: str, seqs: list[tuple[list[int], list[int]]], cfg: KLConfig, pad_id: int,
                     adapter: str | None = None, adapter_off_too: bool = False
                     ) -> tuple[list[float], list[float] | None]:
    """``(log-probs under the model at path (with the LoRA adapter folder ``adapter`` on top when
    given), log-probs under the same model with the adapter switched off or None)``; the second pass
    runs only with ``adapter_off_too`` (the reference is the adapter's base: no second model)."""
    import torch
    from transformers import AutoModelForCausalLM

    if _device() == "cpu":
        torch.set_num_threads(stage_threads())  # the stage runs alone: every free core
    weights, autocast = precision(cfg.dtype, _device())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, weights))
    if adapter:
        from online_rlhf.adapters import load_with_adapter

        model = load_with_adapter(model, adapter)
    model = model.eval().to(_device())
    try:
        on = sequence_log_probs(model, seqs, cfg.batch_size, pad_id, autocast)
        if not (adapter and adapter_off_too):
            return on, None
        with model.disable_adapter():
            return on, sequence_log_probs(model, seqs, cfg.batch_size, pad_id, autocast)
    finally:
        del model


def build_sequences(input_path: str, records: list[dict], tokenizer: Any
                    ) -> tuple[list[tuple[list[int], list[int]]], list[tuple[int, int]], Counter, list[bool]]:
    """Every response of ``records`` as ``(prompt ids, response ids)``: the ids the engine sampled
    when the record holds them, else :func:`response_token_ids` of its text.

    Returns:
        ``(sequences, where, skipped, from_text)``: ``where[s]`` is the (record index, response
        index) of sequence ``s``; ``skipped`` counts the responses that could not be tokenized, by
        reason; ``from_text[s]``: sequence ``s`` was built from the text (no sampled ids).
    Raises:
        DataError: a sampled id outside the policy's vocabulary, or no response could be tokenized
            (both name ``input_path``).
    """
    seqs, where, skipped = [], [], Counter()  # where: (record index, response index) of each sequence
    from_text: list[bool] = []  # per sequence: built from the text (the record had no sampled ids)
    for n, rec in enumerate(records):
        for j, (resp, finish) in enumerate(zip(rec["responses"], rec["finish_reasons"])):
            sampled = sampled_token_ids(rec, j, f"{input_path}: record {n + 1} (id {rec.get('id')!r})")
            if sampled is not None:
                if max(max(sampled[0]), max(sampled[1])) >= len(tokenizer):
                    raise DataError(f"{input_path}: record {n + 1} (id {rec.get('id')!r}), response {j + 1}: a token id "
                                    f"is outside the policy's vocabulary ({len(tokenizer)} ids); the file was generated "
                                    "by another model than `policy`.")
                seqs.append(sampled)
                where.append((n, j))
                from_text.append(False)
                continue
            try:
                seqs.append(response_token_ids(tokenizer, rec["prompt"], resp, finish))
                where.append((n, j))
                from_text.append(True)
            except ChatTokenError as e:
                skipped[e.reason] += 1
    if not seqs:
        raise DataError(f"{input_path}: no sampled response to estimate the KL on (skipped: {dict(skipped)}).")
    return seqs, where, skipped, from_text


def main(cfg: KLConfig) -> KLStats:
    """Estimate KL(policy || reference) on ``cfg.input``; write ``cfg.output`` and its stats.

    Raises:
        DataError: a malformed input record, or no response could be tokenized.
        FileNotFoundError: the policy or reference does not exist.
    """
    from transformers import AutoTokenizer

    from online_rlhf.hardware import describe

    setup_cache_env()
    t0 = time.time()
    from online_rlhf.adapters import split_model

    policy, adapter = split_model(cfg.policy, cfg.adapter)
    reference = resolve_model(cfg.reference)
    records = load_generated(cfg.input)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seqs, where, skipped, from_text = build_sequences(cfg.input, records, tokenizer)
    # the reference is the adapter's base: the same model with the adapter switched off
    adapter_off = adapter is not None and (reference == policy or (
        Path(reference).exists() and Path(policy).exists() and Path(reference).resolve() == Path(policy).resolve()))
    lp_pol, lp_off = _log_probs_under(policy, seqs, cfg, pad_id, adapter, adapter_off_too=adapter_off)
    if adapter_off:
        lp_ref = lp_off
    else:
        lp_ref = lp_pol if reference == policy else _log_probs_under(reference, seqs, cfg, pad_id)[0]
    rows: dict[int, dict] = {}
    for (n, _), (_, r), a, b in zip(where, seqs, lp_pol, lp_ref):
        row = rows.setdefault(n, {"id": records[n]["id"], "logp_policy": [], "logp_reference": [], "kl": [],
                                  "response_tokens": []})
        row["logp_policy"].append(a)
        row["logp_reference"].append(b)
        row["kl"].append(a - b)
        row["response_tokens"].append(len(r))
    write_jsonl(cfg.output, [rows[n] for n in sorted(rows)])
    label = precision_label(*precision(cfg.dtype, _device()))
    summary = kl_summary([a - b for a, b in zip(lp_pol, lp_ref)])
    # Responses re-tokenized from the text (no sampled ids): count those whose ids here are not as
    # many as were sampled (a tokenizer that does not round-trip its own output). The sampled ids,
    # where the records have them, are what the policy drew: nothing to compare.
    retokenized = sum(from_text)
    counts = [(records[n].get("response_tokens") or [None] * (j + 1))[j] for n, j in where]
    differs = sum(t and c is not None and c != len(r) for t, c, (_, r) in zip(from_text, counts, seqs))
    if retokenized and differs > 0.1 * retokenized:
        print(f"WARNING: {differs} of {retokenized} re-tokenized responses have another token count than was "
              "sampled; the KL estimate then scores other sequences than the policy drew.", file=sys.stderr)
    stats = KLStats(stage="kl", input=cfg.input, output=cfg.output, policy=cfg.policy, reference=cfg.reference,
                    adapter=adapter, reference_adapter_off=adapter_off,
                    records_in=len(records), skipped=dict(skipped), dtype=label, **summary,
                    retokenized_length_differs=differs, retokenized=retokenized,
                    mean_response_tokens=round(sum(len(r) for _, r in seqs) / len(seqs), 2),
                    hardware=describe(_device(), label), seconds=round(time.time() - t0, 2),
                    tokens=sum(len(p) + len(r) for p, r in seqs))
    stats.write(stats_path(cfg.output))
    print(f"kl_estimate: KL(policy || reference) = {summary['kl_mean']:.4f} nats per response "
          f"(se {summary['kl_se']}, {summary['samples']} samples) -> {cfg.output}", file=sys.stderr)
    return stats


def cli() -> None:
    """Command-line entry point (annotate_data/kl_estimate.py calls this)."""
    run_main(main, KLConfig)


if __name__ == "__main__":
    cli()
