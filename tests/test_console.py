"""The warnings run_loop.sh repeats on the console (online_rlhf/console.py, issue 24 item 2): the
libraries' warnings too, not only lines that begin ``WARNING:``."""

from online_rlhf.console import log_warnings, main

# Lines as the libraries write them (Axolotl 0.19's log format; Python's warnings module; vLLM).
LOG = """\
+ .venv-train/bin/python -m online_rlhf.stages.axolotl_train model.axolotl.yaml
[2025-12-01 20:13:05,123] [INFO] [axolotl.cli.train:41] [PID:123] loading
[2025-12-01 20:13:06,001] [WARNING] [axolotl.prompt_strategies.chat_template:383] [PID:123] EOS token '<|endoftext|>' not found in chat_template; the turn terminator won't be trained. Set `eot_tokens` to your template's turn-ending token.
\x1b[33m[2025-12-01 20:13:07,002] [WARNING] [axolotl.prompt_strategies.chat_template:383] [PID:124] EOS token '<|endoftext|>' not found in chat_template; the turn terminator won't be trained. Set `eot_tokens` to your template's turn-ending token.\x1b[39m
/x/site-packages/torch/jit/_script.py:365: DeprecationWarning: `torch.jit.script_method` is deprecated.
  warnings.warn(
WARNING 12-01 20:13:08 [config.py:12] Casting torch.bfloat16 to torch.float32.
WARNING: 3 of 10 responses were cut at max_tokens.
everything fine
"""


def test_library_warnings_are_repeated_once_each():
    out = log_warnings(LOG)
    assert len(out) == 4
    assert "the turn terminator won't be trained" in out[0]   # Axolotl's, once though logged by two ranks
    assert "DeprecationWarning" in out[1] and out[2].startswith("WARNING 12-01")
    assert out[3] == "WARNING: 3 of 10 responses were cut at max_tokens."


def test_limit_and_the_count_of_the_rest(tmp_path, capsys):
    many = "".join(f"warning: problem {k}\n" for k in range(12))
    out = log_warnings(many, limit=8)
    assert out[:8] == [f"warning: problem {k}" for k in range(8)] and out[8] == "(4 more warnings in the log)"
    (tmp_path / "x.log").write_text(many)
    assert main(["warnings", str(tmp_path / "x.log"), "2"]) == 0
    assert capsys.readouterr().out.splitlines() == ["warning: problem 0", "warning: problem 1",
                                                    "(10 more warnings in the log)"]
    assert log_warnings("all good\nINFO: fine\n") == []
