"""The seeds command (online_rlhf/seeds.py): per-seed paired IFEval and held-out comparisons, and
the pooled interval and exact test across seeds."""

import json
from pathlib import Path

import pytest

from online_rlhf import seeds
from online_rlhf.jsonl import DataError, write_jsonl
from online_rlhf.paths import PROJECT_ROOT


def _run(root: Path, seed: int, base_pass: list[bool], last_pass: list[bool], last: int = 2,
         heldout_diff: float = 0.05) -> Path:
    """A finished run directory with IFEval outcomes at iteration 0 and ``last`` (one instruction
    per prompt: alternately a length constraint and a format one)."""
    run = root / seeds.run_name_of("rec", seed)
    ids = [f"k{j}" for j in range(len(base_pass))]
    names = ["length_constraints:number_words" if j % 2 == 0 else "detectable_format:title" for j in range(len(ids))]
    for i, passes in ((0, base_pass), (last, last_pass)):
        write_jsonl(run / f"iter_{i}" / "ifeval.jsonl",
                    [{"id": k, "instruction_id_list": [n], "strict": [p], "loose": [p], "prompt_strict": p,
                      "prompt_loose": p} for k, n, p in zip(ids, names, passes)])
    rows = [{"iteration": 0, "eval_reward_mean": 0.1, "eval_median_response_tokens": 200, "kl": {"kl_mean": 0.0},
             "stage_seconds": {"eval_generate": 10.0}},
            *({"iteration": i, "pairs": 12, "stage_seconds": {"generate": 10.0}} for i in range(1, last)),
            {"iteration": last, "eval_reward_mean": 0.1 + heldout_diff, "eval_median_response_tokens": 150,
             "eval_reward_vs_0": {"diff": heldout_diff, "p_value": 0.04}, "kl": {"kl_mean": 1.5},
             "eval_reward_lc_vs_0": {"diff": heldout_diff / 2, "p_value": 0.2}, "pairs": 18,
             "stage_seconds": {"generate": 90.0, "dpo": 50.0}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_one_seed_is_paired_against_its_own_iteration_0(tmp_path):
    run = _run(tmp_path, 1, [True, False, False, False, True, False], [True, True, True, False, False, False])
    s = seeds.seed_summary(run)
    assert s["iteration"] == 2 and s["prompts"] == 6
    assert s["ifeval_prompt_strict"] == pytest.approx([2 / 6, 3 / 6])
    assert s["ifeval_prompt_strict_diff"] == pytest.approx(1 / 6)
    assert (s["gained"], s["lost"]) == (2, 1)
    # length constraints are the even prompts: 0, 2, 4 -> passed 2 of 3 before (0, 4), 2 of 3 after (0, 2)
    assert s["length_constraints_strict"] == pytest.approx([2 / 3, 2 / 3])
    assert s["heldout_diff"] == 0.05 and s["kl"] == 1.5 and s["median_tokens"] == [200, 150]
    assert s["stage_seconds"] == 160.0 and not s["iteration_0_reused"]
    # the pairs of every training iteration, and the yardsticks: +16.7 points from 30 pairs in 160 s
    assert (s["pairs"], s["heldout_lc_diff"], s["heldout_lc_p"]) == (30, 0.025, 0.2)
    assert s["pairs_per_minute"] == pytest.approx(30 / (160 / 60), abs=0.01)
    assert s["points_per_100_pairs"] == pytest.approx(100 / 6 / 30 * 100, abs=1e-3)
    assert s["points_per_stage_hour"] == pytest.approx(100 / 6 / (160 / 3600), abs=1e-3)


def test_pooled_interval_and_one_exact_test_over_all_discordant_prompts(tmp_path):
    from scipy.stats import binomtest, t

    up = [True] * 6 + [False] * 14
    rows = [seeds.seed_summary(_run(tmp_path, 1, [False] * 20, up)),                     # +6 gained
            seeds.seed_summary(_run(tmp_path, 2, [False] * 20, up[:4] + [False] * 16)),  # +4
            seeds.seed_summary(_run(tmp_path, 3, [True] + [False] * 19, [False] + up[:6] + [False] * 13))]  # +6 -1
    pool = seeds.pooled(rows)
    assert (pool["gained"], pool["lost"]) == (16, 1)
    assert pool["exact_p"] == pytest.approx(binomtest(16, 17, 0.5).pvalue) and pool["exact_p"] < 0.001
    diffs = [0.30, 0.20, 0.25]
    m = sum(diffs) / 3
    sd = (sum((d - m) ** 2 for d in diffs) / 2) ** 0.5
    d = pool["ifeval_prompt_strict_diff"]
    assert d["mean"] == pytest.approx(m)
    assert d["hi"] - d["mean"] == pytest.approx(t.ppf(0.975, 2) * sd / 3 ** 0.5)
    assert pool["seeds_up"] == 3
    text = seeds.table(rows, pool, "rec")
    assert "16 gained, 1 lost" in text and text.count("\n| ") == 4  # header + 3 seeds (the separator has no space)
    assert pool["pairs"]["mean"] == 30 and "30 (95% CI 30..30) pairs in 160" in text
    assert "| 30 | 11.25 |" in text  # pairs and pairs per minute of a seed


def test_a_run_without_ifeval_is_refused_naming_the_file(tmp_path):
    run = _run(tmp_path, 1, [True], [True])
    (run / "iter_2" / "ifeval.jsonl").unlink()
    with pytest.raises(DataError, match=r"iter_2/ifeval\.jsonl: missing.*ifeval\.when"):
        seeds.seed_summary(run)


def test_seed_and_run_name_overrides_are_refused(capsys):
    assert seeds.main(["configs/loop.yaml", "seed=3", "--table-only"]) == 2
    assert "sets seed= and run_name= itself" in capsys.readouterr().err
    assert seeds.main(["configs/loop.yaml", "--seeds", "1", "1", "--table-only"]) == 2
    assert "given twice" in capsys.readouterr().err
    # a negative seed is refused here, not by numpy inside vLLM's engine start a minute into the run
    assert seeds.main(["configs/loop.yaml", "--seeds", "1", "-3"]) == 2
    assert "from 0 to" in capsys.readouterr().err


def test_a_variant_recipe_gets_its_own_run_names_and_overrides_may_follow_seeds(tmp_path, capsys):
    assert seeds.recipe_name("rec") == "rec"
    a, b = seeds.recipe_name("rec", ["dpo.training.beta=0.05"]), seeds.recipe_name("rec", ["dpo.training.beta=0.2"])
    assert a != b and a.startswith("rec_") and seeds.recipe_name("rec", ["x=1", "y=2"]) == seeds.recipe_name("rec", ["y=2", "x=1"])
    # words after --seeds with '=' are overrides; the variant's runs are looked for under its own name
    rc = seeds.main(["configs/loop.yaml", f"output_root={tmp_path}", "--seeds", "1", "dpo.training.beta=0.05",
                     "--table-only"])
    want = seeds.recipe_name("default", ["dpo.training.beta=0.05"]) + "_seed1"
    # where the runs live is not part of the recipe: the default's runs under another root keep their names
    assert seeds.recipe_name("default", [f"output_root={tmp_path}", "wandb=true"]) == "default"
    assert seeds.recipe_name("default", ["dpo.training.beta=0.05", f"output_root={tmp_path}"]) == \
        seeds.recipe_name("default", ["dpo.training.beta=0.05"])
    assert rc == 2 and f"{tmp_path / want}/metrics.jsonl: missing" in capsys.readouterr().err
    assert seeds.main(["configs/loop.yaml", "--seeds", "one", "--table-only"]) == 2
    assert "whole numbers" in capsys.readouterr().err


def test_table_only_refuses_a_run_planned_with_other_settings(tmp_path, capsys):
    import yaml

    from online_rlhf.loop import resolve
    from online_rlhf.loop.plan import run_config_dict

    run = _run(tmp_path, 1, [False] * 4, [True] * 4)
    run = run.rename(tmp_path / "default_seed1")
    args = ["configs/loop.yaml", f"output_root={tmp_path}", "--seeds", "1", "--table-only"]
    # no config.yaml: the run cannot be checked, so it is not tabulated
    assert seeds.main(args) == 2
    assert "default_seed1/config.yaml: missing" in capsys.readouterr().err
    cfg = run_config_dict(resolve("configs/loop.yaml", [f"output_root={tmp_path}", "seed=1", "run_name=default_seed1"]))
    (run / "config.yaml").write_text("# header\n" + yaml.safe_dump(cfg))
    assert seeds.main(args) == 0
    assert "1 seeds" in capsys.readouterr().out
    # a key newer than the run's config.yaml, at its default: the run was planned with that value
    (run / "config.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "kl_warn"}))
    assert seeds.main(args) == 0
    capsys.readouterr()
    # the same folder, planned with another seed and another K: refused, naming both keys
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "seed": 7, "generation": {**cfg["generation"], "k": 9}}))
    assert seeds.main(args) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "seed: run 7, recipe 1" in err and "generation.k: run 9, recipe 8" in err
    assert "2 key(s) differ" in err and "temperature" not in err  # the differing key, not the whole section


