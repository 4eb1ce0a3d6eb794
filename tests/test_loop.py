"""The loop's bookkeeping: config resolution (dry validation), plan, freshness markers, metrics, report."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from online_rlhf import loop
from online_rlhf.loop import freshness
from online_rlhf.config import ConfigError
from online_rlhf.jsonl import read_json, read_jsonl, write_json, write_jsonl
from online_rlhf.stats import DPOStats, GenerateStats, IFEvalStats, KLStats, PairsStats, RewardStats, stats_path
from online_rlhf.testing import example_stats

ROOT = Path(__file__).resolve().parent.parent


def _prompts(path: Path, n: int) -> Path:
    # "answer": the field reward.source=verifier (the default) scores by; the plan checks it is there
    write_jsonl(path, [{"id": f"p{i}", "prompt": f"question {i}", "answer": str(i)} for i in range(n)])
    return path


@pytest.fixture
def small_cfg(tmp_path):
    train = _prompts(tmp_path / "train.jsonl", 10)
    evals = _prompts(tmp_path / "eval.jsonl", 4)
    policy = tmp_path / "models" / "start"
    policy.mkdir(parents=True)
    return [f"train_prompts={train}", f"eval_prompts={evals}", f"output_root={tmp_path / 'runs'}",
            "run_name=t", f"policy={policy}", "iterations=2"]


def _with(cfg_args: list[str], *overrides: str) -> list[str]:
    """``cfg_args`` with ``overrides`` replacing the overrides of the same keys (a key may be given
    once per command line)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [a for a in cfg_args if a.split("=", 1)[0] not in keys] + list(overrides)


def _policy(cfg_args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in cfg_args if a.startswith("policy="))


def test_a_seed_numpy_refuses_is_refused_by_the_plan(small_cfg):
    for bad in ("seed=-1", f"seed={2**31}", "generation.seed=-5"):
        with pytest.raises(ConfigError, match=r"seed"):
            loop.resolve(None, _with(small_cfg, bad))


def test_missing_local_policy_is_refused_at_start(small_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"policy=.*no_such_ckpt: no such directory"):
        loop.resolve(None, _with(small_cfg, f"policy={tmp_path / 'no_such_ckpt'}"))


