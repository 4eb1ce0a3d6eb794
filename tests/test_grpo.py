"""GRPO stage (grpo_iteration/run_grpo.py): advantages, the loss against TRL 1.9's own, the stage on
tiny random policies in one process, the loop's wiring; slow: the loop end to end with vLLM.

Run with the training env: ``.venv-train/bin/python -m pytest tests/test_grpo.py -m "not slow"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from online_rlhf import loop  # noqa: E402
from online_rlhf.config import ConfigError  # noqa: E402
from online_rlhf.jsonl import DataError, read_json, read_jsonl, write_jsonl  # noqa: E402
from online_rlhf.stage_configs import GRPOStageConfig  # noqa: E402
from online_rlhf.stage_table import STAGES  # noqa: E402
from online_rlhf.stages import run_grpo  # noqa: E402
from online_rlhf import chat_tokens  # noqa: E402
from online_rlhf.stages import grpo_data, grpo_objective  # noqa: E402
from online_rlhf.stats import GRPOStats, stats_path  # noqa: E402
from online_rlhf.testing import kill_loop_during, make_tiny_policy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAN = math.nan


# --- advantages ---------------------------------------------------------------------------------

def test_advantages_center_on_the_group_mean_and_skip_groups_without_signal():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0],   # a single distinct reward
                      [1.0, 1.0, 0.0, 0.0],   # ties
                      [0.5, 0.5, 0.5, 0.5],   # std 0: no signal
                      [1.0, NAN, NAN, NAN],   # one scored response
                      [0.2, NAN, 0.8, 0.5]], dtype=torch.float64)  # unscored left out
    adv, usable = grpo_data.group_advantages(r, "none")
    assert usable.tolist() == [True, True, False, False, True]
    assert adv[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert adv[1].tolist() == pytest.approx([0.5, 0.5, -0.5, -0.5])
    assert adv[2].tolist() == [0.0] * 4
    assert math.isnan(adv[4, 1]) and adv[4, [0, 2, 3]].tolist() == pytest.approx([-0.3, 0.3, 0.0])
    # GRPO divides by the group's (Bessel-corrected) std + 1e-4; Dr. GRPO (none) does not
    g, _ = grpo_data.group_advantages(r, "group")
    std0 = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64).std()
    assert g[0].tolist() == pytest.approx((adv[0] / (std0 + 1e-4)).tolist())
    assert g[1].tolist() == pytest.approx((adv[1] / (torch.tensor([1.0, 1, 0, 0]).std().item() + 1e-4)).tolist())
    assert g[2].tolist() == [0.0] * 4  # 0 / (0 + 1e-4): never NaN
    b, _ = grpo_data.group_advantages(r, "batch")
    flat = r[~torch.isnan(r)]
    assert b[0].tolist() == pytest.approx((adv[0] / (flat.std() + 1e-4)).tolist())
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_data.group_advantages(r, "std")


# --- the loss against TRL's GRPOTrainer._compute_loss -------------------------------------------

def _trl_loss(logps, old, ref, adv, mask, beta, loss_type, eps, eps_hi, max_len):
    """TRL 1.9's ``GRPOTrainer._compute_loss`` on these tensors: called unbound on a stub trainer whose
    log-prob method returns ``logps`` (the method the loss is built from is TRL's own code)."""
    from trl import GRPOTrainer

    B, C = logps.shape
    acc = SimpleNamespace(reduce=lambda x, reduction="sum": x, gather=lambda x: x, num_processes=1)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps, epsilon_high=eps_hi,
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_len, _entropy_bonus_enabled=False, accelerator=acc,
        _metrics={"train": defaultdict(list)}, args=SimpleNamespace(use_bias_correction_kl=False, delta=None))
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(stub, None, inputs), stub._metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("off_policy", [False, True])  # True: num_iterations > 1, the ratio is not 1
def test_loss_equals_trl_grpo_loss(loss_type, beta, off_policy):
    g = torch.Generator().manual_seed(0)
    B, C = 4, 6
    logps = -torch.rand(B, C, generator=g, dtype=torch.float64) * 3
    old = logps + (torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3 if off_policy else 0.0)
    ref = logps + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.2, -0.7, 0.3, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]],
                        dtype=torch.float64)
    ours, m = grpo_objective.grpo_loss(logps, old, ref if beta else None, adv, mask, beta=beta, epsilon=0.2,
                                 epsilon_high=0.28, loss_type=loss_type, max_completion_length=8,
                                 num_items_in_batch=mask.sum())
    theirs, tm = _trl_loss(logps, old, ref, adv, mask, beta, loss_type, 0.2, 0.28, 8)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-5)
    assert float(m["clip_fraction"]) == pytest.approx(tm["clip_ratio/region_mean"][0], abs=1e-6)
    if beta:
        assert float(m["kl"]) == pytest.approx(tm["kl"][0], abs=1e-6)
    if off_policy:
        assert float(m["ratio_max_dev"]) > 0.05
    else:
        assert float(m["ratio_max_dev"]) == 0.0


