"""The GPU check's workers (``online_rlhf.gpu_check``): the measurements it runs in a process of their own.

    python -m online_rlhf.gpu_check rm-worker --model DIR --out FILE
    accelerate launch --config_file configs/accelerate/zero2.yaml ... -m online_rlhf.gpu_check tied-worker \
        --model DIR --dir DIR --phase train|resume

- ``rm-worker`` (:func:`rm_speedup`): reward-model scoring, length-sorted batches vs batch size 1 on
  the same items; writes the ratio and the largest score difference.
- ``tied-worker`` (:func:`tied_worker`): a step, a DeepSpeed checkpoint and a ZeRO-2 save, then a
  resume from the checkpoint: tied embeddings kept (:func:`tied_in_checkpoint`), logits and
  losses within :data:`LOGIT_RTOL` / :data:`LOSS_RTOL`.

``online_rlhf.gpu_check`` starts them (its ``main`` hands these two verbs over) and reads what they
write.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Optional

from .jsonl import read_json, write_json

# tied_weights tolerances: logits of the reloaded model vs the in-memory one, relative to the
# largest |logit|; losses of the resumed run vs the uninterrupted one, relative
LOGIT_RTOL = 1e-5
LOSS_RTOL = 1e-4


def tied_in_checkpoint(model_dir: Path) -> tuple[bool, str]:
    """A saved checkpoint whose config ties the embeddings either stores no ``lm_head.weight`` or
    stores one equal to ``embed_tokens.weight``."""
    from safetensors import safe_open

    cfg = read_json(model_dir / "config.json")
    if not cfg.get("tie_word_embeddings", False):
        return True, "untied"
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith("lm_head.weight") or k.endswith("embed_tokens.weight"):
                    tensors[k.rsplit(".", 2)[-2]] = fh.get_tensor(k)
    if "lm_head" not in tensors:
        return True, "tied"
    import torch

    return bool(torch.equal(tensors["lm_head"], tensors["embed_tokens"])), "tied (lm_head stored)"


def rm_speedup(model_dir: str, out: Path, items: int = 64, batch_size: int = 16, repeats: int = 2,
               device: Optional[str] = None, seed: int = 0) -> dict:
    """Score ``items`` (prompt, response) pairs with a reward model made of ``model_dir``'s backbone
    and a fresh one-label head (seeded), in length-sorted batches of ``batch_size`` and one at a
    time; the best of ``repeats`` alternating runs each. Writes and returns
    ``{ratio, batched_s, one_s, items, max_abs_diff, max_abs_score, device, dtype, batch_size}``;
    ratio = one_s / batched_s (the same items, model, dtype and device). Method as
    bench/bench_rm_scoring.py (its ``batched`` vs ``one-by-one`` modes)."""
    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .reward_model import RewardModel

    rng = random.Random(seed)
    words = "the sky is blue and the sea is green so we write short answers about every topic here".split()
    prompts = [[{"role": "user", "content": f"Question {i}: say something about topic {i}."}] for i in range(items)]
    responses = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 200))) for _ in range(items)]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        m = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        m.config.pad_token_id = tok.pad_token_id
        m.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del m
        rm = RewardModel(tmp, dtype="auto", device=device, max_length=1024)
        rm.score(prompts[:2], responses[:2], batch_size=2)  # warm-up
        best: dict[int, tuple[list, float]] = {}
        for _ in range(repeats):
            for bs in (batch_size, 1):
                if rm.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                scores = rm.score(prompts, responses, batch_size=bs)[0]
                if rm.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if bs not in best or dt < best[bs][1]:
                    best[bs] = (scores, dt)
    (a, ta), (b, tb) = best[batch_size], best[1]
    r = {"ratio": tb / ta, "batched_s": ta, "one_s": tb, "items": items, "batch_size": batch_size,
         "max_abs_diff": max(abs(x - y) for x, y in zip(a, b)), "max_abs_score": max(abs(x) for x in a + b),
         "device": rm.device.type, "dtype": str(rm.dtype).replace("torch.", "")}
    write_json(out, r)
    return r


def rm_worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m online_rlhf.gpu_check rm-worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args(argv)
    r = rm_speedup(a.model, a.out, items=a.items, batch_size=a.batch_size)
    print(json.dumps(r))
    return 0


def _fixed_batches(vocab: int, n: int = 3, rows: int = 2, length: int = 32):
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(4, vocab, (rows, length), generator=g) for _ in range(n)]


def tied_worker(argv: list[str]) -> int:
    """``--phase train``: one optimizer step of causal-LM loss under the launched DeepSpeed engine,
    ``accelerator.save_state`` (DeepSpeed checkpoint) and a ZeRO-2 ``save_pretrained`` of the
    engine's state dict, the in-memory logits on a fixed prompt, then the uninterrupted run's next
    step (its loss, the update, the loss after it). ``--phase resume``: a fresh engine,
    ``load_state``, the same next step; then (rank 0) a reload of the saved checkpoint: tied
    ``lm_head``/``embed_tokens``, its logits vs the in-memory ones, the resumed losses vs the
    uninterrupted ones. Writes ``<dir>/result.json`` ``{ok, figure, ...}``.

    Raises: RuntimeError when not launched under a DeepSpeed accelerate profile, or the model does
    not tie its embeddings (nothing to check).
    """
    ap = argparse.ArgumentParser(prog="accelerate launch ... -m online_rlhf.gpu_check tied-worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--phase", choices=["train", "resume"], required=True)
    ap.add_argument("--lr", type=float, default=1e-3)
    a = ap.parse_args(argv)

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    acc = Accelerator()
    if acc.state.deepspeed_plugin is None:
        raise RuntimeError("tied-worker: run it under `accelerate launch --config_file configs/accelerate/zero2.yaml` "
                           "(a DeepSpeed profile); none is active")
    acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise RuntimeError(f"{a.model}: tie_word_embeddings is false; the tied-weights check needs a tied model")
    batches = _fixed_batches(model.config.vocab_size)
    prompt = batches[0][:1, :16]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    model, opt = acc.prepare(model, opt)

    def loss_on(b) -> torch.Tensor:
        b = b.to(acc.device)
        return model(input_ids=b, labels=b).loss

    def step(b) -> float:
        loss = loss_on(b)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    a.dir.mkdir(parents=True, exist_ok=True)
    ckpt, saved = a.dir / "ds_checkpoint", a.dir / "model"
    if a.phase == "train":
        loss0 = step(batches[0])
        acc.save_state(str(ckpt))
        state = acc.get_state_dict(model)
        acc.unwrap_model(model).save_pretrained(saved, state_dict=state, is_main_process=acc.is_main_process,
                                                safe_serialization=True)
        acc.wait_for_everyone()
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=prompt.to(acc.device)).logits.float().cpu()
        model.train()
        loss1 = step(batches[1])
        with torch.no_grad():
            loss2 = loss_on(batches[2]).item()
        if acc.is_main_process:
            torch.save(logits, a.dir / "logits.pt")
            dtype = str(next(acc.unwrap_model(model).parameters()).dtype).replace("torch.", "")
            write_json(a.dir / "train.json", {"loss0": loss0, "loss1": loss1, "loss2": loss2, "dtype": dtype})
        acc.wait_for_everyone()
        return 0
    acc.load_state(str(ckpt))
    loss1 = step(batches[1])
    with torch.no_grad():
        loss2 = loss_on(batches[2]).item()
    if acc.is_main_process:
        ref = read_json(a.dir / "train.json")
        dtype = getattr(torch, ref["dtype"])
        reload = AutoModelForCausalLM.from_pretrained(saved, dtype=dtype).to(acc.device).eval()
        head, emb = reload.get_output_embeddings().weight, reload.get_input_embeddings().weight
        tied = head.data_ptr() == emb.data_ptr() or bool(torch.equal(head, emb))
        stored_ok, how = tied_in_checkpoint(saved)
        with torch.no_grad():
            logits = reload(input_ids=prompt.to(acc.device)).logits.float().cpu()
        mem = torch.load(a.dir / "logits.pt")
        logit_diff = float((logits - mem).abs().max() / max(1.0, float(mem.abs().max())))
        d1 = abs(loss1 - ref["loss1"]) / max(1e-8, abs(ref["loss1"]))
        d2 = abs(loss2 - ref["loss2"]) / max(1e-8, abs(ref["loss2"]))
        ok = tied and stored_ok and logit_diff <= LOGIT_RTOL and d1 <= LOSS_RTOL and d2 <= LOSS_RTOL
        fig = (f"lm_head {'=' if tied and stored_ok else '!='} embed_tokens ({how}), logits rel diff {logit_diff:.1e} "
               f"(<= {LOGIT_RTOL:g}), resumed loss rel diff {d1:.1e}/{d2:.1e} (<= {LOSS_RTOL:g}), {ref['dtype']}")
        write_json(a.dir / "result.json", {"ok": ok, "figure": fig, "tied": tied, "stored_ok": stored_ok,
                                           "logit_rel_diff": logit_diff, "loss1": [ref["loss1"], loss1],
                                           "loss2": [ref["loss2"], loss2], "dtype": ref["dtype"]})
    acc.wait_for_everyone()
    return 0
