"""Machine k gives up waiting for a silent machine 0 (issue 24, item 6): before, a failed machine 0
left machine k polling for ever."""

from __future__ import annotations

import json
import os
import time

import pytest

from online_rlhf import loop
from online_rlhf.loop import run as loop_run


@pytest.fixture
def two_machine_run(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i}", "answer": str(i)}) + "\n"
                               for i in range(4)))
    (tmp_path / "pol").mkdir()
    return loop.plan(None, [f"train_prompts={prompts}", f"eval_prompts={prompts}", f"output_root={tmp_path / 'runs'}",
                            "run_name=t", f"policy={tmp_path / 'pol'}", "iterations=1", "num_machines=2",
                            "main_process_ip=10.1.2.3", "num_processes=4"])


def test_machine_k_stops_when_machine_0_writes_nothing_for_the_timeout(two_machine_run, monkeypatch, capsys):
    monkeypatch.setenv("ONLINE_RLHF_WAIT_TIMEOUT_S", "0.3")
    t0 = time.monotonic()
    # iteration 1's dpo waits for machine 0's pairs stage, which never finishes here
    assert loop.main(["exec", str(two_machine_run), "1", "dpo", "machine_rank=1", ]) == 2
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert "error: waited" in err and "for machine 0 to finish stage pairs of iteration 1" in err
    assert "its run_loop.sh has failed or was stopped" in err and "ONLINE_RLHF_WAIT_TIMEOUT_S" in err


def test_a_stage_log_that_grows_keeps_machine_k_waiting(two_machine_run, monkeypatch):
    """Machine 0 is alive while it writes: a stage log that grows during the wait resets the silence."""
    import threading

    monkeypatch.setenv("ONLINE_RLHF_WAIT_TIMEOUT_S", "1.0")
    log = two_machine_run / "iter_1" / "logs" / "pairs.log"
    log.parent.mkdir(parents=True)

    def machine_0():  # writes for 2.5 s, then falls silent
        for k in range(9):
            with open(log, "a") as f:
                f.write(f"step {k}\n")
            time.sleep(0.3)

    writer = threading.Thread(target=machine_0)
    t0 = time.monotonic()
    writer.start()
    with pytest.raises(TimeoutError, match=r"has written nothing in .* for 1 s"):
        loop_run.wait_for_previous_stage(two_machine_run, 1, "dpo", poll_s=0.05)
    writer.join()
    assert time.monotonic() - t0 >= 2.5  # not before machine 0 stopped writing