def test_loss_gradient_pushes_up_positive_advantage_tokens():
    logps = torch.log(torch.full((2, 3), 0.5, dtype=torch.float64)).requires_grad_()
    loss, _ = grpo_objective.grpo_loss(logps, logps.detach(), None, torch.tensor([1.0, -1.0], dtype=torch.float64),
                                 torch.ones(2, 3, dtype=torch.float64), beta=0.0, epsilon=0.2, epsilon_high=0.2,
                                 loss_type="grpo", max_completion_length=3)
    loss.backward()
    assert (logps.grad[0] < 0).all() and (logps.grad[1] > 0).all()  # descent raises row 0, lowers row 1


def test_log_probs_ratio_and_kl_are_float32_on_a_bf16_policy(tmp_path):
    """OpenRLHF PR #634: a bf16 log-softmax is off by ~0.01 nats per token, and a bf16 k3 term at
    x = 0.01 comes out negative; the stage's log-probs and loss are float32 whatever the weights."""
    from transformers import AutoModelForCausalLM

    from online_rlhf.stages.grpo_objective import collate, completion_log_probs

    path = make_tiny_policy(tmp_path / "p")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    comps = [{"prompt_ids": torch.randint(5, 500, (n,), generator=g).tolist(),
              "completion_ids": torch.randint(5, 500, (m,), generator=g).tolist(), "advantage": a}
             for n, m, a in ((7, 9, 1.0), (4, 12, -1.0))]
    batch = collate(comps, pad_id=0)
    with torch.no_grad():
        ours = completion_log_probs(model, batch, temperature=0.7)  # (B, C)
        P, C = batch["prompt_len"], batch["completion_mask"].size(1)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, P - 1:-1]  # (B, C, V) bf16, as the model gives them
        ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, batch["input_ids"][:, P:, None])[..., 0]  # (B, C)
    mask = batch["completion_mask"].bool()
    assert ours.dtype == torch.float32
    assert (ours.double() - ref)[mask].abs().max() < 1e-5  # a bf16 log-softmax: ~1e-2

    # the k3 KL at ref - logp = bf16(0.01), every input in bf16 as a bf16 policy would hand them over
    x = torch.tensor(0.01, dtype=torch.bfloat16)
    logps, ref_lp = torch.zeros(1, 4, dtype=torch.bfloat16), torch.full((1, 4), float(x), dtype=torch.bfloat16)
    _, m = grpo_objective.grpo_loss(logps, logps, ref_lp, torch.ones(1, dtype=torch.bfloat16),
                              torch.ones(1, 4, dtype=torch.bfloat16), beta=0.04, epsilon=0.2, epsilon_high=0.2,
                              loss_type="grpo", max_completion_length=4)
    exact = math.exp(float(x)) - float(x) - 1  # 5.03e-5
    assert float(m["kl"]) == pytest.approx(exact, rel=1e-3)  # bf16 arithmetic: -0.0039


# --- config -------------------------------------------------------------------------------------

def test_training_keys_carry_trl_grpo_config_names():
    trl_fields = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    named_as_trl = ["learning_rate", "weight_decay", "max_grad_norm", "per_device_train_batch_size",
                    "gradient_accumulation_steps", "num_iterations", "beta", "epsilon", "epsilon_high", "loss_type",
                    "scale_rewards", "max_completion_length", "mask_truncated_completions", "seed", "shuffle_dataset",
                    "gradient_checkpointing", "temperature"]
    for name in named_as_trl:
        assert name in trl_fields, name
        ours = GRPOStageConfig.model_fields[name].default
        if name != "gradient_checkpointing":  # TRL's default is true; ours false (documented)
            assert ours == trl_fields[name], (name, ours, trl_fields[name])


def test_config_refuses_epsilon_high_below_epsilon(tmp_path):
    with pytest.raises(ConfigError, match="epsilon_high"):
        GRPOStageConfig.from_dict({"policy": "p", "rewards": "r.jsonl", "output_dir": str(tmp_path / "m"),
                                   "epsilon": 0.2, "epsilon_high": 0.1})
    with pytest.raises(ConfigError, match="loss_type"):
        GRPOStageConfig.from_dict({"policy": "p", "rewards": "r.jsonl", "output_dir": str(tmp_path / "m"),
                                   "loss_type": "ppo"})


# --- the loop's wiring --------------------------------------------------------------------------

SMALL = ["prompts_per_iteration=4", "eval_limit=4", "num_processes=1"]


def test_algorithm_picks_the_stages_of_an_iteration():
    dpo = loop.resolve(None, SMALL)
    grpo = loop.resolve(None, SMALL + ["algorithm=grpo"])
    evaluation = ("kl_generate", "kl", "ifeval_generate", "ifeval_score")  # the same for both algorithms
    picks = {name: [s for s in STAGES if STAGES[s].runs_in(c, 1) and s not in evaluation] for name, c in
             (("dpo", dpo), ("grpo", grpo))}
    assert picks["dpo"] == ["generate", "rewards", "pairs", "dpo", "eval_generate", "eval_rewards"]
    assert picks["grpo"] == ["generate", "rewards", "grpo", "eval_generate", "eval_rewards"]
    assert ([s for s in evaluation if STAGES[s].runs_in(dpo, 1)] == [s for s in evaluation if STAGES[s].runs_in(grpo, 1)]
            == ["kl_generate", "kl"])
    loop_sh = (ROOT / "run_loop.sh").read_text()  # it runs the planned stages, whatever they are
    assert "online_rlhf.loop stages" in loop_sh and 'run_stage "$i" grpo' not in loop_sh