def test_a_relative_local_policy_that_does_not_exist_is_refused_naming_the_path(small_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # small_cfg made tmp_path/models/start
    with pytest.raises(ConfigError, match=rf"policy=\./no_such_dir: no such directory \(looked at {tmp_path}/no_such_dir; "
                                          r"run_loop\.sh takes a relative path .*Fix the path"):
        loop.resolve(None, _with(small_cfg, "policy=./no_such_dir"))
    # owner/name is a Hub id, unless 'owner' is a folder here: then it means a local path
    with pytest.raises(ConfigError, match=rf"policy=models/mine: no such directory \(looked at {tmp_path}/models/mine; "
                                          r".*'models' is a folder in .*not a Hub id"):
        loop.resolve(None, _with(small_cfg, "policy=models/mine"))
    assert loop.resolve(None, _with(small_cfg, "policy=models/start")).policy == "models/start"
    assert loop.resolve(None, _with(small_cfg, "policy=some-org/some-model")).policy == "some-org/some-model"


def test_a_local_reward_model_that_does_not_exist_is_refused_at_start(small_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rm = ["reward.source=reward_model"]
    with pytest.raises(ConfigError, match=rf"reward\.reward_model=\./no_rm: no such directory \(looked at {tmp_path}/no_rm;"):
        loop.resolve(None, small_cfg + rm + ["reward.reward_model=./no_rm"])
    with pytest.raises(ConfigError, match=r"reward\.reward_model \(iteration 2\)=\S*gone: no such directory"):
        loop.resolve(None, small_cfg + rm + ["reward.reward_model=org/rm",
                                             f"per_iteration={{2: {{reward: {{reward_model: {tmp_path / 'gone'}}}}}}}"])
    assert loop.resolve(None, small_cfg + rm + ["reward.reward_model=org/rm"]).reward.reward_model == "org/rm"


def test_prompts_without_the_verifiers_fields_are_refused_by_the_plan(small_cfg, tmp_path):
    bare = tmp_path / "bare.jsonl"
    write_jsonl(bare, [{"id": "q1", "prompt": "Write a poem."}, {"id": "q2", "prompt": "Add 2 and 2."}])
    fix = (r"Add to every prompt instruction_id_list .* or answer .*reward\.source=reward_model "
           r"reward\.reward_model=<folder or Hub id>.*reward\.source=remote reward\.url=.*reward\.judge_model=")
    with pytest.raises(ConfigError, match=rf"train_prompts {bare} \(iteration 1's prompts\): 2 of 2 prompts lack the "
                                          rf"fields reward\.source=verifier \(reward\.verifier=auto\) scores by; the "
                                          rf"first, id 'q1', needs instruction_id_list \+ kwargs .* or answer.*{fix}"):
        loop.plan(None, _with(small_cfg, f"train_prompts={bare}"))
    with pytest.raises(ConfigError, match=rf"eval_prompts {bare}: 2 of 2 prompts .*id 'q1'"):
        loop.plan(None, _with(small_cfg, f"eval_prompts={bare}"))
    # a named verifier needs its own field: the answers of small_cfg's prompts are no instruction ids
    with pytest.raises(ConfigError, match=r"reward\.verifier=ifeval.*id 'p0', needs instruction_id_list \(it is missing"):
        loop.plan(None, small_cfg + ["reward.verifier=ifeval"])
    ifeval = tmp_path / "ifeval_like.jsonl"
    write_jsonl(ifeval, [{"id": "i1", "prompt": "Answer in lowercase.", "instruction_id_list": ["change_case:english_lowercase"],
                          "kwargs": [{}, {}]}])
    with pytest.raises(ConfigError, match=r"id 'i1', needs kwargs as one object \(or null\) per instruction id \(1 of them\)"):
        loop.plan(None, _with(small_cfg, f"train_prompts={ifeval}"))
    # the fields are there, but the id is no checker's, or a kwarg is not its checker's: refused before any decode
    write_jsonl(ifeval, [{"id": "i1", "prompt": "Answer in lowercase.", "instruction_id_list": ["change_case:english_lowercase"],
                          "kwargs": [{}]},
                         {"id": "i2", "prompt": "Write a poem.", "instruction_id_list": ["change_case:english_lowercse"],
                          "kwargs": [{}]}])
    with pytest.raises(ConfigError, match=r"1 of 2 prompts name a constraint the checkers cannot score; the first, id "
                                          r"'i2', has instruction id 'change_case:english_lowercse'.*did you mean "
                                          r"'change_case:english_lowercase'"):
        loop.plan(None, _with(small_cfg, f"train_prompts={ifeval}"))
    write_jsonl(ifeval, [{"id": "i3", "prompt": "Write a poem.", "instruction_id_list": ["length_constraints:number_words"],
                          "kwargs": [{"num_word": 50, "relation": "at least"}]}])
    with pytest.raises(ConfigError, match=r"id 'i3', has kwargs num_word for 'length_constraints:number_words', which its "
                                          r"checker does not take \(it takes num_words, relation\)"):
        loop.plan(None, _with(small_cfg, f"train_prompts={ifeval}"))
    # kwargs the checker takes, with values it cannot build or check with: every response would be checker_error
    for kw, why in (({"num_words": 50, "relation": "exactly"}, r"fails to build \(ValueError: The supported relation"),
                    ({"num_words": "50", "relation": "at least"}, r"fails to build \(TypeError")):
        write_jsonl(ifeval, [{"id": "i4", "prompt": "Write a poem.", "instruction_id_list": ["length_constraints:number_words"],
                              "kwargs": [kw]}])
        with pytest.raises(ConfigError, match=r"id 'i4', has kwargs .* for 'length_constraints:number_words', with which "
                                              r"its checker " + why):
            loop.plan(None, _with(small_cfg, f"train_prompts={ifeval}"))
    rm = tmp_path / "rm"
    rm.mkdir()  # another reward source scores any prompt
    loop.plan(None, _with(small_cfg, f"train_prompts={bare}", f"eval_prompts={bare}") +
              ["reward.source=reward_model", f"reward.reward_model={rm}"])


def test_default_config_resolves():
    cfg = loop.resolve(str(ROOT / "configs/loop.yaml"), [])
    assert cfg.iterations == 2 and cfg.reward.source == "verifier"


def test_rlhflow_gpu_config_validates_dry():
    """Everything resolved and checked without loading a model, DPO keys against TRL's DPOConfig."""
    trl = pytest.importorskip("trl")
    cfg = loop.resolve(str(ROOT / "configs/rlhflow_llama3_8b.yaml"), [])
    assert (cfg.iterations, cfg.launch_profile, cfg.generation.k) == (3, "zero2", 8)
    assert (ROOT / "configs/accelerate" / f"{cfg.launch_profile}.yaml").is_file()
    dpo_fields = {f.name for f in dataclasses.fields(trl.DPOConfig)}
    assert set(cfg.dpo.training) <= dpo_fields, set(cfg.dpo.training) - dpo_fields
    it3 = loop.iteration_config(cfg, 3)
    assert it3.train_prompts.endswith("iter3-20K") and cfg.train_prompts.endswith("iter1-20K")
    assert loop.stage_dict(cfg, Path("/r"), 1, "eval_generate")["prompt_field"] == "instruction"
    assert loop.resolve(str(ROOT / "configs/rlhflow_llama3_8b.yaml"), []).prompt_field == "context_messages"
    d = loop.stage_dict(cfg, Path("/r"), 3, "dpo")
    assert d["reference"] == "RLHFlow/LLaMA3-SFT" and d["policy"] == "/r/iter_2/model"
    _dpo_library_check(cfg)


def test_one_gpu_lora_config_validates_dry():
    """The 8B-on-one-GPU LoRA recipe: resolved dry, every update an adapter on the SFT policy."""
    trl = pytest.importorskip("trl")
    cfg = loop.resolve(str(ROOT / "configs/lora_llama3_8b_1gpu.yaml"), [])
    assert (cfg.num_processes, cfg.generation_shards, cfg.lora.r) == (1, 1, 32)
    assert set(cfg.dpo.training) <= {f.name for f in dataclasses.fields(trl.DPOConfig)}
    d = loop.stage_dict(cfg, Path("/r"), 3, "dpo")
    assert d["policy"] == d["reference"] == "RLHFlow/LLaMA3-SFT" and d["adapter"] == "/r/iter_2/model"
    assert d["save_adapter"] and d["lora"]["lora_alpha"] == 64
    g = loop.stage_dict(cfg, Path("/r"), 3, "generate")
    assert g["model"] == "RLHFlow/LLaMA3-SFT" and g["adapter"] == "/r/iter_2/model"
    _dpo_library_check(cfg)


def _dpo_library_check(cfg) -> None:
    """The plan's check of each iteration's trl.DPOConfig (the values TRL refuses together)."""
    from online_rlhf.dpo_config import check_dpo_config
    from online_rlhf.stage_configs import DPOStageConfig

    for i in range(1, cfg.iterations + 1):
        d = DPOStageConfig.from_dict(loop.stage_dict(cfg, Path("/r"), i, "dpo")).model_dump(mode="json")
        check_dpo_config(d, i, [])


def test_default_dpo_training_keys_are_trl_fields():
    trl = pytest.importorskip("trl")
    cfg = loop.resolve(str(ROOT / "configs/loop.yaml"), [])
    training = loop.stage_dict(cfg, Path("/r"), 1, "dpo")["training"]  # configs/dpo.yaml + the loop's seed
    assert training["learning_rate"] == 2.0e-5 and training["seed"] == cfg.seed
    assert set(training) <= {f.name for f in dataclasses.fields(trl.DPOConfig)}


def test_bad_key_in_stage_section_is_named_as_written(small_cfg):
    with pytest.raises(ConfigError) as e:
        loop.resolve(None, small_cfg + ["generation.temprature=0.5"])
    assert "- generation.temprature: unknown key. Did you mean 'temperature'?" in str(e.value)
    assert "eval" not in str(e.value).split("problem(s)")[1]  # not blamed on the evaluation stage


@pytest.mark.parametrize("override,expected", [
    ("per_iteration={2: {generaton: {k: 2}}}", "- per_iteration.2.generaton: unknown key. Did you mean 'generation'?"),
    ("per_iteration={2: {generation: {temprature: 0.5}}}",
     "- per_iteration.2.generation.temprature: unknown key. Did you mean 'temperature'?"),
    ("per_iteration={2: {iterations: 3}}", "- per_iteration.2.iterations: cannot be set per iteration"),
    ("evaluation.max_tokns=8", "- evaluation.max_tokns: unknown key. Did you mean 'max_tokens'?"),
    ("reward.sorce=remote", "- reward.sorce: unknown key. Did you mean 'source'?"),
    ("pairs.stratgy=random", "- pairs.stratgy: unknown key. Did you mean 'strategy'?"),
    ("dpo.max_prompt_lenght=8", "- dpo.max_prompt_lenght: unknown key. Did you mean 'max_prompt_length'?"),
    ("generation.max_tokens=abc", "- generation.max_tokens: Input should be a valid integer"),
    ("generation.prompts=x.jsonl", "- generation.prompts: cannot be set here; set train_prompts"),
    ("evaluation.limit=3", "- evaluation.limit: cannot be set here; set eval_limit"),
    ("generation.num_shards=2", "- generation.num_shards: cannot be set here; set generation_shards"),
    ("dpo.reference=/x", "- dpo.reference: cannot be set here; set ref_model"),
    ("reward.output=/x.jsonl", "- reward.output: cannot be set here"),
])
def test_every_section_key_is_checked_at_plan_time_and_named_by_its_path(small_cfg, override, expected):
    with pytest.raises(ConfigError) as e:
        loop.resolve(None, small_cfg + [override])
    assert expected in str(e.value)


def test_all_key_problems_are_listed_at_once(small_cfg):
    with pytest.raises(ConfigError, match=r"2 problem\(s\)[\s\S]*generation\.kk[\s\S]*pairs\.seedd"):
        loop.resolve(None, small_cfg + ["generation.kk=2", "pairs.seedd=1"])


def test_top_level_and_section_problems_come_in_one_message(small_cfg):
    # a top-level typo or bad value used to show only on the next run, after the section ones were fixed
    pytest.importorskip("trl")
    with pytest.raises(ConfigError) as e:
        loop.resolve(None, small_cfg + ["itrations=3", "eval_limit=abc", "generation.kk=2", "dpo.training.betta=0.1",
                                        "dpo.training.lerning_rate=1"])
    msg = str(e.value)
    assert "5 problem(s) in the config:" in msg
    for line in ("- itrations: unknown key. Did you mean 'iterations'?", "- eval_limit: Input should be a valid integer",
                 "- generation.kk: unknown key", "- dpo.training.betta: unknown trl.DPOConfig key",
                 "- dpo.training.lerning_rate: unknown trl.DPOConfig key"):
        assert line in msg
    problems = msg.split("problem(s) in the config:")[1]
    assert problems.count("generation.kk") == 1  # LoopConfig's own error for the section is not said twice


def test_a_stage_recipe_given_as_the_loop_config_is_named_as_such():
    # configs/grpo.yaml is the GRPO stage's recipe: its keys are unknown to the loop, and the message says what
    # the file probably is and where it goes, not only eleven "unknown key" lines
    with pytest.raises(ConfigError) as e:
        loop.resolve("configs/grpo.yaml", ["algorithm=grpo"])
    assert "problem(s) in the config" in str(e.value) and "is it a stage's config?" in str(e.value)
    assert "grpo_config=<file> with algorithm=grpo" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a typo or two in a loop config: no such guess
        loop.resolve("configs/loop.yaml", ["itrations=3"])
    assert "stage's config" not in str(e.value)


def test_lora_typo_fails_at_plan_time(small_cfg):
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=r"dpo\.lora\.lora_alph: unknown peft\.LoraConfig key .*'lora_alpha'"):
        loop.resolve(None, small_cfg + ["dpo.lora={r: 4, lora_alph: 8}"])
    with pytest.raises(ConfigError, match=r"per_iteration\.2\.dpo\.lora\.rank: unknown peft\.LoraConfig key"):
        loop.resolve(None, small_cfg + ["per_iteration={2: {dpo: {lora: {rank: 4}}}}"])
    with pytest.raises(ConfigError, match=r"dpo\.lora=\{'r': 4, 'use_dora': True, 'lora_bias': True\}: peft\.LoraConfig refused the values: .*Change or drop the key"):
        loop.resolve(None, small_cfg + ["dpo.lora={r: 4, use_dora: true, lora_bias: true}"])
    loop.resolve(None, small_cfg + ["dpo.lora={r: 4, lora_alpha: 8, target_modules: all-linear}"])


def test_lora_values_fail_at_plan_time(small_cfg):
    """A LoRA value of the wrong type or range (which peft.LoraConfig accepts) is refused by the plan."""
    for item, pat in [("dpo.lora.r=abc", r"dpo\.lora\.r='abc': expected a positive integer.*dpo\.lora\.r=16"),
                      ("dpo.lora.r=-4", r"dpo\.lora\.r=-4: expected a positive integer"),
                      ("dpo.lora={r: 4, lora_dropout: 1.5}", r"dpo\.lora\.lora_dropout=1\.5: expected a number in"),
                      ("dpo.lora={r: 4, bias: some}", r"dpo\.lora\.bias='some': expected one of")]:
        with pytest.raises(ConfigError, match=pat):
            loop.resolve(None, small_cfg + [item])


def test_sft_axolotl_key_typo_fails_at_plan_time(small_cfg, tmp_path):
    pytest.importorskip("axolotl")
    with pytest.raises(ConfigError, match=r"'sft\.learning_rat' \(Did you mean 'learning_rate'\?\)"):
        loop.resolve(None, small_cfg + ["sft.learning_rat=1.0e-5"])  # checked even while sft is off
    with pytest.raises(ConfigError, match=r"in the loop's sft section \(it takes config, enabled and Axolotl"):
        loop.resolve(None, small_cfg + ["sft.foo=1"])  # the message says what the section takes
    with pytest.raises(ConfigError, match=r"sft\.base_model: cannot be set here; set policy"):
        loop.resolve(None, small_cfg + ["sft.base_model=/x"])
    stage_file = tmp_path / "sft_stage.yaml"
    stage_file.write_text("micro_batch_sise: 2\n")
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    with pytest.raises(ConfigError, match=rf"'{stage_file}: micro_batch_sise' \(Did you mean 'micro_batch_size'\?\)"):
        loop.resolve(None, small_cfg + ["sft.enabled=true", f"sft.config={stage_file}", f"sft.dataset={data}"])


def test_per_iteration_bad_iteration_is_refused(small_cfg):
    with pytest.raises(ConfigError, match="per_iteration has iteration 5"):
        loop.resolve(None, small_cfg + ["per_iteration={5: {pairs: {min_margin: 0.1}}}"])


def test_per_iteration_override_reaches_only_that_iteration(small_cfg):
    cfg = loop.resolve(None, small_cfg + ["dpo.training.beta=0.1", "per_iteration={2: {dpo: {training: {beta: 0.05}}}}"])
    b1 = loop.stage_dict(cfg, Path("/r"), 1, "dpo")["training"]["beta"]
    b2 = loop.stage_dict(cfg, Path("/r"), 2, "dpo")["training"]["beta"]
    assert (b1, b2) == (0.1, 0.05)


def test_policy_chain_and_reference_choice(small_cfg):
    cfg = loop.resolve(None, small_cfg)
    assert loop.stage_dict(cfg, Path("/r"), 1, "generate")["model"] == _policy(small_cfg)
    assert loop.stage_dict(cfg, Path("/r"), 2, "generate")["model"] == "/r/iter_1/model"
    assert loop.stage_dict(cfg, Path("/r"), 0, "eval_generate")["model"] == _policy(small_cfg)
    assert loop.stage_dict(cfg, Path("/r"), 2, "eval_generate")["model"] == "/r/iter_2/model"
    assert loop.stage_dict(cfg, Path("/r"), 2, "dpo")["reference"] == _policy(small_cfg)
    prev = loop.resolve(None, small_cfg + ["ref_model=previous"])
    assert loop.stage_dict(prev, Path("/r"), 2, "dpo")["reference"] is None  # = the policy being trained


def test_plan_writes_configs_and_fresh_prompt_slices(small_cfg, capsys):
    run_dir = loop.plan(None, small_cfg + ["prompts_per_iteration=4"])
    out = capsys.readouterr().out
    assert f"RUN_DIR={run_dir}" in out and "ITERATIONS=2" in out
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["iterations"] == 2
    ifeval = ("ifeval_generate", "ifeval_score")
    for i in (1, 2):
        plan = read_json(run_dir / f"iter_{i}" / "plan.json")
        # sft is off; algorithm dpo (no grpo); IFEval runs at iteration 0 and the last (ifeval.when=ends)
        assert list(plan) == [name for name in loop.STAGES
                              if name not in ("sft", "grpo") and (i == 2 or name not in ifeval)]
        assert Path(plan["dpo"]["config"]).is_file()
    ids1 = [r["id"] for r in read_jsonl(run_dir / "iter_1" / "prompts.jsonl")]
    ids2 = [r["id"] for r in read_jsonl(run_dir / "iter_2" / "prompts.jsonl")]
    assert ids1 == ["p0", "p1", "p2", "p3"] and ids2 == ["p4", "p5", "p6", "p7"]
    assert list(read_json(run_dir / "iter_0" / "plan.json")) == ["eval_generate", "eval_rewards", *ifeval]


def test_a_missing_ifeval_prompt_file_is_refused_by_the_plan(small_cfg, tmp_path):
    missing = tmp_path / "no_ifeval.jsonl"
    with pytest.raises(ConfigError, match=rf"ifeval\.prompts={missing}: no such file .*scripts/prepare_default\.py"
                                          r".*point ifeval\.prompts at a JSONL file.*ifeval\.when=never"):
        loop.plan(None, small_cfg + [f"ifeval.prompts={missing}"])
    assert not (tmp_path / "runs" / "t" / "config.yaml").exists()  # refused before anything is written
    loop.plan(None, small_cfg + [f"ifeval.prompts={missing}", "ifeval.when=never"])  # no IFEval: not needed


def test_done_marker_goes_stale_when_config_or_input_changes(small_cfg):
    run_dir = loop.plan(None, small_cfg)
    it = run_dir / "iter_1"
    write_jsonl(it / "generated.jsonl", [{"id": "p0"}])
    write_jsonl(it / "rewards.jsonl", [{"id": "p0"}])
    example_stats(RewardStats).write(stats_path(it / "rewards.jsonl"))
    assert not loop.check(run_dir, 1, "rewards")
    loop.mark(run_dir, 1, "rewards", 1.0)
    assert loop.check(run_dir, 1, "rewards")
    write_jsonl(it / "generated.jsonl", [{"id": "p0", "changed": True}])  # input re-made
    assert not loop.check(run_dir, 1, "rewards")
    loop.mark(run_dir, 1, "rewards", 1.0)
    loop.plan(None, small_cfg + ["reward.ifeval_mode=strict"])  # config changed
    assert not loop.check(run_dir, 1, "rewards")
    loop.plan(None, small_cfg)
    assert loop.check(run_dir, 1, "rewards")
    (it / "rewards.jsonl").unlink()  # output gone
    assert not loop.check(run_dir, 1, "rewards")


def _stage_yaml(run_dir: Path, i: int, stage: str) -> tuple[dict, str]:
    text = (run_dir / f"iter_{i}" / "configs" / f"{stage}.yaml").read_text()
    return yaml.safe_load(text), text


def test_launch_settings_are_in_the_stage_yaml_and_rerun_what_they_affect(small_cfg):
    """num_processes and generation_shards live in the stage configs and their hashes: changing
    one makes exactly the stages it affects stale (issue: a changed process count skipped DPO)."""
    run_dir = loop.plan(None, small_cfg + ["num_processes=1"])
    assert _stage_yaml(run_dir, 1, "dpo")[0]["num_processes"] == 1
    assert _stage_yaml(run_dir, 1, "generate")[0]["num_shards"] == 1
    assert _stage_yaml(run_dir, 1, "rewards")[0]["num_processes"] == 1  # a verifier: one process
    it = run_dir / "iter_1"
    for name, cls in (("generated.jsonl", GenerateStats), ("rewards.jsonl", RewardStats), ("pairs.jsonl", PairsStats),
                      ("eval_generated.jsonl", GenerateStats), ("eval.jsonl", RewardStats), ("model", DPOStats)):
        if name != "model":
            write_jsonl(it / name, [{"id": "p0"}])
        example_stats(cls).write(stats_path(it / name))
    for name in ("prompts.jsonl",):
        assert (it / name).is_file()
    (it / "model").mkdir()
    (it / "model" / "config.json").write_text("{}")
    (it / "model" / "model.safetensors").write_text("x")
    stages = ["generate", "rewards", "pairs", "dpo", "eval_generate", "eval_rewards"]
    for stage in stages:
        loop.mark(run_dir, 1, stage, 1.0)
    assert all(loop.check(run_dir, 1, s) for s in stages)

    loop.plan(None, small_cfg + ["num_processes=2"])
    assert _stage_yaml(run_dir, 1, "dpo")[0]["num_processes"] == 2
    assert [s for s in stages if not loop.check(run_dir, 1, s)] == ["dpo"]
    loop.plan(None, small_cfg + ["num_processes=2", "generation_shards=2"])
    assert _stage_yaml(run_dir, 1, "eval_generate")[0]["num_shards"] == 2
    assert [s for s in stages if not loop.check(run_dir, 1, s)] == ["generate", "dpo", "eval_generate"]
    loop.plan(None, small_cfg + ["num_processes=1"])  # back to what ran: fresh again
    assert all(loop.check(run_dir, 1, s) for s in stages)
    # a stage whose stats file lost a key runs again (metrics would refuse it later)
    broken = read_json(it / "pairs.jsonl.stats.json")
    del broken["pairs_out"]
    write_json(it / "pairs.jsonl.stats.json", broken)
    assert [s for s in stages if not loop.check(run_dir, 1, s)] == ["pairs"]


def test_stage_yaml_says_how_to_run_it_and_where_each_value_came_from(small_cfg):
    run_dir = loop.plan("configs/loop.yaml", small_cfg + [
        "num_processes=2", "dpo.training.beta=0.05", "per_iteration={2: {dpo: {training: {beta: 0.2}}}}"])
    d, text = _stage_yaml(run_dir, 1, "dpo")
    assert d["training"]["beta"] == 0.05 and d["num_processes"] == 2 and d["launch_profile"] == "cpu"
    cfg_path = run_dir / "iter_1" / "configs" / "dpo.yaml"
    assert (f"#   ACCELERATE_USE_CPU=true .venv-train/bin/accelerate launch --multi_gpu --num_processes 2 "
            f"dpo_iteration/run_dpo.py --config {cfg_path}\n") in text
    assert "#   training.beta: 0.05  <- command line: dpo.training.beta=0.05" in text
    assert "#   training.learning_rate: 2e-05  <- configs/dpo.yaml" in text
    assert "#   num_processes: 2  <- loop key num_processes (command line: num_processes=2)" in text
    assert "#   training.seed: 42  <- loop key seed (configs/loop.yaml: seed)" in text
    assert "#   training.beta: 0.2  <- command line: per_iteration=" in _stage_yaml(run_dir, 2, "dpo")[1]
    _, gen = _stage_yaml(run_dir, 1, "generate")
    assert "#   k: 8  <- configs/loop.yaml: generation.k" in gen
    assert "#   .venv-infer/bin/python generation/launch.py --config " in gen
    assert "#   max_tokens:" not in gen  # configs/loop.yaml's 256 is the stage's default: not listed
    # the plan records the same command
    assert read_json(run_dir / "iter_1" / "plan.json")["dpo"]["command"].startswith("ACCELERATE_USE_CPU=true ")


def test_owned_keys_agree_between_the_typed_sections_and_the_key_checks():
    from online_rlhf.loop_keys import SECTIONS
    from online_rlhf.loop_config import LOOP_OWNED

    for name, (cls, owned) in SECTIONS.items():
        assert set(owned) == {k for k in LOOP_OWNED[name] if k in cls.model_fields}, name


def test_loop_owned_keys_in_the_dpo_stage_file_are_refused(small_cfg, tmp_path):
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text("training: {beta: 0.1}\npolicy: /some/model\n")
    with pytest.raises(ConfigError, match=rf"dpo_config={recipe}: policy: cannot be set in this file; set policy= at "
                                          rf"the top level.*remove policy from {recipe}"):
        loop.resolve(None, small_cfg + [f"dpo_config={recipe}"])


def test_launch_keys_in_a_stage_section_point_to_the_top_level(small_cfg):
    with pytest.raises(ConfigError, match=r"dpo\.num_processes: cannot be set here; set num_processes at the top level"):
        loop.resolve(None, small_cfg + ["dpo.num_processes=2"])


def test_loop_help_lists_the_section_keys(capsys):
    assert loop.main(["-h"]) == 0
    out = capsys.readouterr().out
    for key in ("generation.max_tokens (default 256)", "dpo.train_batch_size", "pairs.truncated_penalty",
                "reward.source (default 'verifier'"):
        assert key in out, key
    assert "generation.model" not in out and "dpo.output_dir" not in out  # set by the loop
    # a section's own defaults win over its class's: held-out generation is one greedy answer
    assert "evaluation.k (default 1)" in out and "evaluation.temperature (default 0.0)" in out
    assert "generation.k (default 4)" in out and "sft.dataset" in out


def test_a_subcommand_with_help_prints_the_usage_not_a_missing_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be planned or written
    for argv in (["plan", "--help"], ["plan-check", "-h"], ["check", "--help"]):
        assert loop.main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "python -m online_rlhf.loop plan CONFIG" in out and "not found" not in out
    assert list(tmp_path.iterdir()) == []
    assert loop.main(["plan"]) == 2  # nothing given: not the class defaults silently planned into runs/default
    assert "plan needs CONFIG, e.g. `python -m online_rlhf.loop plan configs/loop.yaml`" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_exec_runs_a_stage_from_its_config_file(small_cfg, tmp_path):
    """`loop exec` starts the stage with the command on top of its YAML (here: pairs)."""
    import subprocess
    import sys

    run_dir = loop.plan(None, small_cfg)
    write_jsonl(run_dir / "iter_1" / "rewards.jsonl", [
        {"id": "p0", "prompt": [{"role": "user", "content": "q"}], "responses": ["a", "b"],
         "finish_reasons": ["stop", "stop"], "rewards": [1.0, 0.0], "reward_source": "verifier"}])
    r = subprocess.run([sys.executable, "-m", "online_rlhf.loop", "exec", str(run_dir), "1", "pairs"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("+ ") and "annotate_data/make_pairs.py --config" in r.stdout.splitlines()[0]
    assert [p["id"] for p in read_jsonl(run_dir / "iter_1" / "pairs.jsonl")] == ["p0"]
    assert loop.main(["check", str(run_dir), "0", "dpo"]) == 3  # not a stage of iteration 0


def test_mark_refuses_a_stage_last_run_with_exec_overrides(small_cfg, tmp_path, capsys):
    """`loop exec ... key=value` changes what a stage writes but not its hash: marking that output
    fresh would hide the setting, so mark refuses until the stage runs again without overrides."""
    import subprocess
    import sys

    run_dir = loop.plan(None, small_cfg)
    write_jsonl(run_dir / "iter_1" / "rewards.jsonl", [
        {"id": "p0", "prompt": [{"role": "user", "content": "q"}], "responses": ["a", "b"],
         "finish_reasons": ["stop", "stop"], "rewards": [1.0, 0.0], "reward_source": "verifier"}])

    def exec_pairs(*extra):
        return subprocess.run([sys.executable, "-m", "online_rlhf.loop", "exec", str(run_dir), "1", "pairs", *extra],
                              capture_output=True, text=True, cwd=tmp_path)

    r = exec_pairs("min_margin=2.0")  # the margin now skips the only prompt: 0 pairs (exit 2), files written
    assert r.returncode == 2 and "min_margin=2" in r.stderr
    assert read_jsonl(run_dir / "iter_1" / "pairs.jsonl") == []
    capsys.readouterr()
    assert loop.main(["mark", str(run_dir), "1", "pairs", "1"]) == 2
    err = capsys.readouterr().err
    assert "min_margin=2.0" in err and "Nothing was marked" in err
    assert not (run_dir / "iter_1" / "pairs.done").exists()
    assert exec_pairs().returncode == 0  # as its config says: the record goes and the stage may be marked
    assert not (run_dir / "iter_1" / "pairs.exec_overrides.json").exists()
    assert loop.main(["mark", str(run_dir), "1", "pairs", "1"]) == 0 and loop.check(run_dir, 1, "pairs")


def test_check_names_a_mistyped_stage_and_the_real_ones(small_cfg, capsys):
    run_dir = loop.plan(None, small_cfg)
    capsys.readouterr()
    assert loop.main(["check", str(run_dir), "0", "dpo"]) == 3  # a real stage this iteration leaves out: says so
    err = capsys.readouterr().err
    assert "stage dpo is not planned in iteration 0" in err and "eval_generate" in err
    assert loop.main(["check", str(run_dir), "1", "dpoo"]) == 2  # a typo: an error naming the stages
    err = capsys.readouterr().err
    assert err.startswith("error: no stage named 'dpoo'") and "dpo" in err.split("the stages are")[1]


def test_loop_commands_refuse_bad_arguments_in_one_line(small_cfg, capsys):
    run_dir = loop.plan(None, small_cfg)
    capsys.readouterr()
    for argv, words in [(["check", str(run_dir), "zero", "pairs"], "ITER must be an iteration number"),
                        (["mark", str(run_dir), "1", "pairs", "abc"], "SECONDS must be a number"),
                        (["mark", str(run_dir), "1", "pairs", "-5"], "SECONDS is the stage's wall time, so >= 0"),
                        (["after", str(run_dir), "1", "pairz"], "no stage named 'pairz'"),
                        (["exec", str(run_dir), "1", "pairz"], "no stage named 'pairz'"),
                        (["mark", str(run_dir), "1"], "mark needs RUN_DIR ITER STAGE SECONDS")]:
        assert loop.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    # a stage whose output is not there is not marked done
    assert loop.main(["mark", str(run_dir), "1", "pairs", "1.0"]) == 2
    assert "has no " in capsys.readouterr().err and not (run_dir / "iter_1" / "pairs.done").exists()


def test_stage_refuses_another_process_count_than_planned(monkeypatch):
    from online_rlhf.hardware import check_process_count

    monkeypatch.setenv("WORLD_SIZE", "1")
    check_process_count(None, "dpo")
    check_process_count(1, "dpo")
    with pytest.raises(ConfigError, match=r"num_processes=2, but this run has 1 process.*--num_processes 2"):
        check_process_count(2, "dpo")


def _eval_file(path: Path, rewards: list[float]) -> None:
    write_jsonl(path, [{"id": str(j), "prompt": [{"role": "user", "content": "q"}], "responses": ["a"],
                        "finish_reasons": ["length" if j == 0 else "stop"], "response_tokens": [10],
                        "rewards": [r], "reward_source": "verifier"} for j, r in enumerate(rewards)])


def _write_stage_stats(it: Path, i: int, eval_prompts: int, rollout_mean: float | None = 0.5) -> None:
    """The stats files the stages of iteration ``i`` write (train stages for i >= 1, evaluation always;
    KL and IFEval when the plan holds them)."""
    plan = read_json(it / "plan.json")
    if "kl" in plan:
        example_stats(GenerateStats).write(it / "kl_generated.jsonl.stats.json")
        example_stats(KLStats).write(it / "kl.jsonl.stats.json")
    if "ifeval_score" in plan:
        example_stats(GenerateStats).write(it / "ifeval_generated.jsonl.stats.json")
        example_stats(IFEvalStats).write(it / "ifeval.jsonl.stats.json")
    example_stats(GenerateStats, prompts_in=eval_prompts).write(it / "eval_generated.jsonl.stats.json")
    example_stats(RewardStats).write(it / "eval.jsonl.stats.json")
    if i >= 1:
        example_stats(GenerateStats).write(it / "generated.jsonl.stats.json")
        summary = {"mean": rollout_mean, "std": None, "min": None, "max": None}
        example_stats(RewardStats, reward=summary).write(it / "rewards.jsonl.stats.json")
        example_stats(PairsStats, skipped={"tie": 1}).write(it / "pairs.jsonl.stats.json")
        example_stats(DPOStats, steps=3, train_loss_first=0.7, train_loss_last=0.5).write(it / "model.stats.json")


def test_metrics_and_report(small_cfg):
    run_dir = loop.plan(None, small_cfg + ["ifeval.when=never", "kl_samples=0"])  # tests/test_evaluation.py: those
    _eval_file(run_dir / "iter_0" / "eval.jsonl", [0.0, 0.5, 1.0, 0.5])
    _write_stage_stats(run_dir / "iter_0", 0, eval_prompts=5)
    row0 = loop.metrics(run_dir, 0)
    assert row0["eval_reward_mean"] == pytest.approx(0.5)
    lo, hi = row0["eval_reward_ci95"]
    assert lo < 0.5 < hi and row0["eval_truncation_rate"] == 0.25
    assert row0["eval_unscored"] == 1  # 5 held-out prompts generated for, 4 scored
    assert set(read_json(run_dir / "iter_0" / "stats.json")) == {"eval_generated.jsonl", "eval.jsonl"}
    it = run_dir / "iter_1"
    _eval_file(it / "eval.jsonl", [1.0, 1.0, 1.0, 0.0])
    write_jsonl(it / "generated.jsonl", [{"id": "p0", "finish_reasons": ["stop", "length"]}])
    write_jsonl(it / "pairs.jsonl", [{"id": "p0"}, {"id": "p1"}])
    _write_stage_stats(it, 1, eval_prompts=4, rollout_mean=0.3125)
    loop.metrics(run_dir, 1)
    loop.metrics(run_dir, 1)  # rerun replaces the row, never duplicates it
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert rows[1]["pairs"] == 2 and rows[1]["eval_reward_mean"] == pytest.approx(0.75)
    assert rows[1]["rollout_reward_mean"] == 0.3125 and "rollout_reward_mean" not in rows[0]
    assert rows[1]["pairs_skipped"] == {"tie": 1} and rows[1]["eval_unscored"] == 0
    assert rows[1]["dpo"] == {"train_loss_first": 0.7, "train_loss_last": 0.5, "rewards_accuracies_last": 0.0, "steps": 3}
    assert rows[1]["hardware"]["model"]["device"] == "cpu" and "rewards" not in rows[1]["hardware"]
    md = loop.report(run_dir)
    text = md.read_text()
    assert "| 0 | 0.5000" in text and "| 1 | 0.7500" in text and "| 0.3125 | 2 |" in text
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    stats = read_json(it / "stats.json")
    assert set(stats) == {"generated.jsonl", "rewards.jsonl", "pairs.jsonl", "model", "eval_generated.jsonl", "eval.jsonl"}
    assert DPOStats.model_validate(stats["model"]).steps == 3


def test_metrics_refuse_a_missing_or_bad_stats_file(small_cfg, capsys):
    run_dir = loop.plan(None, small_cfg)
    it = run_dir / "iter_1"
    _eval_file(it / "eval.jsonl", [1.0, 0.0])
    write_jsonl(it / "generated.jsonl", [{"id": "p0", "responses": ["a", "b"], "finish_reasons": ["stop", "stop"]}])
    write_jsonl(it / "pairs.jsonl", [{"id": "p0"}])
    _write_stage_stats(it, 1, eval_prompts=2)
    (it / "model.stats.json").unlink()  # DPO never ran: iteration 1 has no metrics row
    with pytest.raises(FileNotFoundError, match=r"model\.stats\.json"):
        loop.metrics(run_dir, 1)
    bad = example_stats(DPOStats).model_dump(mode="json")
    bad["train_loss_final"] = bad.pop("train_loss_last")  # a renamed key
    write_json(it / "model.stats.json", bad)
    capsys.readouterr()
    assert loop.main(["metrics", str(run_dir), "1"]) == 2
    err = capsys.readouterr().err
    assert "model.stats.json" in err and "missing key 'train_loss_last'" in err
    assert "unknown key 'train_loss_final'" in err and "run_dpo.py" in err
    # an iteration the run does not have: says which ones it has, not that a file is missing
    assert loop.main(["metrics", str(run_dir), "9"]) == 2
    err = capsys.readouterr().err
    assert "iteration 9 is not planned in this run (planned: 0, 1" in err


def test_metrics_leave_out_unscored_and_warn_on_identical_train_responses(small_cfg, capsys):
    run_dir = loop.plan(None, small_cfg)
    it = run_dir / "iter_1"
    write_jsonl(it / "eval.jsonl", [{"id": str(j), "prompt": [{"role": "user", "content": "q"}], "responses": ["a"],
                                     "finish_reasons": ["stop"], "response_tokens": [3], "rewards": [r],
                                     "reward_source": "remote"} for j, r in enumerate([1.0, None, 0.0])])
    write_jsonl(it / "generated.jsonl", [{"id": f"p{j}", "responses": ["same"] * 4, "finish_reasons": ["stop"] * 4}
                                         for j in range(3)] + [{"id": "p3", "responses": ["a", "b"],
                                                                 "finish_reasons": ["stop"] * 2}])
    write_jsonl(it / "pairs.jsonl", [{"id": "p3"}])
    _write_stage_stats(it, 1, eval_prompts=3)
    capsys.readouterr()
    assert loop.main(["metrics", str(run_dir), "1"]) == 0
    row = read_jsonl(run_dir / "metrics.jsonl")[0]
    assert row["eval_reward_mean"] == pytest.approx(0.5) and row["eval_unscored_responses"] == 1
    assert row["train_prompts_fewer_than_2_distinct"] == 3 and len(row["warnings"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("iteration 1: held-out reward 0.5000")
    assert out[1].startswith("WARNING: iteration 1, generated.jsonl: 3 of 4 prompts have fewer than 2 distinct")


def test_mean_ci95_edge_cases():
    m, lo, hi = loop.mean_ci95([1.0])
    assert (m, lo, hi) == (1.0, 1.0, 1.0)
    assert all(x != x for x in loop.mean_ci95([]))  # NaN when empty


def test_sft_stage_is_planned_and_feeds_iteration_1(small_cfg, tmp_path):
    data = tmp_path / "sft.jsonl"
    write_jsonl(data, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    run_dir = loop.plan(None, small_cfg + ["sft.enabled=true", f"sft.dataset={data}"])
    entry = read_json(run_dir / "iter_0" / "plan.json")["sft"]
    assert entry["outputs"] == [str(run_dir / "sft" / "model")] and entry["inputs"][0] == _policy(small_cfg)
    gen1 = yaml.safe_load(Path(read_json(run_dir / "iter_1" / "plan.json")["generate"]["config"]).read_text())
    assert gen1["model"] == str(run_dir / "sft" / "model")
    assert yaml.safe_load(Path(entry["config"]).read_text())["base_model"] == _policy(small_cfg)


def test_sft_enabled_without_dataset_is_a_config_error(small_cfg):
    with pytest.raises(ConfigError, match="sft.dataset"):
        loop.resolve(None, small_cfg + ["sft.enabled=true"])


def test_copied_run_dir_keeps_its_done_markers(small_cfg, tmp_path):
    import re
    import shutil

    run_dir = loop.plan(None, small_cfg)
    it = run_dir / "iter_1"
    write_jsonl(it / "generated.jsonl", [{"id": "p0"}])
    write_jsonl(it / "rewards.jsonl", [{"id": "p0"}])
    example_stats(RewardStats).write(stats_path(it / "rewards.jsonl"))
    loop.mark(run_dir, 1, "rewards", 1.0)
    copy = tmp_path / "elsewhere" / "t"
    shutil.copytree(run_dir, copy)
    moved = [a if not a.startswith("output_root=") else f"output_root={copy.parent}" for a in small_cfg]
    assert loop.plan(None, moved) == copy
    assert loop.check(copy, 1, "rewards")


def test_dpo_training_typo_fails_at_start(small_cfg):
    pytest.importorskip("trl")
    with pytest.raises(ConfigError, match=r"unknown trl.DPOConfig key 'bta'.*'beta'"):
        loop.resolve(None, small_cfg + ["dpo.training.bta=0.05"])
    with pytest.raises(ConfigError, match=r"dpo\.training\.beta: expected a number"):
        loop.resolve(None, small_cfg + ["dpo.training.beta=abc"])
    with pytest.raises(ConfigError, match=r"per_iteration\.2\.dpo\.training\.max_length: expected an integer, got 'abc'"):
        loop.resolve(None, small_cfg + ["per_iteration={2: {dpo: {training: {max_length: abc}}}}"])
    for bad, msg in (("learning_rate=-1", r"learning_rate: must be > 0"), ("num_train_epochs=0", "must be > 0"),
                     ("per_device_train_batch_size=0", "must be >= 1"), ("beta=0", r"beta: must be > 0")):
        with pytest.raises(ConfigError, match=msg):
            loop.resolve(None, small_cfg + [f"dpo.training.{bad}"])
    loop.resolve(None, small_cfg + ["dpo.training.num_train_epochs=0", "dpo.training.max_steps=3"])  # max_steps rules


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "/etc"])
def test_run_name_must_be_one_folder_inside_output_root(small_cfg, name):
    with pytest.raises(ConfigError, match="run_name must be one folder name inside output_root"):
        loop.resolve(None, _with(small_cfg, f"run_name={name}"))


def test_one_sample_per_prompt_is_refused_at_start(small_cfg):
    with pytest.raises(ConfigError, match=r"iteration 2: generation\.k=1, but a chosen/rejected pair needs at least 2"):
        loop.resolve(None, small_cfg + ["per_iteration={2: {generation: {k: 1}}}"])


def test_plan_warns_on_train_eval_overlap_and_reuse(tmp_path, capsys):
    same = _prompts(tmp_path / "same.jsonl", 6)
    run_dir = loop.plan(None, [f"train_prompts={same}", f"eval_prompts={same}", f"output_root={tmp_path / 'r'}",
                               "run_name=o", f"policy={tmp_path}", "iterations=3", "prompts_per_iteration=4"])
    warnings = read_json(run_dir / "plan_warnings.json")
    assert any("also held-out prompts" in w for w in warnings)
    assert any("iteration 2" in w and "already used in iteration(s) 1" in w for w in warnings)
    assert "WARNING" in capsys.readouterr().err


def test_plan_warns_on_train_prompts_whose_checker_would_draw_an_argument(tmp_path):
    """A paragraph past the last one (NeMo-Skills PR #1375): its checker draws nth_paragraph again at
    every scoring, so the rewards stage will count the record unscorable; the plan says so first."""
    train, held = tmp_path / "train.jsonl", _prompts(tmp_path / "held.jsonl", 3)
    kw = {"num_paragraphs": 3, "first_word": "ambition"}
    write_jsonl(train, [{"id": f"t{i}", "prompt": "Write a poem.", "kwargs": [{**kw, "nth_paragraph": n}],
                         "instruction_id_list": ["length_constraints:nth_paragraph_first_word"]}
                        for i, n in enumerate((2, 4, 3, 4))])
    common = [f"train_prompts={train}", f"eval_prompts={held}", f"output_root={tmp_path / 'r'}", f"policy={tmp_path}",
              "iterations=1", "prompts_per_iteration=4", "ifeval.when=never"]
    warnings = read_json(loop.plan(None, common + ["run_name=w"]) / "plan_warnings.json")
    (w,) = [w for w in warnings if "draw at random" in w]
    assert ("(iteration 1's prompts): 2 of 4 prompts leave an argument for their checker to draw at random" in w
            and "the first, id 't1': length_constraints:nth_paragraph_first_word: nth_paragraph" in w
            and "argument_drawn_by_checker" in w), w
    warnings = read_json(loop.plan(None, common + ["run_name=rm", "reward.source=reward_model",
                                                   f"reward.reward_model={tmp_path}"]) / "plan_warnings.json")
    assert not [w for w in warnings if "draw at random" in w]  # another source does not run the checkers


def test_plan_warns_when_eval_limit_exceeds_the_held_out_file(tmp_path):
    train, held = _prompts(tmp_path / "train.jsonl", 8), _prompts(tmp_path / "held.jsonl", 3)
    common = [f"train_prompts={train}", f"eval_prompts={held}", f"output_root={tmp_path / 'r'}", f"policy={tmp_path}",
              "iterations=1", "prompts_per_iteration=4"]
    warnings = read_json(loop.plan(None, common + ["run_name=big", "eval_limit=1000"]) / "plan_warnings.json")
    assert any("eval_limit=1000, but eval_prompts" in w and "has 3 prompts" in w for w in warnings), warnings
    warnings = read_json(loop.plan(None, common + ["run_name=fits", "eval_limit=3"]) / "plan_warnings.json")
    assert not any("eval_limit" in w for w in warnings), warnings


def test_plan_warns_when_ifeval_limit_exceeds_the_ifeval_file(tmp_path):
    train, held = _prompts(tmp_path / "train.jsonl", 8), _prompts(tmp_path / "held.jsonl", 3)
    ifeval = tmp_path / "ifeval_like.jsonl"
    write_jsonl(ifeval, [{"id": f"i{n}", "prompt": "Answer in lowercase.",
                          "instruction_id_list": ["change_case:english_lowercase"], "kwargs": [{}]} for n in range(2)])
    common = [f"train_prompts={train}", f"eval_prompts={held}", f"output_root={tmp_path / 'r'}", f"policy={tmp_path}",
              "iterations=1", "prompts_per_iteration=4", f"ifeval.prompts={ifeval}", "ifeval.when=ends"]
    warnings = read_json(loop.plan(None, common + ["run_name=big", "ifeval.limit=600"]) / "plan_warnings.json")
    assert any("ifeval.limit=600, but ifeval.prompts has 2 prompts" in w for w in warnings), warnings
    warnings = read_json(loop.plan(None, common + ["run_name=fits", "ifeval.limit=2"]) / "plan_warnings.json")
    assert not any("ifeval.limit" in w for w in warnings), warnings


def test_rerun_with_changed_config_keeps_the_previous_one(small_cfg, capsys):
    run = loop.plan(None, small_cfg)
    first = (run / "config.yaml").read_text()
    loop.plan(None, small_cfg)  # same config: nothing kept
    assert not (run / "config_history").exists()
    loop.plan(None, small_cfg + ["dpo.training.beta=0.3"])
    kept = list((run / "config_history").iterdir())
    assert len(kept) == 1 and kept[0].read_text() == first
    assert "beta: 0.3" in (run / "config.yaml").read_text() and "config_history/" in capsys.readouterr().err
    loop.plan(None, small_cfg)  # back again: the 0.3 config is kept too, under its own name
    assert len(list((run / "config_history").iterdir())) == 2


def test_report_logs_iterations_to_wandb_offline(small_cfg, monkeypatch):
    """``wandb: true``: report() logs one step per iteration into a real offline wandb run."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = []
    real_log = wandb.sdk.wandb_run.Run.log

    def spy(self, data, step=None, **kw):  # records, then lets wandb log for real
        logged.append((step, dict(data)))
        return real_log(self, data, step=step, **kw)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    run_dir = loop.plan(None, small_cfg + ["wandb=true"])
    _eval_file(run_dir / "iter_0" / "eval.jsonl", [0.0, 0.5])
    _eval_file(run_dir / "iter_1" / "eval.jsonl", [1.0, 0.5])
    write_jsonl(run_dir / "iter_1" / "generated.jsonl", [{"id": "p0", "finish_reasons": ["stop", "stop"]}])
    write_jsonl(run_dir / "iter_1" / "pairs.jsonl", [{"id": "p0"}, {"id": "p1"}, {"id": "p2"}])
    _write_stage_stats(run_dir / "iter_0", 0, eval_prompts=2)
    _write_stage_stats(run_dir / "iter_1", 1, eval_prompts=2)
    loop.metrics(run_dir, 0)
    loop.metrics(run_dir, 1)
    loop.report(run_dir)
    assert [step for step, _ in logged] == [0, 1]
    assert logged[0][1]["eval/reward_mean"] == pytest.approx(0.25) and logged[1][1]["train/pairs"] == 3
    runs = list((run_dir / "wandb").glob("offline-run-*-loop-t/run-loop-t.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_a_checkpoint_without_weights_is_not_a_finished_output(tmp_path):
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert not freshness.output_present(ckpt)  # weights deleted: DPO must run again on resume
    (ckpt / "model.safetensors").write_bytes(b"x")
    assert freshness.output_present(ckpt) and freshness.output_present(tmp_path) and not freshness.output_present(tmp_path / "no")


def test_both_dpo_batch_sizes_are_refused_at_plan_time(small_cfg):
    with pytest.raises(ConfigError, match=r"iteration 1: dpo\.train_batch_size=4 .* dpo\.training\.per_device_train_batch_size=2 "
                                          r"are both set.*dpo\.train_batch_size=null"):
        loop.resolve("configs/loop.yaml", small_cfg + ["dpo.training.per_device_train_batch_size=2"])
    cfg = loop.resolve("configs/loop.yaml", small_cfg + ["dpo.training.per_device_train_batch_size=2",
                                                         "dpo.train_batch_size=null"])
    assert cfg.dpo.train_batch_size is None


def test_num_processes_must_divide_the_dpo_batch(small_cfg):
    with pytest.raises(ConfigError, match=r"dpo\.train_batch_size=4 is not a multiple of num_processes=3"):
        loop.resolve("configs/loop.yaml", small_cfg + ["num_processes=3"])
    assert loop.resolve("configs/loop.yaml", small_cfg + ["num_processes=2"]).num_processes == 2


# --- dry run: fit check, advice, plan -----------------------------------------------------------

def _dry(stage: str, peak: float | None, limit: float | None, device: str = "cpu", status: str = "ok",
         preallocated: bool = False, **settings):
    from online_rlhf.stats import DryRunStats

    return DryRunStats(stage=stage, status=status, error=None, device=device, memory_measure="test",
                       peak_memory_gib=peak, memory_limit_gib=limit, preallocated=preallocated,
                       per_process_peak_gib=[peak or 0.0], processes=1, seconds_per_step=1.5, step="1 step",
                       shapes={}, settings=settings, seconds_total=3.0)


def test_dry_run_verdicts_against_the_limit():
    from online_rlhf.loop.memory_check import verdict

    assert verdict(10.0, 24.0) == "ok"
    assert verdict(22.0, 24.0) == "tight"  # within 10% of the limit
    assert verdict(25.0, 24.0) == "over"
    assert verdict(1.0, 24.0, status="out_of_memory") == "over"
    assert verdict(130.0, 139.0, preallocated=True) == "ok"  # vLLM on a GPU reserves its share up front
    assert verdict(None, 24.0) == "unknown"


def test_dry_run_report_names_the_stage_that_does_not_fit_and_what_to_lower():
    from online_rlhf.loop.memory_check import Row, report

    rows = [Row("generate", 1, result=_dry("generate", 3.0, 20.0, max_model_len=2048, k=4, kv_cache_gb=2.0,
                                             max_tokens=256)),
            Row("rewards", 1, note="source=verifier loads no model"),
            Row("dpo", 1, result=_dry("dpo", 26.5, 20.0, **{"train_batch_size": 8,
                                                          "training.per_device_train_batch_size": 4,
                                                          "training.gradient_accumulation_steps": 1,
                                                          "training.max_length": 1024,
                                                          "training.gradient_checkpointing": False}))]
    text, code = report(rows)
    assert code == 1
    assert "DOES NOT FIT: dpo peak 26.50 GiB of 20.00 GiB" in text
    for key in ("dpo.training.per_device_train_batch_size (now 4)", "dpo.training.gradient_accumulation_steps (now 1)",
                "dpo.train_batch_size (now 8)", "dpo.training.max_length (now 1024)",
                "dpo.training.gradient_checkpointing=true"):
        assert key in text, key
    assert "generation." not in text  # the stage that fits gets no advice
    assert "no stage marked done" in text

    text, code = report([Row("generate", 1, result=_dry("generate", 19.0, 20.0, max_model_len=2048, k=4,
                                                        kv_cache_gb=2.0, max_tokens=256)),
                         Row("sft", 0, result=_dry("sft", 2.0, 20.0))])
    assert code == 0  # tight is a warning, not a failure
    assert "TIGHT (within 10%): generate" in text
    assert "generation.max_model_len (now 2048)" in text and "generation.kv_cache_gb (now 2.0)" in text
    assert "generation.k (now 4)" in text

    text, code = report([Row("dpo", 1, note="killed (exit -9)", log="x.log", failed=True)])
    assert code == 1 and "FAILED: dpo" in text


def test_dry_run_gpu_advice_names_gpu_settings():
    from online_rlhf.loop.memory_check import advice

    gen = " ".join(advice("generate", {"gpu_memory_utilization": 0.9}, "cuda"))
    assert "generation.gpu_memory_utilization (now 0.9)" in gen and "kv_cache_gb" not in gen
    dpo = " ".join(advice("dpo", {"training.gradient_checkpointing": True, "launch_profile": "zero2"}, "cuda"))
    assert "gradient_checkpointing" not in dpo and "launch_profile=zero3 (now zero2)" in dpo
    sft = " ".join(advice("sft", {"micro_batch_size": 4, "sequence_len": 1024}, "cpu"))
    assert "sft.micro_batch_size (now 4)" in sft and "sft.sequence_len (now 1024)" in sft


def test_dry_run_key_leaves_the_run_config_and_stage_hashes_alone(small_cfg, capsys):
    run_dir = loop.plan(None, small_cfg)
    before = (run_dir / "config.yaml").read_text()
    hashes = {s: loop.stage_hash(run_dir, 1, s) for s in ("generate", "dpo")}
    capsys.readouterr()
    loop.plan(None, small_cfg + ["dry_run=true"])
    assert "DRY_RUN=1" in capsys.readouterr().out
    assert (run_dir / "config.yaml").read_text() == before and not (run_dir / "config_history").exists()
    assert {s: loop.stage_hash(run_dir, 1, s) for s in ("generate", "dpo")} == hashes
    d, text = _stage_yaml(run_dir, 1, "dpo")
    assert d["dry_run"] is False and "dry_run=true" not in text  # nor in the provenance header


@pytest.mark.parametrize("section", ["generation", "dpo", "reward"])
def test_dry_run_in_a_stage_section_points_to_the_loop_key(small_cfg, section):
    with pytest.raises(ConfigError, match=rf"{section}\.dry_run.*dry_run=true at the top level"):
        loop.resolve(None, small_cfg + [f"{section}.dry_run=true"])


def test_run_config_given_back_resolves_to_the_same_stage_configs(small_cfg, tmp_path):
    """<run>/config.yaml holds only the section keys that were set, so giving it back to the loop
    reproduces every stage config (a section dumped with all defaults overrode configs/dpo.yaml's
    batch and the per-iteration seeds)."""
    run_dir = loop.plan("configs/loop.yaml", small_cfg + ["generation.k=6"])
    before = {p.relative_to(run_dir): yaml.safe_load(p.read_text()) for p in run_dir.glob("iter_*/configs/*.yaml")}
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["dpo"] == {} and saved["generation"]["k"] == 6 and "seed" not in saved["generation"]
    copy = tmp_path / "again.yaml"
    copy.write_text((run_dir / "config.yaml").read_text())
    assert loop.plan(str(copy), []) == run_dir
    after = {p.relative_to(run_dir): yaml.safe_load(p.read_text()) for p in run_dir.glob("iter_*/configs/*.yaml")}
    assert after == before
    assert yaml.safe_load((run_dir / "iter_1" / "configs" / "dpo.yaml").read_text())["train_batch_size"] == 4


def test_dry_run_without_a_dpo_max_length_is_refused_at_plan_time(small_cfg):
    with pytest.raises(ConfigError, match=r"dry_run=true needs dpo\.training\.max_length"):
        loop.resolve("configs/loop.yaml", small_cfg + ["dry_run=true", "dpo.training.max_length=null"])


def _tree(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (relative path -> bytes)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("bad", ["train_prompts={missing}", "per_iteration={{2: {{train_prompts: {missing}}}}}"])
def test_a_failed_plan_leaves_a_finished_runs_files_as_they_were(small_cfg, tmp_path, bad):
    run = loop.plan(None, small_cfg)
    it = run / "iter_1"  # iteration 1's generate finished under this plan
    write_jsonl(it / "generated.jsonl", [{"id": "p0"}])
    example_stats(GenerateStats).write(stats_path(it / "generated.jsonl"))
    loop.mark(run, 1, "generate", 1.0)
    assert loop.check(run, 1, "generate")
    before = _tree(run)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError, match="missing.jsonl: no such file"):
        loop.plan(None, _with(small_cfg, "generation.k=3", bad.format(missing=missing)))
    assert _tree(run) == before  # no stage config says k: 3, no prompt slice or plan.json changed
    assert loop.check(run, 1, "generate")


def test_a_failed_first_plan_creates_nothing(small_cfg, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        loop.plan(None, _with(small_cfg, f"train_prompts={tmp_path / 'missing.jsonl'}"))
    assert not (tmp_path / "runs").exists()


def test_fresh_may_clear_a_run_or_the_leftovers_of_a_refused_plan_and_nothing_else(small_cfg, tmp_path):
    assert loop.fresh_refusal(tmp_path / "none") is None  # not there yet
    run = tmp_path / "left"  # what a refused first plan of earlier versions left: no config.yaml
    (run / "iter_0" / "configs").mkdir(parents=True)
    (run / "iter_0" / "configs" / "eval_generate.yaml").write_text("k: 1\n")
    (run / "iter_0" / "plan.json").write_text("{}\n")
    (run / "iter_1" / "configs").mkdir(parents=True)
    (run / "iter_1" / "configs" / "generate.yaml").write_text("k: 3\n")
    (run / "iter_1" / "logs").mkdir()
    (run / "iter_1" / "logs" / "generate.log").write_text("")
    (run / ".lock").write_text("")
    assert loop.fresh_refusal(run) is None
    for extra in ("iter_1/generated.jsonl", "iter_1/configs/notes.txt", "iter_1/logs/notes.txt", "thesis.tex"):
        (run / extra).write_text("mine")
        assert "not a run directory" in loop.fresh_refusal(run), extra
        (run / extra).unlink()
    (run / "iter_x").mkdir()
    assert "not a run directory" in loop.fresh_refusal(run)
    (run / "config.yaml").write_text("name: my other project\n")  # a config.yaml, but not a run's
    assert "not a run directory" in loop.fresh_refusal(run)
    planned = loop.plan(None, small_cfg)  # a run's config.yaml: whatever else is there
    (planned / "iter_1" / "generated.jsonl").write_text("")
    assert loop.fresh_refusal(planned) is None
    assert loop.main(["fresh-check", str(run)]) == 2 and loop.main(["fresh-check", str(planned)]) == 0


def test_the_loop_stops_after_a_pairs_stage_that_made_no_pair_saying_why_and_what_to_change(small_cfg, capsys):
    run = loop.plan(None, small_cfg)
    capsys.readouterr()
    pairs = run / "iter_1" / "pairs.jsonl"
    write_jsonl(pairs, [])
    tie = {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5}
    example_stats(PairsStats, pairs_out=0, skipped={"tie": 2}, reward=tie, responses={"total": 8},
                  truncation={"policy": "penalize", "penalty": 0.1}).write(stats_path(pairs))
    line = loop.no_pairs_stop(run, 1)
    assert line.startswith(f"iteration 1: 0 pairs in {pairs} from 2 prompts") and "stopped before DPO" in line
    assert "2 of 2 prompts had all their responses scored the same (tie; every reward was 0.5)" in line
    assert "generation.k" in line and "reward.source" in line
    assert "truncat" not in line  # truncation was not the reason: not suggested
    assert loop.main(["pairs-check", str(run), "1"]) == 1 and capsys.readouterr().out.strip() == line
    # truncated responses left out under pairs.truncated=exclude: then the truncation setting is named
    example_stats(PairsStats, pairs_out=0, skipped={"fewer_than_2_valid": 2},
                  responses={"total": 8, "truncated": 7, "truncated_excluded": 7}).write(stats_path(pairs))
    line = loop.no_pairs_stop(run, 1)
    assert "2 of 2 prompts had fewer than 2 usable responses" in line and "7 truncated responses were left out" in line
    assert "pairs.truncated=penalize" in line and "generation.max_tokens" in line
    # pairs made: the loop goes on to DPO
    example_stats(PairsStats).write(stats_path(pairs))
    assert loop.no_pairs_stop(run, 1) is None and loop.main(["pairs-check", str(run), "1"]) == 0


def test_grpo_iterations_have_no_pairs_stop(small_cfg):
    run = loop.plan(None, small_cfg + ["algorithm=grpo"])
    assert loop.no_pairs_stop(run, 1) is None


def test_plan_stdout_holds_only_the_shell_assignments_run_loop_evals(small_cfg):
    """Libraries the plan's checks import (TRL, with WANDB_MODE=offline) print on stdout; run_loop.sh
    `eval`s that stdout, so anything else there would be run as a command."""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "online_rlhf.loop", "plan", *small_cfg], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert [ln.split("=", 1)[0] for ln in lines] == ["RUN_DIR", "ITERATIONS", "LAUNCH_PROFILE", "DRY_RUN"], p.stdout


def test_every_missing_prompt_file_is_reported_at_once(small_cfg, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with pytest.raises(FileNotFoundError, match=rf"2 prompt file\(s\) missing: eval_prompts={b}: no such file .*; "
                                                rf"train_prompts={a}: no such file .*Fix the paths"):
        loop.plan(None, _with(small_cfg, f"train_prompts={a}", f"eval_prompts={b}"))
    assert not (tmp_path / "runs").exists()


def test_a_missing_or_malformed_sft_dataset_is_refused_by_the_plan(small_cfg, tmp_path):
    from online_rlhf.jsonl import DataError

    sft = ["sft.enabled=true"]
    with pytest.raises(ConfigError, match=r"sft\.dataset=/missing_sft\.jsonl: no such file .*sft\.enabled=false"):
        loop.plan(None, small_cfg + sft + ["sft.dataset=/missing_sft.jsonl"])
    bad = tmp_path / "bad_sft.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n{not json\n')
    with pytest.raises(DataError, match=rf"sft\.dataset={bad}: {bad}:2"):
        loop.plan(None, small_cfg + sft + [f"sft.dataset={bad}"])
    assert not (tmp_path / "runs").exists()
    # the same file is not read while SFT is off
    loop.plan(None, small_cfg + [f"sft.dataset={bad}"], write=False)


def test_ifeval_prompts_without_instruction_fields_are_refused_by_the_plan(small_cfg, tmp_path):
    bare = _prompts(tmp_path / "bare_ifeval.jsonl", 3)  # answer, no instruction_id_list
    with pytest.raises(ConfigError, match=rf"ifeval\.prompts={bare} .*3 of 3 prompts lack the fields IFEval scores by; "
                                          r"the first, id 'p0', needs instruction_id_list .*ifeval\.when=never"):
        loop.plan(None, small_cfg + [f"ifeval.prompts={bare}"])
    good = tmp_path / "good_ifeval.jsonl"
    write_jsonl(good, [{"id": "i1", "prompt": "Answer in lowercase.", "instruction_id_list": ["change_case:english_lowercase"],
                        "kwargs": [{}]}])
    loop.plan(None, small_cfg + [f"ifeval.prompts={good}"], write=False)
    loop.plan(None, small_cfg + [f"ifeval.prompts={bare}", "ifeval.when=never"], write=False)
    typo = tmp_path / "typo_ifeval.jsonl"
    write_jsonl(typo, [{"id": "i1", "prompt": "Answer in lowercase.", "instruction_id_list": ["change_case:lowercase"],
                        "kwargs": [{}]}])
    with pytest.raises(ConfigError, match=rf"ifeval\.prompts={typo} .*1 of 1 prompts name a constraint the checkers "
                                          r"cannot score; the first, id 'i1', has instruction id 'change_case:lowercase'"):
        loop.plan(None, small_cfg + [f"ifeval.prompts={typo}"], write=False)


def test_a_copied_run_directory_is_refused_until_planned_where_it_is(small_cfg, tmp_path, capsys):
    """plan.json names the run directory it was planned for: a copy's stages would read and write the
    original's files, so check/exec/mark refuse it, naming the command that plans it in place."""
    import re
    import shutil

    run = loop.plan(None, small_cfg)
    copy = tmp_path / "elsewhere" / "t_copy"
    shutil.copytree(run, copy)
    capsys.readouterr()
    assert loop.main(["check", str(copy), "1", "generate"]) != 0
    assert re.search(r"was planned for the run directory .*/runs/t, not .*/t_copy \(a copied or moved run\?\).*Plan it "
                     r"here first: bash run_loop.sh .*t_copy/config.yaml output_root=.*/elsewhere run_name=t_copy",
                     capsys.readouterr().err)
    before = (run / "iter_1" / "configs" / "generate.yaml").read_text()
    with pytest.raises(ConfigError, match="planned for the run directory"):
        loop.mark(copy, 1, "generate", 1.0)
    assert not (run / "iter_1" / "generate.done").exists()
    # the command it names plans the copy in place (the run's own config.yaml), after which it checks as usual
    again = loop.plan(str(copy / "config.yaml"), [f"output_root={copy.parent}", "run_name=t_copy"])
    assert again == copy.resolve() and (copy / "iter_1" / "configs" / "generate.yaml").read_text() != before
    assert loop.main(["check", str(copy), "1", "generate"]) == 1  # not run yet, in the copy
