"""DPO steps/s with precomputed reference log-probs vs recomputing them every step.

    OMP_NUM_THREADS=1 .venv-train/bin/python -m bench.bench_dpo_ref [--steps 6] [--batch 4] [--max-length 256] [--smoke]

Same pairs, same policy (the embedded default if prepared, else a 4-layer random model; ``--smoke``: a 2-layer
one, one step of two pairs), one process, the stage's precision (bf16 autocast on a CPU with native
bf16, else fp32). Run 1 recomputes the reference log-probs in every step (a second copy of the
policy is loaded as the reference); run 2 computes them once before training
(``precompute_ref_log_probs``). Prints, for each run, the training-loop steps/s and the
end-to-end rate (reference precompute + training loop), and the ratios. The training-loop
ratio is the per-step gain (target >= 1.3x: a step drops one of its ~4 forward-equivalents);
over a single epoch the end-to-end time barely changes, because the one precompute pass costs
what the per-step reference forwards cost -- its other gain is memory (no reference model held
during training).

Pairs: the first 24 Anthropic HH-RLHF harmless-base test transcripts, kept in
``tests/data/hh_rlhf_harmless-base_test_first24.jsonl.gz`` (MIT; source in tests/data/README.md):
last assistant turn = chosen / rejected response. The default run (6 steps x 4 pairs) uses each
once; a larger ``--steps x --batch`` cycles through them again (under new ids).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from online_rlhf.paths import default_model_dir
from online_rlhf.stage_configs import DPOStageConfig

HH = ROOT / "tests" / "data" / "hh_rlhf_harmless-base_test_first24.jsonl.gz"


def hh_to_messages(transcript: str) -> list[dict] | None:
    """``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` -> chat messages, or None when the turns do not alternate."""
    parts = re.split(r"\n\n(Human|Assistant): ", transcript)
    msgs = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
            for who, text in zip(parts[1::2], parts[2::2])]
    ok = msgs and all(m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(msgs))
    return msgs if ok and msgs[-1]["role"] == "assistant" else None


def hh_pairs(n: int, path: Path = HH) -> list[dict]:
    """``n`` HH-RLHF pairs as ``{id, prompt, chosen, rejected}`` messages (shared prompt, differing
    last turn): the file's usable pairs in order, cycled when ``n`` exceeds them."""
    usable = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            rec = json.loads(line)
            c, r = hh_to_messages(rec["chosen"]), hh_to_messages(rec["rejected"])
            if not c or not r or c[:-1] != r[:-1] or c[-1] == r[-1] or not c[-1]["content"] or not r[-1]["content"]:
                continue
            usable.append({"id": f"hh{i}", "prompt": c[:-1], "chosen": [c[-1]], "rejected": [r[-1]]})
    if not usable:
        raise SystemExit(f"{path} holds no usable HH-RLHF pair")
    return [{**usable[j % len(usable)], "id": usable[j % len(usable)]["id"] + (f"_{j // len(usable)}" if j >= len(usable) else "")}
            for j in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="pairs per step")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="a random 2-layer model, 1 step of 2 pairs: seconds, for the tests")
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.batch, a.max_length = 1, 2, 1024  # the tiny byte-level tokenizer: ~500-token prompts

    from online_rlhf.stages import run_dpo


    n = a.steps * a.batch  # one epoch = exactly `steps` steps; precompute covers only these pairs
    work = Path(tempfile.mkdtemp(prefix="bench_dpo_ref_"))
    if not a.smoke and (default_model_dir() / "config.json").is_file():
        policy, model_desc = str(default_model_dir()), "SmolLM2-135M-Instruct"
    else:
        from online_rlhf.testing import make_tiny_policy

        if a.smoke:
            policy, model_desc = str(make_tiny_policy(work / "policy")), "random 2-layer Llama (--smoke)"
        else:
            policy = str(make_tiny_policy(work / "policy", num_hidden_layers=4, hidden_size=256, intermediate_size=512))
            model_desc = "random 4-layer Llama (default model not prepared)"
    pairs = hh_pairs(n)
    unique = len({p["id"].split("_")[0] for p in pairs})
    source = f"HH-RLHF harmless-base test ({unique} distinct)"
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))

    results = {}
    for precompute in (False, True):
        cfg = DPOStageConfig(policy=policy, pairs=str(work / "pairs.jsonl"), output_dir=str(work / f"m{int(precompute)}"),
                             training={"per_device_train_batch_size": a.batch, "max_steps": a.steps,
                                       "max_length": a.max_length, "learning_rate": 5e-6,
                                       "gradient_checkpointing": False, "precompute_ref_log_probs": precompute})
        s = run_dpo.main(cfg)
        sec = s.seconds
        results[precompute] = {"steps": s.steps, "loop_s": sec.train_steps,
                               "precompute_s": sec.reference_precompute,
                               "loop_steps_per_s": s.steps / sec.train_steps,
                               "e2e_steps_per_s": s.steps / (sec.train_steps + sec.reference_precompute),
                               "loss_first": s.train_loss_first, "dtype": s.hardware.get("dtype")}
    off, on = results[False], results[True]
    print(f"\nmodel: {model_desc}; pairs: {source}, {n} pairs, batch {a.batch}, max_length {a.max_length}, "
          f"{a.steps} steps, CPU {on['dtype']}")
    for name, r in (("recompute reference", off), ("precomputed reference", on)):
        print(f"  {name:22s} loop {r['loop_s']:7.1f} s = {r['loop_steps_per_s']:.4f} steps/s; precompute "
              f"{r['precompute_s']:5.1f} s; end-to-end {r['e2e_steps_per_s']:.4f} steps/s; first loss {r['loss_first']:.4f}")
    print(f"  training-loop speed-up (precomputed / recomputed): {on['loop_steps_per_s'] / off['loop_steps_per_s']:.2f}x"
          f"  (target >= 1.3x)")
    print(f"  end-to-end ratio incl. the precompute pass:        {on['e2e_steps_per_s'] / off['e2e_steps_per_s']:.2f}x")


if __name__ == "__main__":
    main()