def test_grpo_section_layers_stage_file_loop_keys_and_per_iteration():
    cfg = loop.resolve("configs/loop.yaml", ["algorithm=grpo", "grpo.beta=0.04", "ref_model=initial",
                                             "per_iteration={2: {grpo: {learning_rate: 2.0e-6}}}"])
    d1, d2 = (loop.stage_dict(cfg, Path("/r"), i, "grpo") for i in (1, 2))
    assert d1["loss_type"] == "dr_grpo" and d1["beta"] == 0.04  # configs/grpo.yaml, then the command line
    assert d1["learning_rate"] == 1e-5 and d2["learning_rate"] == 2e-6
    assert d1["max_completion_length"] == 256  # the generation's max_tokens in configs/loop.yaml
    assert d2["policy"] == "/r/iter_1/model" and d2["rewards"] == "/r/iter_2/rewards.jsonl"
    assert d2["output_dir"] == "/r/iter_2/model" and d2["reference"] is not None
    assert loop.stage_dict(loop.resolve(None, SMALL + ["algorithm=grpo", "ref_model=previous"]), Path("/r"), 2,
                           "grpo")["reference"] is None


def test_grpo_keys_are_checked_by_the_plan():
    with pytest.raises(ConfigError, match=r"grpo\.betta: unknown key\. Did you mean 'beta'"):
        loop.resolve(None, SMALL + ["algorithm=grpo", "grpo.betta=0.1"])
    with pytest.raises(ConfigError, match=r"grpo\.rewards: cannot be set here"):
        loop.resolve(None, SMALL + ["algorithm=grpo", "grpo.rewards=x.jsonl"])
    with pytest.raises(ConfigError, match=r"per_iteration\.2\.algorithm: cannot be set per iteration"):
        loop.resolve(None, SMALL + ["per_iteration={2: {algorithm: grpo}}"])


@pytest.mark.parametrize("override,where,fix", [
    ("grpo.temperature=0.7", r"grpo\.temperature", "generation.temperature"),
    ("grpo.max_completion_length=64", r"grpo\.max_completion_length", "generation.max_tokens"),
    ("per_iteration={2: {grpo: {temperature: 0.7}}}", r"per_iteration\.2\.grpo\.temperature", "generation.temperature"),
    ("per_iteration={2: {grpo: {max_completion_length: 64}}}", r"per_iteration\.2\.grpo\.max_completion_length",
     "generation.max_tokens"),
])
def test_grpo_sampling_keys_are_set_only_by_the_loop(override, where, fix):
    """grpo.temperature / max_completion_length come from the generation section; set anywhere
    else they would silently disagree with how the rollouts were sampled."""
    with pytest.raises(ConfigError, match=rf"{where}: cannot be set here; the loop sets it from {fix}.*set {fix} instead"):
        loop.resolve(None, SMALL + ["algorithm=grpo", override])


@pytest.mark.parametrize("key,fix", [("temperature", "generation.temperature"),
                                     ("max_completion_length", "generation.max_tokens")])
def test_grpo_sampling_keys_in_the_stage_file_are_refused(tmp_path, key, fix):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"beta: 0.0\n{key}: 7\n")
    with pytest.raises(ConfigError, match=rf"grpo_config={recipe}: {key}: cannot be set in this file; .*set {fix} "
                                          rf"instead \(and remove {key} from {recipe}\)"):
        loop.resolve(None, SMALL + ["algorithm=grpo", f"grpo_config={recipe}"])


def test_grpo_sampling_keys_follow_the_generation_section():
    cfg = loop.resolve(None, SMALL + ["algorithm=grpo", "generation.temperature=0.8", "generation.max_tokens=48",
                                      "per_iteration={2: {generation: {max_tokens: 32}}}"])
    d1, d2 = (loop.stage_dict(cfg, Path("/r"), i, "grpo") for i in (1, 2))
    assert (d1["temperature"], d1["max_completion_length"]) == (0.8, 48)
    assert (d2["temperature"], d2["max_completion_length"]) == (0.8, 32)


def _plan_args(tmp_path: Path) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"id": f"p{j}", "prompt": f"q{j}", "answer": str(j)} for j in range(6)])  # answer: for the verifier
    (tmp_path / "pol").mkdir(exist_ok=True)
    return [f"train_prompts={prompts}", f"eval_prompts={prompts}", f"output_root={tmp_path / 'runs'}", "run_name=r",
            f"policy={tmp_path / 'pol'}", "ifeval.when=never", *SMALL]


