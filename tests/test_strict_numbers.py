"""A YAML boolean is not a number (issue 24, item 4): every integer and float key refuses ``true``/``false``,
naming the key; a number where text is expected says how to quote it."""

from __future__ import annotations

import pytest

from online_rlhf.config import ConfigError, StageConfig
from online_rlhf.loop import resolve
from online_rlhf.loop_config import LoopConfig
from online_rlhf.stage_configs import GenerateConfig


@pytest.mark.parametrize("override, key", [
    ("iterations=true", "iterations"),            # was: 1 iteration, no warning
    ("generation.k=true", "generation.k"),        # was: k=1
    ("per_iteration={2: {generation: {k: yes}}}", "per_iteration.2.generation.k"),
    ("kl_warn=false", "kl_warn"),                 # an Optional[float]
    ("num_processes=true", "num_processes"),      # int | "auto"
    ("dpo.training.beta=true", "dpo.training.beta"),
])
def test_a_bool_for_a_number_key_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"{key}: expected a number") as e:
        resolve(None, [override, "iterations=2"] if not override.startswith("iterations") else [override])
    assert "Value error" not in str(e.value)


def test_stage_cli_refuses_a_bool_for_a_number_too():
    with pytest.raises(ConfigError, match="k: expected a number, got the YAML boolean true"):
        GenerateConfig.from_cli(["model=m", "prompts=p.jsonl", "output=o.jsonl", "k=true"])
    assert GenerateConfig.from_cli(["model=m", "prompts=p.jsonl", "output=o.jsonl", "k=3"]).k == 3


def test_bool_keys_still_take_bools_and_numbers_still_take_numbers():
    cfg = resolve(None, ["wandb=true", "iterations=3", "kl_warn=2"])
    assert cfg.wandb is True and cfg.iterations == 3 and cfg.kl_warn == 2.0


def test_every_number_field_of_every_config_refuses_a_bool():
    """Not only the keys of the report: walk every StageConfig subclass's int/float fields."""
    from online_rlhf.config import _number_not_bool

    def classes(c):
        for sub in c.__subclasses__():
            yield sub
            yield from classes(sub)

    checked = 0
    for cls in set(classes(StageConfig)):
        for name, f in cls.model_fields.items():
            if not _number_not_bool(f.annotation):
                continue
            with pytest.raises(Exception, match="expected a number, got the YAML boolean"):
                cls.model_validate({name: True})
            checked += 1
    assert checked > 30


def test_a_number_for_run_name_says_how_to_quote_it():
    with pytest.raises(ConfigError, match=r"""run_name: expected text, but YAML reads 123 as a number. Quote it: """
                                          r"""run_name="'123'" on the command line"""):
        resolve(None, ["run_name=123"])
    assert resolve(None, ["run_name='123'"]).run_name == "123"
    assert LoopConfig.from_dict({"run_name": "123"}).run_name == "123"


def test_a_yaml_bool_for_run_name_does_not_echo_another_word():
    """`run_name=no` reads as the bool false: the message must not tell the user to quote 'false'."""
    with pytest.raises(ConfigError) as e:
        resolve(None, ["run_name=no"])
    msg = str(e.value)
    assert "yes/no/on/off/true/false" in msg and """run_name="'WORD'\"""" in msg and "'false'" not in msg
