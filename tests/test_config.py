"""Config loading: YAML + key=value overrides, unknown keys and wrong types name the key."""

import pytest

from online_rlhf.config import ConfigError, apply_overrides, parse_override
from online_rlhf.loop_config import LoopConfig
from online_rlhf.stage_configs import GenerateConfig, PairsConfig


def test_override_values_are_parsed_as_yaml():
    assert parse_override("k=8") == (["k"], 8)
    assert parse_override("temperature=0.7") == (["temperature"], 0.7)
    assert parse_override("lora=null") == (["lora"], None)
    assert parse_override("stop=[a, b]") == (["stop"], ["a", "b"])
    assert parse_override("name=") == (["name"], "")


def test_dotted_override_creates_nesting_without_touching_siblings():
    out = apply_overrides({"dpo": {"training": {"beta": 0.1, "lr": 1}}}, ["dpo.training.beta=0.05"])
    assert out == {"dpo": {"training": {"beta": 0.05, "lr": 1}}}


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("temperature")


def test_yaml_file_plus_overrides(tmp_path):
    p = tmp_path / "gen.yaml"
    p.write_text("prompts: p.jsonl\noutput: o.jsonl\nk: 2\n")
    cfg = GenerateConfig.from_cli(["--config", str(p), "k=6", "temperature=0.5"])
    assert (cfg.k, cfg.temperature, cfg.prompts) == (6, 0.5, "p.jsonl")


def test_unknown_key_names_the_key_and_suggests(tmp_path):
    p = tmp_path / "gen.yaml"
    p.write_text("prompts: p.jsonl\noutput: o.jsonl\ntemprature: 0.5\n")
    with pytest.raises(ConfigError) as e:
        GenerateConfig.load(p)
    msg = str(e.value)
    assert "temprature" in msg and "temperature" in msg and str(p) in msg


def test_a_missing_required_key_says_how_to_set_it_and_a_typo_of_it_is_named():
    with pytest.raises(ConfigError) as e:
        GenerateConfig.from_cli(["prompts=p.jsonl", "outptu=o.jsonl"])
    msg = str(e.value)
    assert "2 problem(s) in the config (GenerateConfig):" in msg
    assert "  - output: required, not set. Set it in the config file or as output=VALUE." in msg
    assert "  - outptu: unknown key. Did you mean 'output'?" in msg
    assert "got {" not in msg  # not the whole mapping as the offending value


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"k:.*integer"):
        GenerateConfig.from_cli(["prompts=p", "output=o", "k=many"])


def test_out_of_range_value_is_refused():
    with pytest.raises(ConfigError, match="top_p"):
        GenerateConfig.from_cli(["prompts=p", "output=o", "top_p=1.5"])


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        GenerateConfig.load(tmp_path / "nope.yaml")