def test_keys_of_the_algorithm_that_does_not_run_are_named_once(tmp_path, capsys):
    args = _plan_args(tmp_path)
    capsys.readouterr()
    run = loop.plan(None, args + ["grpo.beta=0.04", "per_iteration={2: {grpo: {learning_rate: 1.0e-6}}}"])
    err = capsys.readouterr().err
    expected = ("algorithm=dpo: grpo.beta, per_iteration.2.grpo.learning_rate are ignored (the grpo section applies "
                "under algorithm=grpo)")
    assert err.count(expected) == 1 and expected in read_json(run / "plan_warnings.json")[-1]
    loop.plan(None, args + ["algorithm=grpo", "dpo.training.beta=0.2"])
    assert "algorithm=grpo: dpo.training.beta is ignored (the dpo section applies under algorithm=dpo)" in \
        capsys.readouterr().err
    loop.plan(None, args + ["algorithm=grpo", "grpo.beta=0.04"])
    assert "ignored" not in capsys.readouterr().err
    # pairs keys: no pairs under GRPO; what GRPO does anyway (configs/loop.yaml's section) is not named
    loop.plan(None, args + ["algorithm=grpo", "pairs.strategy=max_min", "pairs.truncated=keep"])
    assert "ignored" not in capsys.readouterr().err
    loop.plan(None, args + ["algorithm=grpo", "pairs.truncated=penalize", "per_iteration={2: {pairs: {min_margin: 0.1}}}"])
    assert ("algorithm=grpo: pairs.truncated=penalize, per_iteration.2.pairs.min_margin=0.1 are ignored (no pairs are "
            "built under GRPO: every response of a group counts); GRPO's own rule for cut responses: "
            "grpo.truncated_penalty.") in capsys.readouterr().err
    # plan-check (nothing written) prints the same warnings; --quiet (run_loop.sh --fresh, before its plan) does not
    check = ["plan-check", "configs/loop.yaml", *args, "grpo.beta=0.04"]
    assert loop.main(check) == 0
    assert "algorithm=dpo: grpo.beta is ignored" in capsys.readouterr().err
    assert loop.main(check[:1] + ["--quiet"] + check[1:]) == 0 and "ignored" not in capsys.readouterr().err


def test_grpo_max_length_must_leave_room_for_a_prompt():
    with pytest.raises(ConfigError, match=r"iteration 1: grpo\.max_length=512 \(grpo_config=configs/grpo\.yaml\) is not "
                                          r"above generation\.max_tokens=512.*grpo\.max_length=null"):
        loop.resolve("configs/loop.yaml", ["algorithm=grpo", "generation.max_tokens=512"])
    with pytest.raises(ConfigError, match=r"iteration 2: grpo\.max_length=100 \(per_iteration\.2\.grpo\.max_length\) is not above "
                                          r"generation\.max_tokens=256"):
        loop.resolve("configs/loop.yaml", ["algorithm=grpo", "per_iteration={2: {grpo: {max_length: 100}}}"])
    with pytest.raises(ConfigError, match=r"grpo\.max_length=64 \(the grpo section\)"):
        loop.resolve("configs/loop.yaml", ["algorithm=grpo", "grpo.max_length=64"])
    loop.resolve("configs/loop.yaml", ["algorithm=grpo", "generation.max_tokens=512", "grpo.max_length=null"])
    loop.resolve("configs/loop.yaml", ["generation.max_tokens=512"])  # algorithm=dpo: no grpo stage


def test_plan_warns_when_the_longest_prompt_and_max_tokens_exceed_max_length(tmp_path, policy, capsys):
    prompts = tmp_path / "long.jsonl"
    write_jsonl(prompts, [{"id": "short", "prompt": "hi", "answer": "1"},
                          {"id": "long", "prompt": " ".join(["word"] * 40), "answer": "2"}])
    args = [f"train_prompts={prompts}", f"eval_prompts={prompts}", f"output_root={tmp_path / 'runs'}", "run_name=r",
            f"policy={policy}", "ifeval.when=never", "iterations=1", "num_processes=1", "algorithm=grpo",
            "generation.max_tokens=16"]
    run = loop.plan(None, args + ["grpo.max_length=40"])
    (w,) = [w for w in read_json(run / "plan_warnings.json") if "grpo.max_length" in w]
    assert w.startswith("iteration 1: the longest train prompt ('long') is ") and "> grpo.max_length=40" in w
    assert "1 prompt(s) that fill max_length drop their group" in w and "generation.max_tokens" in w
    assert "WARNING: iteration 1: the longest train prompt" in capsys.readouterr().err
    run = loop.plan(None, args + ["grpo.max_length=1000"])
    assert not [w for w in read_json(run / "plan_warnings.json") if "grpo.max_length" in w]


def test_one_sample_per_prompt_is_refused_in_grpo_terms():
    with pytest.raises(ConfigError) as e:
        loop.resolve(None, SMALL + ["algorithm=grpo", "generation.k=1"])
    assert "generation.k=1, but GRPO needs a group of at least 2 responses per train prompt" in str(e.value)
    assert "pair" not in str(e.value)


