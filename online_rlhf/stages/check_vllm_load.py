"""Check that a checkpoint saved by run_dpo.py loads in vLLM as is and generates (inference env).
A LoRA adapter folder (the loop's lora key) is checked as the loop decodes it: its base with
``enable_lora`` and a ``LoRARequest`` for the adapter.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-infer/bin/python dpo_iteration/check_vllm_load.py runs/x/iter_1/model

Loads the directory with ``vllm.LLM`` (eager, the engine seed), answers a few chat prompts
greedily with the checkpoint's own chat template, and fails (exit 1) when the engine does not
start, an answer is empty, no answer ends on the end-of-turn token, or vLLM's eos differs
from the checkpoint's generation_config. About 25 s on CPU, most of it engine start-up.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PROMPTS = ["Say hello in one short sentence.", "What is 2 plus 3? Answer with a number.",
           "Name a colour. Reply with one word."]


def main(ckpt: str) -> int:
    from vllm import LLM, SamplingParams

    from online_rlhf.adapters import is_adapter, split_model
    from online_rlhf.stages.vllm_engine import lora_engine_args, lora_request

    model, adapter = split_model(ckpt, None)  # an adapter folder: its base, with the adapter on every request
    lora, request = lora_engine_args(adapter), lora_request(adapter)
    if is_adapter(ckpt):
        print(f"LoRA adapter {ckpt} on its base {model}")
    t0 = time.perf_counter()
    llm = LLM(model=model, enforce_eager=True, max_model_len=1024, seed=0, dtype="auto", **lora)
    start_s = time.perf_counter() - t0
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=64), lora_request=request)
    gen_cfg = json.loads((Path(model) / "generation_config.json").read_text())
    want_eos = gen_cfg.get("eos_token_id")
    want_eos = set(want_eos if isinstance(want_eos, list) else [want_eos])
    eos = llm.get_tokenizer().eos_token_id
    problems = []
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        print(f"[{c.finish_reason}] {p!r} -> {c.text!r}")
        if not c.text.strip():
            problems.append(f"empty answer to {p!r}")
    if not any(o.outputs[0].finish_reason == "stop" for o in outs):
        problems.append("no answer stopped on the end-of-turn token (eos lost?)")
    if eos not in want_eos:
        problems.append(f"vLLM's tokenizer eos {eos} is not in generation_config eos_token_id {sorted(want_eos)}")
    print(f"engine start {start_s:.1f} s; eos {eos}; " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return 1 if problems else 0


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(f"usage: check_vllm_load.py CHECKPOINT_DIR (got {sys.argv[1:]})\n{__doc__}", file=sys.stderr)
        raise SystemExit(2)
    if not Path(sys.argv[1]).is_dir():
        print(f"error: {sys.argv[1]} is not a directory; give the checkpoint folder a DPO/GRPO stage saved "
              "(e.g. runs/default/iter_1/model).", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1]))


if __name__ == "__main__":
    cli()
