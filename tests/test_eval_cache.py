"""The evaluation cache (online_rlhf/eval_cache.py): iteration 0's greedy evaluations reused across
seeds and reruns, keyed by the starting policy's content, the prompts and the decoding settings."""

import shutil
from pathlib import Path

import pytest
import yaml

from online_rlhf import eval_cache, loop
from online_rlhf.loop import freshness
from online_rlhf.loop import run as loop_run
from online_rlhf.jsonl import write_jsonl
from online_rlhf.stats import GenerateStats, stats_path
from online_rlhf.testing import example_stats


def _model(path: Path, weights: bytes = b"w0") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def _prompts(path: Path, n: int = 3) -> Path:
    write_jsonl(path, [{"id": f"p{i}", "prompt": f"question {i}", "answer": str(i)} for i in range(n)])
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONLINE_RLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ONLINE_RLHF_EVAL_CACHE", raising=False)
    return tmp_path / "cache" / "eval"


def test_the_key_follows_content_and_settings_not_paths_or_a_greedy_seed(tmp_path, cache):
    m, p = _model(tmp_path / "a" / "model"), _prompts(tmp_path / "prompts.jsonl")
    d = {"model": str(m), "prompts": str(p), "temperature": 0.0, "k": 1, "max_tokens": 64, "seed": 1,
         "output": str(tmp_path / "run1" / "eval.jsonl")}
    key = eval_cache.cache_key("eval_generate", d, [str(m), str(p)])
    # another run: other seed, other output path, the same model copied to another folder
    m2 = tmp_path / "b" / "start"
    shutil.copytree(m, m2)
    same = {**d, "model": str(m2), "seed": 7, "output": str(tmp_path / "run2" / "eval.jsonl")}
    assert eval_cache.cache_key("eval_generate", same, [str(m2), str(p)]) == key
    # what changes the answers changes the key
    assert eval_cache.cache_key("eval_generate", {**d, "max_tokens": 65}, [str(m), str(p)]) != key
    assert eval_cache.cache_key("ifeval_generate", d, [str(m), str(p)]) != key
    sampled = {**d, "temperature": 1.0}
    assert eval_cache.cache_key("eval_generate", sampled, [str(m), str(p)]) != \
        eval_cache.cache_key("eval_generate", {**sampled, "seed": 2}, [str(m), str(p)])
    (m2 / "model.safetensors").write_bytes(b"w1")
    assert eval_cache.cache_key("eval_generate", same, [str(m2), str(p)]) != key
    p2 = _prompts(tmp_path / "other.jsonl", 4)
    assert eval_cache.cache_key("eval_generate", d, [str(m), str(p2)]) != key


def test_a_change_to_the_decoding_code_changes_the_key(tmp_path, cache, monkeypatch):
    # a later version that renders prompts differently must decode afresh, not reuse stale answers
    m, p = _model(tmp_path / "model"), _prompts(tmp_path / "prompts.jsonl")
    d = {"model": str(m), "prompts": str(p), "temperature": 0.0, "k": 1, "max_tokens": 64}
    key = eval_cache.cache_key("eval_generate", d, [str(m), str(p)])
    pkg = tmp_path / "pkg"
    for mod in eval_cache.DECODE_CODE:
        (pkg / mod).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(eval_cache.__file__).parent / mod, pkg / mod)
    monkeypatch.setattr(eval_cache, "__file__", str(pkg / "eval_cache.py"))
    assert eval_cache.cache_key("eval_generate", d, [str(m), str(p)]) == key  # same source, any folder
    (pkg / "chat_tokens.py").write_text((pkg / "chat_tokens.py").read_text() + "\n# changed\n")
    assert eval_cache.cache_key("eval_generate", d, [str(m), str(p)]) != key


def _plan(tmp_path: Path, name: str, *extra: str, policy: str = "start") -> Path:
    args = [f"train_prompts={_prompts(tmp_path / 'train.jsonl', 6)}", f"eval_prompts={_prompts(tmp_path / 'eval.jsonl')}",
            f"output_root={tmp_path / 'runs'}", f"run_name={name}", f"policy={tmp_path / policy}", "iterations=1",
            "ifeval.when=never", "kl_samples=0", *extra]
    return loop.plan(None, args)


