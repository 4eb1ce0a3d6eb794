"""Generation over several machines (generation/launch.py with num_machines > 1).

Machine k runs shards r with r % M == k; machine 0 waits for every shard file on the shared
filesystem (``merge_wait_s``) and merges. Tests without a mark use fake shard files and run in
either env; the ``vllm`` one starts two launchers on this host (machine_rank 0 and 1, one shard
each) on a tiny policy and needs ``.venv-infer``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from online_rlhf.config import ConfigError
from online_rlhf.jsonl import DataError, read_jsonl, write_jsonl
from online_rlhf.stage_configs import GenerateConfig
from online_rlhf.stages import generate, launch, merge_data
from online_rlhf.stats import GenerateShardStats, GenerateStats, stats_path
from online_rlhf.testing import example_stats, make_tiny_policy

ROOT = Path(__file__).resolve().parent.parent
GEN_DIR = ROOT / "generation"


def _prompts(path: Path, n: int) -> Path:
    write_jsonl(path, [{"id": f"p{i}", "prompt": f"Write {i} short words about the sea."} for i in range(n)])
    return path


def _cfg(tmp_path: Path, w: int, m: int, rank: int = 0, **kw) -> GenerateConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return GenerateConfig(prompts=str(_prompts(tmp_path / "p.jsonl", 7)), output=str(tmp_path / "generated.jsonl"),
                          model=str(model), num_shards=w, num_machines=m, machine_rank=rank, k=2, **kw)


def _write_shard(cfg: GenerateConfig, r: int, fingerprint: str | None = None) -> Path:
    """Shard r's output and stats as generate.py writes them (output first, stats last)."""
    rows = read_jsonl(cfg.prompts)[r::cfg.num_shards]
    path = merge_data.shard_path(merge_data.shards_dir_of(cfg), r)
    write_jsonl(path, [{"id": p["id"], "prompt": [{"role": "user", "content": p["prompt"]}], "responses": ["a", "b"],
                        "finish_reasons": ["stop", "stop"], "response_tokens": [1, 1]} for p in rows])
    fp = fingerprint if fingerprint is not None else launch.expected_fingerprints(cfg)[r]
    example_stats(GenerateShardStats, shard_index=r, num_shards=cfg.num_shards, config_fingerprint=fp).write(stats_path(path))
    return path


def test_each_shard_runs_on_exactly_one_machine():
    assert launch.machine_shards(5, 2, 0) == [0, 2, 4] and launch.machine_shards(5, 2, 1) == [1, 3]
    assert launch.machine_shards(4, 1, 0) == [0, 1, 2, 3]
    assert launch.machine_shards(1, 2, 1) == []  # fewer shards than machines: machine 1 idles
    for w, m in ((7, 3), (2, 4), (8, 2)):
        got = sorted(r for k in range(m) for r in launch.machine_shards(w, m, k))
        assert got == list(range(w))


def test_machine_0_refuses_after_the_wait_naming_each_missing_shard_and_its_machine(tmp_path):
    cfg = _cfg(tmp_path, w=4, m=2, merge_wait_s=0.3)
    _write_shard(cfg, 0)
    _write_shard(cfg, 2)
    _write_shard(cfg, 3, fingerprint="an-earlier-run")  # a stale file is not taken for a finished shard
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        launch.wait_for_shards(cfg, poll_s=0.05)
    assert 0.3 <= time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "waited 0.3 s (merge_wait_s)" in msg and "2 of 4 not finished" in msg
    assert f"{merge_data.shard_path(tmp_path / 'generated', 1)} (missing; machine 1 of 2 runs shard 1" in msg
    assert "shard_03.jsonl (written for another config" in msg and "machine 1 of 2 runs shard 3" in msg
    assert "shard_00" not in msg and "shard_02" not in msg