def test_invalid_yaml_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("k: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        GenerateConfig.load(p)


def test_literal_choices_are_enforced():
    with pytest.raises(ConfigError, match="strategy"):
        PairsConfig.from_cli(["input=a", "output=b", "strategy=best_worst"])


def test_unknown_cli_option_is_refused():
    with pytest.raises(ConfigError, match="--temperature"):
        GenerateConfig.from_cli(["--temperature", "0.5"])


def test_loop_defaults_validate():
    cfg = LoopConfig.from_dict({})
    assert cfg.iterations >= 1 and cfg.ref_model == "initial"


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    assert parse_override("learning_rate=1e-5") == (["learning_rate"], 1e-5)
    assert parse_override("x=5.0e-6") == (["x"], 5e-6)
    assert parse_override("name=1e") == (["name"], "1e")
    p = tmp_path / "c.yaml"
    p.write_text("training:\n  learning_rate: 2e-5\n")
    from online_rlhf.config import load_yaml
    assert load_yaml(p) == {"training": {"learning_rate": 2e-5}}


def test_a_key_given_twice_on_the_command_line_is_refused():
    with pytest.raises(ConfigError, match=r"k is given twice on the command line: 'k=2' and 'k=3'"):
        GenerateConfig.from_cli(["prompts=p", "output=o", "k=2", "k=3"])
    with pytest.raises(ConfigError, match=r"dpo\.training\.beta is given twice.*'dpo\.training\.beta=0\.1' and "
                                          r"'dpo\.training\.beta=0\.2'"):
        apply_overrides({}, ["dpo.training.beta=0.1", "dpo.training.beta=0.2"])
    # a file value and one override of it, or two different keys of one section, are fine
    assert apply_overrides({"k": 1}, ["k=2", "kk=3"]) == {"k": 2, "kk": 3}
    assert apply_overrides({}, ["a.b=1", "a.c=2"]) == {"a": {"b": 1, "c": 2}}


def test_a_check_across_keys_names_the_keys_not_the_whole_mapping():
    with pytest.raises(ConfigError) as e:
        LoopConfig.from_dict({"num_machines": 2, "machine_rank": 2, "main_process_ip": "host0"}, "loop.yaml")
    msg = str(e.value)
    assert "machine_rank=2 must be < num_machines=2" in msg
    assert "got dict" not in msg and "<root>" not in msg and "Value error" not in msg


def test_a_long_wrong_value_is_shown_not_just_its_type():
    big = "{" + ", ".join(f"key{j}: {j}" for j in range(20)) + "}"
    with pytest.raises(ConfigError) as e:
        GenerateConfig.from_cli(["prompts=p", "output=o", f"k={big}"])
    msg = str(e.value)
    assert "k: Input should be a valid integer (got {'key0': 0, 'key1': 1" in msg and "got dict" not in msg
    assert "...)" in msg  # cut, not the whole mapping


def test_a_key_written_twice_in_a_config_file_is_refused_with_file_line_and_key(tmp_path):
    from online_rlhf import loop
    from online_rlhf.stage_table import stage_file

    p = tmp_path / "gen.yaml"
    p.write_text("prompts: p.jsonl\noutput: o.jsonl\nk: 2\nk: 4\n")
    with pytest.raises(ConfigError, match=rf"{p}, line 4: key 'k' is given twice \(first on line 3\)"):
        GenerateConfig.from_cli(["--config", str(p)])
    nested = tmp_path / "dpo.yaml"
    nested.write_text("training:\n  beta: 0.1\n  learning_rate: 1.0e-6\n  beta: 0.2\n")
    with pytest.raises(ConfigError, match=rf"{nested}, line 4: key 'beta' is given twice"):
        stage_file(str(nested))
    looped = tmp_path / "loop.yaml"
    looped.write_text("iterations: 1\niterations: 2\n")
    with pytest.raises(ConfigError, match=rf"{looped}, line 2: key 'iterations' is given twice"):
        loop.resolve(str(looped), [])
    merged = tmp_path / "merge.yaml"  # a << merge key may repeat keys on purpose
    merged.write_text("base: &b {k: 2}\nover:\n  <<: *b\n  k: 4\n")
    from online_rlhf.config import load_yaml
    assert load_yaml(merged)["over"] == {"k": 4}


def test_config_given_twice_is_refused(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for p in (a, b):
        p.write_text("prompts: p.jsonl\noutput: o.jsonl\n")
    for argv in (["--config", str(a), "--config", str(b)], [f"--config={a}", "--config", str(b)]):
        with pytest.raises(ConfigError, match="--config is given twice .*give --config once"):
            GenerateConfig.from_cli(argv)


def test_a_mapping_override_merges_into_a_mapping_section():
    data = {"generation": {"k": 4, "temperature": 0.7}, "dpo": {"training": {"beta": 0.1, "lr": 1}}}
    out = apply_overrides(data, ["generation={k: 2}", "dpo={training: {beta: 0.2}}"])
    assert out == {"generation": {"k": 2, "temperature": 0.7}, "dpo": {"training": {"beta": 0.2, "lr": 1}}}
    assert data["generation"] == {"k": 4, "temperature": 0.7}  # the input is not changed
    # a mapping replaces a non-mapping value; a non-mapping replaces a mapping
    assert apply_overrides({"a": None, "b": {"c": 1}}, ["a={x: 1}", "b=3"]) == {"a": {"x": 1}, "b": 3}
    # different keys of one section, one as a mapping and one dotted, are fine
    assert apply_overrides(data, ["dpo={training: {beta: 0.2}}", "dpo.training.lr=2"])["dpo"] == \
        {"training": {"beta": 0.2, "lr": 2}}


def test_a_key_given_as_a_mapping_and_as_a_dotted_path_is_refused():
    for items in (["dpo={training: {beta: 0.2}}", "dpo.training.beta=0.3"],
                  ["dpo.training.beta=0.3", "dpo={training: {beta: 0.2}}"],
                  ["dpo.training={beta: 0.2}", "dpo.training.beta=0.3"]):
        with pytest.raises(ConfigError, match=r"dpo\.training\.beta is given twice on the command line"):
            apply_overrides({"dpo": {"training": {"beta": 0.1}}}, items)


def test_run_loop_takes_relative_stage_config_paths_from_where_it_runs(tmp_path):
    """run_loop.sh's argument loop (run alone, nothing else of the script): a relative dpo_config=,
    grpo_config= or sft.config= that exists where the user runs it becomes that absolute path; one
    that does not stays as given (the project root's)."""
    import subprocess
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "run_loop.sh").read_text()
    block = script[script.index('CONFIG="configs/loop.yaml"'):]
    block = block[:block.index("\ndone\n") + 6]
    for name in ("my_dpo.yaml", "my_grpo.yaml", "my_sft.yaml"):
        (tmp_path / name).write_text("{}\n")
    args = ["dpo_config=my_dpo.yaml", "grpo_config=my_grpo.yaml", "sft.config=my_sft.yaml", "grpo_config=configs/g.yaml",
            "grpo.beta=0.1"]
    out = subprocess.run(["bash", "-c", f'CALLER_PWD="$1"; shift\n{block}\nprintf "%s\\n" "${{OVERRIDES[@]}}"', "_",
                          str(tmp_path), *args],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"dpo_config={tmp_path}/my_dpo.yaml", f"grpo_config={tmp_path}/my_grpo.yaml",
                   f"sft.config={tmp_path}/my_sft.yaml", "grpo_config=configs/g.yaml", "grpo.beta=0.1"]


def test_run_loop_takes_per_iteration_paths_from_where_it_runs_and_refuses_odd_words(tmp_path):
    """A per_iteration.<i>.train_prompts= that exists where the user runs run_loop.sh becomes that
    absolute path, as a top-level one does; a single-dash option and a second config file are refused
    with a message that says so (not "config file not found")."""
    import subprocess
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "run_loop.sh").read_text()
    block = script[script.index('CONFIG="configs/loop.yaml"'):]
    block = block[:block.index("\ndone\n") + 6]
    (tmp_path / "p2.jsonl").write_text("{}\n")

    def args_loop(*args):
        return subprocess.run(["bash", "-c", f'CALLER_PWD="$1"; shift\n{block}\nprintf "%s\\n" "${{OVERRIDES[@]}}"',
                               "_", str(tmp_path), *args], capture_output=True, text=True)

    out = args_loop("per_iteration.2.train_prompts=p2.jsonl", "per_iteration.2.eval_prompts=nothere.jsonl")
    assert out.returncode == 0 and out.stdout.split() == [f"per_iteration.2.train_prompts={tmp_path}/p2.jsonl",
                                                          "per_iteration.2.eval_prompts=nothere.jsonl"]
    out = args_loop("-x")
    assert out.returncode == 2 and "unknown option '-x'" in out.stderr
    out = args_loop("configs/loop.yaml", "configs/if_dpo.yaml")
    assert out.returncode == 2 and "two config files given" in out.stderr