def test_metrics_line_of_a_grpo_iteration_shows_the_groups_not_pairs():
    row = {"iteration": 1, "eval_reward_mean": 0.5, "eval_reward_ci95": [0.4, 0.6], "eval_prompts": 4,
           "rollout_reward_mean": 0.25, "grpo": {"groups_used": 9, "groups_skipped": {"all_equal": 23}, "steps": 6}}
    line = loop.metrics_line(row)
    assert "grpo groups used 9/32 (skipped: all_equal 23), 6 steps" in line and "pairs" not in line
    dpo = {**{k: v for k, v in row.items() if k != "grpo"}, "pairs": 12}
    assert "rollout reward 0.2500, pairs 12" in loop.metrics_line(dpo)
    first = {k: v for k, v in dpo.items() if k not in ("pairs", "rollout_reward_mean")}  # iteration 0
    assert loop.metrics_line(first) == "iteration 1: held-out reward 0.5000 (95% CI 0.4000..0.6000, n=4)"


def test_help_lists_the_grpo_section(capsys):
    assert loop.main(["-h"]) == 0
    out = capsys.readouterr().out
    assert "algorithm (default 'dpo'" in out and "grpo.loss_type" in out and "grpo.policy" not in out
    assert "grpo.temperature" not in out and "grpo.max_completion_length" not in out  # set by the loop


# --- the stage, in one process, on a tiny random policy -----------------------------------------

def _record(i: int, responses: list[str], rewards: list, finish=None) -> dict:
    return {"id": str(i), "prompt": [{"role": "user", "content": f"Question {i}: say yes."}], "responses": responses,
            "finish_reasons": finish or ["stop"] * len(responses), "response_tokens": [3] * len(responses),
            "rewards": rewards, "reward_source": "verifier"}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(make_tiny_policy(tmp_path_factory.mktemp("policy") / "p0", seed=0))


def _cfg(tmp_path: Path, policy: str, rewards: Path, **kw) -> GRPOStageConfig:
    base = {"policy": policy, "rewards": str(rewards), "output_dir": str(tmp_path / "model"), "learning_rate": 1e-3,
            "per_device_train_batch_size": 4, "loss_type": "grpo", "max_completion_length": 16}
    return GRPOStageConfig.from_dict({**base, **kw})