def _finish_eval(run: Path) -> Path:
    out = run / "iter_0" / "eval_generated.jsonl"
    write_jsonl(out, [{"id": "p0", "prompt": [{"role": "user", "content": "question 0"}], "responses": ["an answer"],
                       "finish_reasons": ["stop"], "response_tokens": [2]}])
    example_stats(GenerateStats).write(stats_path(out))
    loop.mark(run, 0, "eval_generate", 1.0)
    return out


def test_a_second_seed_reuses_iteration_0s_evaluation_and_says_where_it_came_from(tmp_path, cache, capsys):
    _model(tmp_path / "start")
    first = _plan(tmp_path, "s1", "seed=1")
    decoded = _finish_eval(first)
    assert len(list(cache.iterdir())) == 1  # stored when marked done

    second = _plan(tmp_path, "s2", "seed=2")
    e = freshness.stage_entry(second, 0, "eval_generate")
    d = yaml.safe_load(Path(e["config"]).read_text())
    assert loop_run.reuse_cached(second, 0, "eval_generate", e, d)
    out = second / "iter_0" / "eval_generated.jsonl"
    assert out.read_bytes() == decoded.read_bytes()
    st = GenerateStats.read(stats_path(out))
    assert st.reused_from == str(decoded)
    assert "reused" in capsys.readouterr().out
    loop.mark(second, 0, "eval_generate", 0.1)
    assert loop.check(second, 0, "eval_generate")
    # iteration 1's evaluation (a trained policy) is never taken from the cache
    e1 = freshness.stage_entry(second, 1, "eval_generate")
    assert not loop_run.reuse_cached(second, 1, "eval_generate", e1, yaml.safe_load(Path(e1["config"]).read_text()))


def test_another_starting_policy_or_eval_cache_false_decodes_afresh(tmp_path, cache, monkeypatch):
    _model(tmp_path / "start")
    _finish_eval(_plan(tmp_path, "s1"))
    off = _plan(tmp_path, "no_cache", "eval_cache=false")
    e = freshness.stage_entry(off, 0, "eval_generate")
    assert not loop_run.reuse_cached(off, 0, "eval_generate", e, yaml.safe_load(Path(e["config"]).read_text()))
    monkeypatch.setenv("ONLINE_RLHF_EVAL_CACHE", "0")
    on = _plan(tmp_path, "env_off")
    e = freshness.stage_entry(on, 0, "eval_generate")
    assert not loop_run.reuse_cached(on, 0, "eval_generate", e, yaml.safe_load(Path(e["config"]).read_text()))
    monkeypatch.delenv("ONLINE_RLHF_EVAL_CACHE")
    (tmp_path / "start" / "model.safetensors").write_bytes(b"other weights")
    changed = _plan(tmp_path, "changed")
    e = freshness.stage_entry(changed, 0, "eval_generate")
    assert not loop_run.reuse_cached(changed, 0, "eval_generate", e, yaml.safe_load(Path(e["config"]).read_text()))


def test_a_stale_entry_is_removed_with_a_clear_error(tmp_path, cache):
    _model(tmp_path / "start")
    _finish_eval(_plan(tmp_path, "s1"))
    entry = next(cache.iterdir())
    (entry / "stats.json").write_text('{"stage": "generate"}')
    run = _plan(tmp_path, "s2")
    e = freshness.stage_entry(run, 0, "eval_generate")
    with pytest.raises(loop.DataError, match="cached evaluation .* removed it"):
        loop_run.reuse_cached(run, 0, "eval_generate", e, yaml.safe_load(Path(e["config"]).read_text()))
    assert not entry.exists()


def test_a_reused_evaluation_names_this_runs_model_and_prompts(tmp_path, cache):
    # the key holds the starting policy's content, not its path: a copy elsewhere (a seed run on a
    # temporary model that was deleted since) reuses the entry, and its stats must name this run's copy
    _model(tmp_path / "start")
    first = _plan(tmp_path, "s1")
    _finish_eval(first)
    shutil.copytree(tmp_path / "start", tmp_path / "copy")
    shutil.rmtree(tmp_path / "start")
    second = _plan(tmp_path, "s2", policy="copy")
    e = freshness.stage_entry(second, 0, "eval_generate")
    d = yaml.safe_load(Path(e["config"]).read_text())
    assert d["model"] == str(tmp_path / "copy")
    assert loop_run.reuse_cached(second, 0, "eval_generate", e, d)
    st = GenerateStats.read(stats_path(second / "iter_0" / "eval_generated.jsonl"))
    assert (st.model, st.prompts) == (d["model"], d["prompts"])
    assert st.reused_from == str(first / "iter_0" / "eval_generated.jsonl")