def test_the_path_keys_run_loop_sh_makes_absolute_are_one_list():
    """run_loop.sh's `case` line, its header and docs/custom.md name the loop keys whose relative
    path is taken from where you run it: the same keys as online_rlhf.loop_config.PATH_KEYS (which
    online_rlhf.seeds applies as run_loop.sh does)."""
    import re
    from pathlib import Path

    from online_rlhf.loop_config import PATH_KEYS

    root = Path(__file__).resolve().parent.parent
    script = (root / "run_loop.sh").read_text(encoding="utf-8")
    (case,) = re.findall(r"^\s+(train_prompts\|[\w.|]+)\)", script, flags=re.M)
    assert tuple(case.split("|")) == PATH_KEYS
    header = re.search(r"Relative paths you pass \(CONFIG, (.*?)\) are taken", script, flags=re.S).group(1)
    assert tuple(re.findall(r"([\w.]+)=", header)) == PATH_KEYS
    custom = (root / "docs" / "custom.md").read_text(encoding="utf-8")
    listed = re.search(r"Relative paths given to `run_loop.sh`\s+\(`CONFIG`, (.*?), and the same keys", custom,
                       flags=re.S).group(1)
    assert tuple(re.findall(r"`([\w.]+)=`", listed)) == PATH_KEYS


def test_an_infinite_or_nan_number_is_refused_by_every_stage_config():
    from pydantic import ValidationError

    from online_rlhf.stage_configs import PairsConfig, SFTDataConfig

    # inf passed ge=0 and crashed the stats write; NaN passed an unbounded field and kept every prompt
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="finite number"):
            PairsConfig(input="r.jsonl", output="p.jsonl", min_margin=bad)
        with pytest.raises(ValidationError, match="finite number"):
            SFTDataConfig(rewards="r.jsonl", output="s.jsonl", min_reward=bad)