def _seq_logp(model_dir: str, tokenizer_dir: str, prompt: list[dict], response: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    p, (r,) = chat_tokens.prompt_response_ids(tok, prompt, [{"role": "assistant", "content": response}])
    batch = grpo_objective.collate([{"prompt_ids": p, "completion_ids": r, "advantage": 0.0}], tok.pad_token_id)
    with torch.no_grad():
        return float(grpo_objective.completion_log_probs(model, batch).sum())


def test_stage_trains_toward_rewarded_responses_and_counts_skipped_groups(tmp_path, policy):
    rows = [_record(i, ["yes yes yes", "no no no", "yes yes yes", "no no no"], [1.0, 0.0, 1.0, 0.0]) for i in range(6)]
    rows += [_record(10, ["a", "b", "c", "d"], [0.5, 0.5, 0.5, 0.5]),  # all equal: skipped
             _record(11, ["a", "b", "c", "d"], [1.0, None, None, None])]  # one scored: skipped
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    cfg = _cfg(tmp_path, policy, tmp_path / "rewards.jsonl", num_iterations=2, beta=0.04)
    stats = run_grpo.main(cfg)
    assert stats.groups_in == 8 and stats.groups_used == 6
    assert stats.groups_skipped == {"all_equal": 1, "fewer_than_2_scored": 1}
    assert stats.completions_used == 24 and stats.steps == 2 * 6  # 24 completions / 4 per step, 2 passes
    assert stats.ratio_first_step_max_dev < 1e-4  # old log-probs recomputed: ratio 1 before any update
    assert stats.kl_last is not None and stats.kl_last > 0 and stats.reference["source"] == "policy"
    assert GRPOStats.read(stats_path(tmp_path / "model")).steps == stats.steps
    out = tmp_path / "model"
    assert list(out.glob("*.safetensors")) and (out / "tokenizer_config.json").is_file()
    prompt = rows[0]["prompt"]
    gap = lambda m: _seq_logp(m, policy, prompt, "yes yes yes") - _seq_logp(m, policy, prompt, "no no no")  # noqa: E731
    assert gap(str(out)) > gap(policy) + 1.0


def test_stage_saves_the_policy_unchanged_when_no_group_has_signal(tmp_path, policy, capsys):
    write_jsonl(tmp_path / "rewards.jsonl", [_record(i, ["a", "b"], [0.0, 0.0]) for i in range(3)])
    stats = run_grpo.main(_cfg(tmp_path, policy, tmp_path / "rewards.jsonl"))
    assert stats.steps == 0 and stats.groups_skipped == {"all_equal": 3}
    out = capsys.readouterr().out
    assert "WARNING: grpo: none of the 3 groups" in out and "saved unchanged" in out and "generation.k" in out
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "model" / "model.safetensors"), load_file(Path(policy) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_truncated_responses_are_penalized_or_masked(tmp_path, policy):
    rows = [_record(0, ["yes", "no", "maybe", "so"], [1.0, 1.0, 0.0, 0.0], finish=["length", "stop", "stop", "stop"])]
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    groups, _ = grpo_data.load_groups(str(tmp_path / "rewards.jsonl"), truncated_penalty=0.5)
    assert groups[0]["rewards"] == [0.5, 1.0, 0.0, 0.0]
    stats = run_grpo.main(_cfg(tmp_path, policy, tmp_path / "rewards.jsonl", mask_truncated_completions=True))
    assert stats.completions_used == 3 and stats.completions_masked == {"truncated": 1}


def test_completions_are_the_sampled_ids_when_the_records_have_them(tmp_path):
    from online_rlhf.testing import make_tiny_tokenizer

    rows = [_record(0, ["yes", "no"], [1.0, 0.0], finish=["stop", "length"]), _record(1, ["a", "b"], [1.0, 0.0])]
    rows[0].update(prompt_token_ids=[5, 6, 7], response_token_ids=[[8, 9, 2], [10, 11, 12, 13]])
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    with open(tmp_path / "rewards.jsonl", "a") as f:
        f.write("\n")  # a blank line: counted for the stats (input_blank_lines)
    groups, read_info = grpo_data.load_groups(str(tmp_path / "rewards.jsonl"))
    assert read_info["in"] == 2 and read_info["blank_lines"] == 1
    adv, usable = grpo_data.group_advantages(torch.tensor([g["rewards"] for g in groups]))
    comps, info = grpo_data.build_completions(groups, adv, usable, make_tiny_tokenizer(), max_length=6,
                                             mask_truncated=False)
    sampled = [c for c in comps if c["group"] == 0]
    assert [c["prompt_ids"] for c in sampled] == [[5, 6, 7]] * 2
    assert [c["completion_ids"] for c in sampled] == [[8, 9, 2], [10, 11, 12]]  # as sampled; max_length cuts
    assert info["cut"] == 1
    assert all(c["prompt_ids"] != [5, 6, 7] for c in comps if c["group"] == 1)  # no ids: the text, tokenized
    rows[0]["response_token_ids"] = [[8, 9, 2]]  # one id list for two responses
    write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl:1: .*response_token_ids"):
        grpo_data.load_groups(str(tmp_path / "bad.jsonl"))


def test_warnings_name_the_reason_a_group_or_tokens_were_left_out(tmp_path):
    """Prompts that fill max_length are not a lack of signal: the advice is max_length, not K; and
    completions cut by max_length are counted and warned about."""
    from online_rlhf.testing import make_tiny_tokenizer

    rows = [_record(i, ["yes", "no"], [1.0, 0.0]) for i in range(2)]
    for r in rows:
        r.update(prompt_token_ids=[5, 6, 7, 8], response_token_ids=[[9, 10, 11, 2], [12, 2]])
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    groups, _ = grpo_data.load_groups(str(tmp_path / "rewards.jsonl"))
    adv, usable = grpo_data.group_advantages(torch.tensor([g["rewards"] for g in groups]))
    tok = make_tiny_tokenizer()
    comps, info = grpo_data.build_completions(groups, adv, usable, tok, max_length=4, mask_truncated=False)
    assert comps == [] and info["skipped"] == {"prompt_too_long": 2}
    (w,) = grpo_data.data_warnings(info, 2, len(comps), 4, "r.jsonl")
    assert "none of the 2 groups of r.jsonl is used" in w and "Raise grpo.max_length (now 4)" in w
    assert "generation.k" not in w and "signal" not in w
    comps, info = grpo_data.build_completions(groups, adv, usable, tok, max_length=6, mask_truncated=False)
    assert len(comps) == 4 and info["cut"] == 2 and info["longest"] == 8
    (w,) = grpo_data.data_warnings(info, 2, len(comps), 6, "r.jsonl")
    assert "2 of 4 completions cut to max_length=6 tokens" in w and "at least 8" in w
    comps, info = grpo_data.build_completions(groups, adv, usable, tok, max_length=None, mask_truncated=False)
    assert grpo_data.data_warnings(info, 2, len(comps), None, "r.jsonl") == []


def test_dry_run_is_one_optimizer_step_at_max_length_and_writes_nothing_else(tmp_path, policy):
    from online_rlhf.dry_run import dry_run_path
    from online_rlhf.loop.memory_check import advice
    from online_rlhf.stats import DryRunStats

    cfg = _cfg(tmp_path, policy, tmp_path / "no_rewards.jsonl", dry_run=True, max_length=24, max_completion_length=16,
               per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.04)
    result = run_grpo.main(cfg)  # the rewards file does not exist: it is not read
    assert isinstance(result, DryRunStats) and result.status == "ok" and result.stage == "grpo"
    assert DryRunStats.read(dry_run_path(tmp_path / "model")) == result
    assert result.shapes == {"completions_per_process": 4, "micro_batch_completions": 2, "sequence_tokens": 24,
                             "prompt_tokens": 8, "completion_tokens": 16}
    assert result.peak_memory_gib > 0 and result.seconds_per_step > 0
    assert "1 optimizer step: 2 micro-batch(es) x 2 completions x 24 tokens" in result.step
    assert not (tmp_path / "model").exists() and not stats_path(tmp_path / "model").exists()
    tips = " ".join(advice("grpo", result.settings, "cpu"))
    assert "grpo.per_device_train_batch_size (now 2)" in tips and "grpo.max_length (now 24)" in tips
    assert "grpo.beta (now 0.04)" in tips
    with pytest.raises(ConfigError, match="dry_run needs max_length"):
        run_grpo.main(_cfg(tmp_path, policy, tmp_path / "no_rewards.jsonl", dry_run=True))


def test_loop_dry_run_plans_the_grpo_stage(tmp_path):
    args = _plan_args(tmp_path) + ["algorithm=grpo"]
    with pytest.raises(ConfigError, match=r"dry_run=true needs grpo\.max_length"):
        loop.resolve(None, args + ["dry_run=true", "grpo.max_length=null"])
    run = loop.plan(None, args + ["dry_run=true", "grpo.max_length=512"])
    assert (1, "grpo") in loop.DRY_RUN_STAGES and "grpo" in read_json(run / "iter_1" / "plan.json")
    with pytest.raises(ConfigError, match=r"grpo\.dry_run: cannot be set here; set dry_run=true at the top level"):
        loop.resolve(None, args + ["grpo.dry_run=true"])


def test_a_bad_rewards_record_names_file_and_line(tmp_path, policy):
    write_jsonl(tmp_path / "rewards.jsonl", [_record(0, ["a", "b"], [1.0, 0.0]), {"id": "x", "prompt": []}])
    with pytest.raises(Exception, match=r"rewards\.jsonl:2"):
        run_grpo.main(_cfg(tmp_path, policy, tmp_path / "rewards.jsonl"))


@pytest.mark.slow
def test_two_ranks_over_gloo_train_like_one(tmp_path, policy):
    """The stage under ``accelerate launch`` with 2 CPU processes (the loop's command): same steps,
    old log-probs shared between the ranks, and the same direction of learning."""
    from online_rlhf.stage_launch import launch_command
    from online_rlhf.stage_table import STAGES

    rows = [_record(i, ["yes yes yes", "no no no", "yes yes yes", "no no no"], [1.0, 0.0, 1.0, 0.0]) for i in range(5)]
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    cfg = _cfg(tmp_path, policy, tmp_path / "rewards.jsonl", num_processes=2, per_device_train_batch_size=2,
               loss_type="dapo", beta=0.04)
    path = tmp_path / "grpo.yaml"
    path.write_text(cfg.to_yaml())
    argv, env = launch_command(STAGES["grpo"], str(path), cfg.model_dump(), root=ROOT)
    p = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    stats = GRPOStats.read(stats_path(tmp_path / "model"))
    assert stats.num_processes == 2 and stats.completions_used == 20 and stats.steps == 5  # 20 / (2 x 2)
    assert stats.ratio_first_step_max_dev < 1e-4
    prompt = rows[0]["prompt"]
    gap = lambda m: _seq_logp(m, policy, prompt, "yes yes yes") - _seq_logp(m, policy, prompt, "no no no")  # noqa: E731
    assert gap(str(tmp_path / "model")) > gap(policy) + 1.0


@pytest.mark.slow
def test_zero2_two_processes_match_plain_one(tmp_path, policy):
    """DeepSpeed ZeRO-2 on CPU (the GPU profile's code path) with 2 ranks trains the same numbers as
    one plain process: loss_type=dapo normalizes by the whole step's tokens, so the split does not
    change the gradient."""
    import socket

    rows = [_record(i, ["yes yes yes", "no no", "yes", "no no no no"], [1.0, 0.0, 0.7, 0.2]) for i in range(4)]
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    losses = {}
    for profile, n in (("cpu", 1), ("zero2_cpu", 2)):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = tmp_path / f"{profile}_{n}"
        cmd = [str(ROOT / ".venv-train" / "bin" / "accelerate"), "launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / f"{profile}.yaml"), "--num_processes", str(n),
               "--main_process_port", str(port), str(ROOT / "grpo_iteration" / "run_grpo.py"), f"policy={policy}",
               f"rewards={tmp_path / 'rewards.jsonl'}", f"output_dir={out}", f"per_device_train_batch_size={8 // n}",
               "loss_type=dapo", "learning_rate=1e-3", "num_iterations=2", "shuffle_dataset=false"]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        stats = GRPOStats.read(stats_path(out))
        assert stats.num_processes == n and stats.deepspeed_zero_stage == (2 if profile == "zero2_cpu" else None)
        losses[profile] = [h["loss"] for h in stats.history]
    assert len(losses["cpu"]) == 4
    assert losses["zero2_cpu"] == pytest.approx(losses["cpu"], rel=1e-3, abs=1e-5), losses


# --- the loop end to end (vLLM generation, accelerate-launched GRPO) ----------------------------

def _constraint_prompts(path: Path, n: int, prefix: str) -> Path:
    # Random text meets a word limit sometimes: partial credit differs between the K responses.
    write_jsonl(path, [{"id": f"{prefix}{j}", "prompt": f"Say something short about topic {j}.",
                        "instruction_id_list": ["length_constraints:number_words"],
                        "kwargs": [{"relation": "less than", "num_words": 6}]} for j in range(n)])
    return path


def _run_loop(args, timeout=1500):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "run_loop.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          errors="replace", timeout=timeout)


E2E = ["algorithm=grpo", "prompts_per_iteration=16", "eval_limit=4", "generation.k=8", "generation.max_tokens=16",
       "generation.max_model_len=512", "grpo.learning_rate=2.0e-3", "grpo.num_iterations=2",
       "grpo.per_device_train_batch_size=16", "grpo.loss_type=grpo", "grpo.truncated_penalty=0.0", "num_processes=1"]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    tiny = make_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=3)
    out, data = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("prompts")
    args = ["configs/loop.yaml", f"policy={tiny}", f"output_root={out}", "run_name=grpo",
            f"train_prompts={_constraint_prompts(data / 'train.jsonl', 32, 't')}",
            f"eval_prompts={_constraint_prompts(data / 'eval.jsonl', 4, 'e')}", *E2E]
    p = _run_loop(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out / "grpo", args


@pytest.mark.slow
def test_two_grpo_iterations_raise_the_rollout_reward(grpo_run):
    run_dir, _ = grpo_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["grpo"]["steps"] > 0 and "pairs" not in rows[1]
    # iteration 2's rollouts come from iteration 1's GRPO policy, iteration 1's from the start
    assert rows[2]["rollout_reward_mean"] > rows[1]["rollout_reward_mean"]
    for i in (1, 2):
        assert read_json(run_dir / f"iter_{i}" / "grpo.done")["hash"]
        assert not (run_dir / f"iter_{i}" / "pairs.jsonl").exists()
    assert "GRPO per iteration" in (run_dir / "report.md").read_text()


@pytest.mark.slow
def test_kill_during_grpo_then_resume_matches_uninterrupted(grpo_run, tmp_path):
    """As the DPO kill/resume test: back to the state before iteration 1's GRPO, SIGKILL during
    GRPO, rerun: it resumes at GRPO and ends with the uninterrupted run's iteration-1 model."""
    import shutil

    run_dir, args = grpo_run
    killed = tmp_path / "grpo"
    shutil.copytree(run_dir, killed)
    it1 = killed / "iter_1"
    for name in ("grpo.done", "eval_generate.done", "eval_rewards.done", "model", "model.stats.json",
                 "eval_generated.jsonl", "eval.jsonl", "metrics.jsonl", "report.md", "report.png"):
        target = it1 / name if (it1 / name).exists() else killed / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    shutil.rmtree(killed / "iter_2")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    (killed / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    args = [a if not a.startswith("output_root=") else f"output_root={tmp_path}" for a in args] + ["iterations=1"]
    kill_loop_during(ROOT, args, it1 / "logs" / "grpo.log")  # iteration 1's GRPO under way
    assert not (it1 / "grpo.done").exists() and not (it1 / "model" / "config.json").exists()
    p = _run_loop(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    for stage in ("generate", "rewards"):
        assert f"iteration 1/1 · {stage}: done earlier, skipped" in p.stdout
    assert "iteration 1/1 · grpo (train env)" in p.stdout
    from safetensors.torch import load_file

    ours, ref = load_file(it1 / "model" / "model.safetensors"), load_file(run_dir / "iter_1" / "model" / "model.safetensors")
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    got = read_jsonl(killed / "metrics.jsonl")[1]
    assert got["grpo"]["loss_last"] == rows[1]["grpo"]["loss_last"]
    assert got["eval_reward_mean"] == rows[1]["eval_reward_mean"]


def test_bf16_cpu_runs_steps_and_reference_under_autocast(tmp_path, policy, monkeypatch, request):
    """On a CPU with native bf16 (forced here) the stage trains under bf16 autocast, and the
    reference pass runs as the prepared policy does: a reference equal to the policy then gives a KL
    of 0 and a ratio of 1 at the first step (an fp32 reference pass against bf16 policy log-probs did not)."""
    import shutil

    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ONLINE_RLHF_CPU_BF16", "1")
    AcceleratorState._reset_state(True)  # a stage is a process of its own; here earlier tests made the state
    request.addfinalizer(lambda: AcceleratorState._reset_state(True))
    ref = tmp_path / "ref"
    shutil.copytree(policy, ref)  # the same weights from another directory: loaded as a separate reference
    rows = [_record(i, ["yes yes yes", "no no no", "yes yes yes", "no no no"], [1.0, 0.0, 1.0, 0.0]) for i in range(2)]
    write_jsonl(tmp_path / "rewards.jsonl", rows)
    stats = run_grpo.main(_cfg(tmp_path, policy, tmp_path / "rewards.jsonl", beta=0.04, reference=str(ref)))
    assert stats.hardware["dtype"] == "float32 + bf16 autocast" and stats.reference["source"] != "policy"
    assert stats.ratio_first_step_max_dev < 1e-4
    assert abs(stats.history[0]["kl"]) < 5e-8  # 0.0 here; 5e-7 with an fp32 reference pass
