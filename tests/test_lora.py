"""LoRA through the loop (the loop's ``lora`` key; online_rlhf/adapters.py): the plan's wiring and
refusals, adapter-only saves of the DPO and GRPO stages, the reference with the adapter switched off
or as the previous adapter, the KL stage on an adapter, and the merged export. Tiny random policies
on CPU. vLLM decoding of an adapter is in tests/test_generation_lora.py (inference env); a LoRA loop
end to end, killed and resumed, in tests/test_e2e_loop.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from online_rlhf import loop  # noqa: E402
from online_rlhf.adapters import ADAPTER_CONFIG, adapter_base, is_adapter, merge_adapter, split_model  # noqa: E402
from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.jsonl import read_jsonl, write_jsonl  # noqa: E402
from online_rlhf.stage_configs import DPOStageConfig, GRPOStageConfig, KLConfig  # noqa: E402
from online_rlhf.stages import kl_estimate, run_dpo, run_grpo  # noqa: E402
from online_rlhf.testing import make_tiny_policy  # noqa: E402

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}


def _prompts(path: Path, n: int) -> Path:
    write_jsonl(path, [{"id": f"p{i}", "prompt": f"question {i}", "answer": str(i)} for i in range(n)])
    return path


@pytest.fixture
def small_cfg(tmp_path):
    policy = tmp_path / "models" / "start"
    policy.mkdir(parents=True)
    return [f"train_prompts={_prompts(tmp_path / 'train.jsonl', 10)}", f"eval_prompts={_prompts(tmp_path / 'e.jsonl', 4)}",
            f"output_root={tmp_path / 'runs'}", "run_name=t", f"policy={policy}", "iterations=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(make_tiny_policy(tmp_path_factory.mktemp("lora_base") / "p0", seed=0))


def _pairs(path: Path) -> Path:
    rows = [{"id": str(i), "prompt": [{"role": "user", "content": f"Question {i}: is the sky blue?"}],
             "chosen": [{"role": "assistant", "content": f"yes {i}"}],
             "rejected": [{"role": "assistant", "content": "no, the sky is green"}],
             "chosen_reward": 1.0, "rejected_reward": 0.0} for i in range(8)]
    write_jsonl(path, rows)
    return path


def _dpo(tmp_path: Path, base: str, out: str, **kw) -> DPOStageConfig:
    training = {"per_device_train_batch_size": 4, "learning_rate": 1e-2, "max_length": 128, "max_steps": 2,
                "beta": 2.0, "gradient_checkpointing": False, **kw.pop("training", {})}
    return DPOStageConfig(policy=base, pairs=str(_pairs(tmp_path / "pairs.jsonl")), output_dir=str(tmp_path / out),
                          lora=LORA, training=training, **kw)


# --- the plan --------------------------------------------------------------------------------------

def test_the_lora_key_wires_every_stage_to_the_base_and_the_last_adapter(small_cfg):
    cfg = loop.resolve(None, small_cfg + ["lora={r: 8, alpha: 16}"])
    start = next(a.split("=", 1)[1] for a in small_cfg if a.startswith("policy="))
    r = Path("/r")
    d1, d2 = loop.stage_dict(cfg, r, 1, "dpo"), loop.stage_dict(cfg, r, 2, "dpo")
    assert d1["lora"] == {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
    assert d1["save_adapter"] is True and "adapter" not in d1 and d1["policy"] == start
    assert d2["policy"] == start and d2["adapter"] == "/r/iter_1/model" and d2["reference"] == start
    g2 = loop.stage_dict(cfg, r, 2, "generate")
    assert g2["model"] == start and g2["adapter"] == "/r/iter_1/model"
    assert "adapter" not in loop.stage_dict(cfg, r, 1, "generate")  # iteration 1 samples the starting policy
    for stage in ("eval_generate", "kl_generate", "ifeval_generate"):
        assert loop.stage_dict(cfg, r, 2, stage)["adapter"] == "/r/iter_2/model", stage
    assert "adapter" not in loop.stage_dict(cfg, r, 0, "eval_generate")
    kl = loop.stage_dict(cfg, r, 1, "kl")
    assert kl["policy"] == kl["reference"] == start and kl["adapter"] == "/r/iter_1/model"
    grpo = loop.stage_dict(loop.resolve(None, small_cfg + ["lora={r: 8}", "algorithm=grpo"]), r, 2, "grpo")
    assert grpo["lora"]["lora_alpha"] == 16 and grpo["adapter"] == "/r/iter_1/model" and grpo["save_adapter"]


def test_the_adapter_is_an_input_of_every_stage_that_reads_it(small_cfg):
    run_dir = loop.plan(None, small_cfg + ["lora={r: 8}"])
    plan = json.loads((run_dir / "iter_2" / "plan.json").read_text())
    adapter = str(run_dir / "iter_1" / "model")
    for stage in ("generate", "dpo"):
        assert adapter in plan[stage]["inputs"], stage
    assert str(run_dir / "iter_2" / "model") in plan["kl"]["inputs"]


def test_a_plan_without_lora_writes_no_adapter_keys(small_cfg):
    run_dir = loop.plan(None, small_cfg)
    text = "".join(p.read_text() for p in (run_dir / "iter_2" / "configs").glob("*.yaml"))
    assert "adapter" not in text.replace("lora_adapter", "") and "lora:" not in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("override, match", [
    ("dpo.lora={r: 4}", r"lora and dpo\.lora are both set"),
    ("launch_profile=zero3", r"zero3 is refused.*zero2"),
    ("per_iteration={2: {lora: {r: 4}}}", r"per_iteration\.2\.lora: cannot be set per iteration"),
    ("dpo.save_adapter=true", r"dpo\.save_adapter"),
    ("lora={r: 4, rank: 2}", r"unknown key 'rank' \(peft's rank is r here\)"),
    ("lora={lora_alpha: 8}", r"peft's lora_alpha is alpha here"),
    ("lora={r: 0}", r"lora\.r"),
    ("lora=true", r"lora must be a mapping.*lora='\{r: 16, alpha: 32\}'"),
    ("lora={target_modules: []}", r"non-empty list"),
    ("lora={target_modules: all_linear}", r"did you mean all-linear"),
    ("dpo.training.sync_ref_model=true", r"sync_ref_model=true with lora"),
])
def test_lora_settings_the_loop_cannot_run_are_refused_before_any_stage(small_cfg, override, match):
    with pytest.raises(ConfigError, match=match):
        loop.resolve(None, small_cfg + ["lora={r: 8}", override] if not override.startswith("lora=") else
                     small_cfg + [override])


def test_stage_configs_refuse_an_adapter_without_lora(tmp_path):
    with pytest.raises(Exception, match="adapter=.* needs lora"):
        DPOStageConfig(policy="p", pairs="x", output_dir=str(tmp_path / "m"), adapter=str(tmp_path))
    with pytest.raises(Exception, match="save_adapter=true needs lora"):
        GRPOStageConfig(policy="p", rewards="x", output_dir=str(tmp_path / "m"), save_adapter=True)


# --- the DPO stage ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dpo_iterations(base, tmp_path_factory):
    """Iteration 1 (a fresh adapter, saved alone), then iteration 2 twice from it: reference = the
    base (the loop's ``initial``: the adapter switched off) and reference = null (``previous``)."""
    t = tmp_path_factory.mktemp("dpo_lora")
    first = run_dpo.main(_dpo(t, base, "iter_1", reference=base, save_adapter=True))
    one_batch = {"per_device_train_batch_size": 8, "max_steps": 1}  # the first loss is over all 8 pairs
    initial = run_dpo.main(_dpo(t, base, "iter_2_initial", reference=base, adapter=str(t / "iter_1"), save_adapter=True,
                                training=one_batch))
    previous = run_dpo.main(_dpo(t, base, "iter_2_previous", adapter=str(t / "iter_1"), save_adapter=True,
                                 training=one_batch))
    return t, first, initial, previous


def test_dpo_saves_the_adapter_only_naming_its_base(dpo_iterations, base):
    t, first, _, _ = dpo_iterations
    out = t / "iter_1"
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")) == [
        ADAPTER_CONFIG, "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert adapter_base(str(out)) == str(Path(base).resolve())
    assert first.saved == "adapter" and 0 < first.saved_mb < 1.0  # the tiny model itself is ~1 MB
    assert first.reference.lora_reference == "adapter_off" and first.adapter is None
    assert split_model(str(out), None) == (str(Path(base).resolve()), str(out))
    modules = json.loads((out / ADAPTER_CONFIG).read_text())["target_modules"]
    assert modules == sorted(modules) and len(modules) > 2  # one order whatever PYTHONHASHSEED: resume hashes agree


def _peft_first_loss(base: str, adapter: str | None, ref_adapter: str | None, pairs: Path, beta: float = 2.0) -> float:
    """The DPO loss of the first step computed here with transformers + peft: policy = base +
    ``adapter``, reference = base + ``ref_adapter`` (None: the base alone)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from online_rlhf.adapters import load_with_adapter

    def model(a):
        m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        return (load_with_adapter(m, a) if a else m).eval()

    tok = AutoTokenizer.from_pretrained(base)
    pol, ref = model(adapter), model(ref_adapter)

    def logp(m, prompt, completion):
        p = tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))["input_ids"]
        ids = torch.tensor([tok(tok.apply_chat_template(prompt + completion, tokenize=False))["input_ids"]])
        with torch.no_grad():
            lp = m(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        return lp[len(p) - 1:].sum().item()

    losses = []
    for r in read_jsonl(pairs):
        margin = sum(s * (logp(pol, r["prompt"], r[side]) - logp(ref, r["prompt"], r[side]))
                     for s, side in ((1, "chosen"), (-1, "rejected")))
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(beta * margin)).item())
    return sum(losses) / len(losses)


def test_continued_adapter_against_the_base_with_the_adapter_switched_off(dpo_iterations, base):
    t, first, initial, _ = dpo_iterations
    assert initial.reference.lora_reference == "adapter_off" and initial.adapter == str(t / "iter_1")
    assert initial.reference.path == base
    # the first step starts from iteration 1's adapter, measured against the base: not log(2)
    assert abs(initial.train_loss_first - math.log(2)) > 0.05
    # sigmoid loss over all 8 pairs (one batch), policy = base + iteration 1's adapter, reference = the base
    assert initial.train_loss_first == pytest.approx(_peft_first_loss(base, str(t / "iter_1"), None, t / "pairs.jsonl"),
                                                     rel=1e-3)


def test_previous_reference_is_the_adapter_the_stage_continued(dpo_iterations):
    t, _, initial, previous = dpo_iterations
    assert previous.reference.lora_reference == "previous_adapter" and not previous.reference.lora_adapter_disabled
    assert previous.train_loss_first == pytest.approx(math.log(2), abs=1e-5)  # policy == reference at the start
    a, b = (json.loads((t / n / ADAPTER_CONFIG).read_text()) for n in ("iter_2_initial", "iter_2_previous"))
    assert a["r"] == b["r"] == 4


def test_continuing_with_another_rank_is_refused_before_training(dpo_iterations, base, tmp_path):
    t, *_ = dpo_iterations
    cfg = _dpo(tmp_path, base, "x", adapter=str(t / "iter_1"), save_adapter=True)
    cfg = cfg.model_copy(update={"lora": {**LORA, "r": 8}})
    with pytest.raises(ConfigError, match=r"lora\.r=8.*trained with r=4"):
        run_dpo.main(cfg)


# --- the reference with the adapter switched off: the KL stage ------------------------------------

def test_kl_of_an_adapter_scores_the_reference_as_the_base(dpo_iterations, base, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from online_rlhf.adapters import load_with_adapter
    from online_rlhf.chat_tokens import prompt_response_ids

    t, *_ = dpo_iterations
    adapter = str(t / "iter_2_initial")
    prompt = [{"role": "user", "content": "Question 1: is the sky blue?"}]
    write_jsonl(tmp_path / "kl_generated.jsonl", [{"id": "a", "prompt": prompt, "responses": ["yes 1", "no"],
                                                   "finish_reasons": ["stop", "stop"], "response_tokens": [2, 1]}])
    stats = kl_estimate.main(KLConfig(input=str(tmp_path / "kl_generated.jsonl"), policy=base, adapter=adapter,
                                      reference=base, output=str(tmp_path / "kl.jsonl"), dtype="float32"))
    assert stats.reference_adapter_off and stats.adapter == adapter
    row = read_jsonl(tmp_path / "kl.jsonl")[0]
    tok = AutoTokenizer.from_pretrained(base)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft = load_with_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    for j, resp in enumerate(["yes 1", "no"]):
        seqs = [kl_estimate.response_token_ids(tok, prompt, resp, "stop")]
        assert row["logp_reference"][j] == pytest.approx(kl_estimate.sequence_log_probs(plain, seqs, 1, 2)[0], abs=1e-4)
        assert row["logp_policy"][j] == pytest.approx(kl_estimate.sequence_log_probs(peft, seqs, 1, 2)[0], abs=1e-4)
    assert row["logp_policy"] != row["logp_reference"]


# --- the merged export -----------------------------------------------------------------------------

def test_merged_export_equals_base_plus_adapter(dpo_iterations, base, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from online_rlhf.adapters import load_with_adapter

    t, *_ = dpo_iterations
    adapter = str(t / "iter_2_initial")
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "merge_lora.py"),
                        adapter, str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file() and not is_adapter(str(out))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    peft = load_with_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 20, 33, 7, 2]])
    with torch.no_grad():
        a, b, c = merged(ids).logits, peft(ids).logits, plain(ids).logits
    assert torch.allclose(a, b, atol=1e-4) and not torch.allclose(a, c, atol=1e-3)
    again = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "merge_lora.py"),
                            adapter, str(out)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr  # never over an existing folder
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter folder"):
        merge_adapter(str(out), tmp_path / "m2")


# --- the GRPO stage --------------------------------------------------------------------------------

def test_grpo_trains_and_continues_an_adapter_against_the_base(base, tmp_path):
    rows = [{"id": str(i), "prompt": [{"role": "user", "content": f"Question {i}: say yes."}],
             "responses": ["yes yes yes", "no no no", "yes yes yes", "no no no"], "finish_reasons": ["stop"] * 4,
             "response_tokens": [3] * 4, "rewards": [1.0, 0.0, 1.0, 0.0], "reward_source": "verifier"} for i in range(4)]
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    common = {"policy": base, "rewards": str(tmp_path / "rewards.jsonl"), "learning_rate": 1e-2, "beta": 0.04,
              "per_device_train_batch_size": 4, "loss_type": "grpo", "max_completion_length": 16, "lora": LORA,
              "save_adapter": True}
    first = run_grpo.main(GRPOStageConfig.from_dict({**common, "reference": base, "output_dir": str(tmp_path / "i1")}))
    assert first.saved == "adapter" and is_adapter(str(tmp_path / "i1")) and first.reference["lora_reference"] == "adapter_off"
    assert not (tmp_path / "i1" / "model.safetensors").exists()
    again = run_grpo.main(GRPOStageConfig.from_dict({**common, "reference": base, "adapter": str(tmp_path / "i1"),
                                                     "output_dir": str(tmp_path / "i2")}))
    assert again.adapter == str(tmp_path / "i1") and again.history[0]["kl"] > 1e-4  # the base differs from the adapter
    prev = run_grpo.main(GRPOStageConfig.from_dict({**common, "adapter": str(tmp_path / "i1"),
                                                    "output_dir": str(tmp_path / "i2p")}))
    assert prev.reference["lora_reference"] == "previous_adapter" and prev.history[0]["kl"] == pytest.approx(0, abs=1e-6)


def test_the_freshness_hash_covers_the_adapter(small_cfg):
    from online_rlhf.loop import freshness

    run_dir = loop.plan(None, small_cfg + ["lora={r: 8}"])
    adapter = run_dir / "iter_1" / "model"
    adapter.mkdir(parents=True)
    (adapter / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 8, "base_model_name_or_path": "x"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"one")
    before = {s: freshness.stage_hash(run_dir, 2, s) for s in ("generate", "dpo")}
    (adapter / "adapter_model.safetensors").write_bytes(b"two")
    after = {s: freshness.stage_hash(run_dir, 2, s) for s in ("generate", "dpo")}
    assert all(before[s] != after[s] for s in before)
    assert freshness.stage_hash(run_dir, 2, "pairs") == freshness.stage_hash(run_dir, 2, "pairs")


def test_an_adapter_as_the_starting_policy_is_refused_with_the_merge_command(small_cfg, tmp_path):
    folder = tmp_path / "old_run_iter_2_model"
    folder.mkdir()
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 8, "base_model_name_or_path": "x"}))
    args = [a for a in small_cfg if not a.startswith("policy=")] + [f"policy={folder}"]
    for extra in ([], ["lora={r: 8}"]):
        with pytest.raises(ConfigError, match=r"is a LoRA adapter folder.*scripts/merge_lora\.py"):
            loop.resolve(None, args + extra)


def test_target_modules_the_policy_does_not_have_are_refused_by_the_plan(small_cfg, base):
    args = [a for a in small_cfg if not a.startswith("policy=")] + [f"policy={base}"]
    with pytest.raises(ConfigError, match=r"names qkv_proj, which the policy .* has no linear layer for; its linear "
                                          r"layers are .*q_proj"):
        loop.resolve(None, args + ["lora={target_modules: [q_proj, qkv_proj]}"])
    assert loop.resolve(None, args + ["lora={target_modules: [q_proj, v_proj]}"]).lora.target_modules == ["q_proj", "v_proj"]


def test_an_sft_adapter_is_refused_by_the_plan(small_cfg, tmp_path):
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])
    with pytest.raises(ConfigError, match=r"sft\.adapter='lora'.*set the loop key lora"):
        loop.resolve(None, small_cfg + ["sft.enabled=true", f"sft.dataset={data}", "sft.adapter=lora"])


@pytest.mark.parametrize("case", ["missing", "no_weights", "full_checkpoint"])
def test_merge_lora_refuses_what_it_cannot_merge_naming_the_fix(tmp_path, base, case):
    import subprocess
    import sys

    folder = tmp_path / "adapter"
    if case == "no_weights":
        folder.mkdir()
        (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 8, "base_model_name_or_path": base}))
    elif case == "full_checkpoint":
        folder = Path(base)
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "merge_lora.py"),
                        str(folder), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    expected = {"missing": "no such folder", "no_weights": "no adapter_model.safetensors",
                "full_checkpoint": "a full checkpoint needs no merge"}[case]
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "out").exists()


def test_the_adapter_is_part_of_the_eval_cache_key(tmp_path):
    from online_rlhf.eval_cache import cache_key

    model, prompts, adapter = tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "a"
    for d in (model, adapter):
        d.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    prompts.write_text('{"id": "1", "prompt": "x"}\n')
    (adapter / "adapter_model.safetensors").write_bytes(b"one")
    d = {"model": str(model), "adapter": str(adapter), "prompts": str(prompts), "temperature": 0.0, "k": 1}
    key = cache_key("eval_generate", d, [str(model), str(adapter), str(prompts)])
    (adapter / "adapter_model.safetensors").write_bytes(b"two")
    assert cache_key("eval_generate", d, [str(model), str(adapter), str(prompts)]) != key
    plain = {k: v for k, v in d.items() if k != "adapter"}
    assert cache_key("eval_generate", plain, [str(model), str(prompts)]) != key


def test_stages_refuse_a_damaged_or_mismatched_adapter_before_loading_weights(dpo_iterations, base, tmp_path):
    import shutil

    t, *_ = dpo_iterations
    cut = tmp_path / "cut"
    shutil.copytree(t / "iter_1", cut)
    (cut / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors.*cut short"):
        run_dpo.main(_dpo(tmp_path, base, "x", adapter=str(cut), save_adapter=True))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        run_dpo.main(_dpo(tmp_path, base, "x", adapter=str(tmp_path / "nope"), save_adapter=True))
    with pytest.raises(ConfigError, match=r"target_modules=\['q_proj'\].*adapts"):
        run_dpo.main(_dpo(tmp_path, base, "x", adapter=str(t / "iter_1"), save_adapter=True).model_copy(
            update={"lora": {**LORA, "target_modules": ["q_proj"]}}))
    with pytest.raises(ConfigError, match="reference=.* is a LoRA adapter folder"):
        run_dpo.main(_dpo(tmp_path, base, "x", reference=str(t / "iter_1"), save_adapter=True))
    rewards = tmp_path / "rewards.jsonl"
    write_jsonl(rewards, [{"id": "1", "prompt": [{"role": "user", "content": "say yes"}], "responses": ["yes", "no"],
                           "finish_reasons": ["stop"] * 2, "response_tokens": [1, 1], "rewards": [1.0, 0.0],
                           "reward_source": "verifier"}])
    with pytest.raises(ConfigError, match="bogus"):  # a continued adapter's lora keys are checked too
        run_grpo.main(GRPOStageConfig.from_dict({"policy": base, "rewards": str(rewards), "output_dir": str(tmp_path / "g"),
                                                 "adapter": str(t / "iter_1"), "lora": {**LORA, "bogus": 1}}))


def test_a_lora_section_in_the_dpo_recipe_file_is_refused_with_the_loop_key(small_cfg, tmp_path):
    recipe = tmp_path / "dpo_lora.yaml"
    recipe.write_text("lora: {r: 4}\ntraining: {beta: 0.1}\n")
    with pytest.raises(ConfigError, match=r"holds a lora section too"):
        loop.resolve(None, small_cfg + [f"dpo_config={recipe}", "lora={r: 8}"])
    assert loop.resolve(None, small_cfg + [f"dpo_config={recipe}"]).lora is None  # alone: the older merged way