def test_overrides_after_table_only_are_taken_and_every_missing_seed_is_named(tmp_path, capsys):
    rc = seeds.main(["configs/loop.yaml", "--table-only", f"output_root={tmp_path}", "dpo.training.beta=0.05",
                     "--seeds", "1", "2"])
    err = capsys.readouterr().err
    name = seeds.recipe_name("default", ["dpo.training.beta=0.05"])
    assert rc == 2 and "2 of 2 seeds cannot be tabulated" in err
    assert f"{name}_seed1/metrics.jsonl: missing" in err and f"{name}_seed2/metrics.jsonl: missing" in err
    with pytest.raises(SystemExit):
        seeds.main(["configs/loop.yaml", "--table-only", "--bogus"])
    assert "--bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not taken as --seeds (it would tabulate one seed over the 3-seed table)
        seeds.main(["configs/loop.yaml", "--seed", "1", "--table-only", f"output_root={tmp_path}"])
    assert "unrecognized arguments: --seed 1" in capsys.readouterr().err
    assert not (tmp_path / "default_seeds").exists()


def test_a_relative_prompt_file_is_checked_as_run_loop_took_it(tmp_path, monkeypatch, capsys):
    """run_loop.sh makes a relative train_prompts= that exists where it runs absolute; the seeds
    command does the same, so the run's config.yaml matches, and the recipe keeps its name."""
    import yaml

    from online_rlhf.loop import resolve
    from online_rlhf.loop.plan import run_config_dict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text("{}\n")  # resolve only needs the file to exist
    assert seeds._as_run_loop_takes("train_prompts=mine.jsonl") == f"train_prompts={tmp_path / 'mine.jsonl'}"
    assert seeds._as_run_loop_takes("per_iteration.2.train_prompts=mine.jsonl") == \
        f"per_iteration.2.train_prompts={tmp_path / 'mine.jsonl'}"
    assert seeds._as_run_loop_takes("train_prompts=absent.jsonl") == "train_prompts=absent.jsonl"
    assert seeds._as_run_loop_takes("output_root=out") == f"output_root={tmp_path / 'out'}"
    name = seeds.recipe_name("default", ["train_prompts=mine.jsonl"])
    run = _run(tmp_path / "out", 1, [False] * 4, [True] * 4).rename(tmp_path / "out" / f"{name}_seed1")
    cfg = run_config_dict(resolve(str(PROJECT_ROOT / "configs/loop.yaml"),
                                  [f"output_root={tmp_path / 'out'}", f"train_prompts={tmp_path / 'mine.jsonl'}",
                                   "seed=1", f"run_name={run.name}"]))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rc = seeds.main(["configs/loop.yaml", "output_root=out", "train_prompts=mine.jsonl", "--seeds", "1", "--table-only"])
    assert rc == 0, capsys.readouterr().err