def test_launcher_exits_2_with_the_missing_shard_file(tmp_path, monkeypatch, capsys):
    # launch.py's main on machine 0: its own shards done (run_shards replaced), machine 1's never come
    cfg = _cfg(tmp_path, w=2, m=2, merge_wait_s=0.2)
    monkeypatch.setattr(launch, "run_shards", lambda c: _write_shard(c, 0))
    monkeypatch.setattr(launch, "MERGE_POLL_S", 0.05)
    monkeypatch.setattr(sys, "argv", ["launch.py", *(f"{k}={v}" for k, v in cfg.model_dump().items() if v is not None)])
    with pytest.raises(SystemExit) as e:
        launch.cli()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: machine 0 waited 0.2 s") and "shard_01.jsonl (missing; machine 1 of 2" in err
    assert not Path(cfg.output).exists()


def test_machine_0_merges_once_the_other_machine_writes_its_shard(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, w=2, m=2, merge_wait_s=30)
    monkeypatch.setattr(launch, "run_shards", lambda c: _write_shard(c, 0))
    monkeypatch.setattr(launch, "MERGE_POLL_S", 0.05)
    late = threading.Timer(0.5, lambda: _write_shard(cfg, 1))
    late.start()
    try:
        stats = launch.main(cfg)
    finally:
        late.join()
    assert [r["id"] for r in read_jsonl(cfg.output)] == [f"p{i}" for i in range(7)]
    assert GenerateStats.read(stats_path(cfg.output)) == stats and stats.records_out == 7


def test_other_machines_do_not_merge(tmp_path, monkeypatch, capsys):
    cfg = _cfg(tmp_path, w=2, m=2, rank=1)
    monkeypatch.setattr(launch, "run_shards", lambda c: _write_shard(c, 1))
    assert launch.main(cfg) is None
    assert "machine 0 merges" in capsys.readouterr().out and not Path(cfg.output).exists()


def test_one_machine_merges_at_once_without_waiting(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, w=2, m=1, merge_wait_s=0)
    monkeypatch.setattr(launch, "run_shards", lambda c: [_write_shard(c, r, fingerprint="any") for r in range(2)])
    monkeypatch.setattr(launch, "wait_for_shards", lambda *a, **k: pytest.fail("one machine must not wait"))
    assert launch.main(cfg).records_out == 7


def test_expected_fingerprint_is_the_one_each_shard_computes(tmp_path):
    # the shard process loads the shared shard config and overrides its index and output
    cfg = _cfg(tmp_path, w=3, m=2, rank=1, merge_wait_s=5)
    shards_dir = merge_data.shards_dir_of(cfg)
    shards_dir.mkdir(parents=True)
    config_path = shards_dir / "generate_config.yaml"
    config_path.write_text(launch.shard_config(cfg, shards_dir).to_yaml())
    for r in range(3):
        argv = launch.shard_command(config_path, shards_dir, r, 3)[3:]  # after `python -m module`
        shard_cfg = GenerateConfig.from_cli(argv)
        assert launch.expected_fingerprints(cfg)[r] == generate.shard_fingerprint(shard_cfg, cfg.model)
    # and it leaves out which machine runs the shard: a rerun with another machine count reuses finished shards
    assert launch.expected_fingerprints(cfg) == launch.expected_fingerprints(
        cfg.model_copy(update={"num_machines": 1, "machine_rank": 0, "merge_wait_s": 1.0}))


def test_machine_rank_outside_the_machines_is_refused():
    with pytest.raises(ConfigError, match="machine_rank=2 must be < num_machines=2"):
        GenerateConfig.from_cli(["prompts=p.jsonl", "output=o.jsonl", "num_machines=2", "machine_rank=2"])


@pytest.mark.vllm
def test_vllm_two_machines_write_every_prompt_exactly_once(tmp_path):
    """Two launchers on this host as machines 0 and 1 (num_shards=2: one shard each), started at the
    same time as on two real machines; machine 0 waits for machine 1's shard and merges."""
    pytest.importorskip("vllm")
    model = make_tiny_policy(tmp_path / "policy", hidden_size=128)  # head_dim 32 for vLLM's CPU attention
    prompts = _prompts(tmp_path / "prompts.jsonl", 7)
    out = tmp_path / "generated.jsonl"
    base = [sys.executable, str(GEN_DIR / "launch.py"), f"prompts={prompts}", f"model={model}", f"output={out}",
            "num_shards=2", "num_machines=2", "k=2", "max_tokens=8", "max_model_len=128", "kv_cache_gb=0.25",
            "merge_wait_s=900"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([*base, f"machine_rank={k}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for k in (0, 1)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for k, (p, text) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"machine {k}:\n{text[-4000:]}"
    assert "shard 0/2 started on machine 0 of 2" in outs[0] and "shard 1/2" not in outs[0]
    assert "shard 1/2 started on machine 1 of 2" in outs[1] and "machine 0 merges" in outs[1]
    ids = [r["id"] for r in read_jsonl(out)]
    assert ids == [f"p{i}" for i in range(7)]  # every prompt exactly once, in prompt-set order
    assert all(len(r["responses"]) == 2 for r in read_jsonl(out))
    stats = GenerateStats.read(stats_path(out))
    assert [s.shard_index for s in stats.shards] == [0, 1] and stats.records_out == 7
