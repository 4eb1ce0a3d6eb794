"""Stage: score every response of generated.jsonl -> rewards.jsonl (+ stats JSON).

    python annotate_data/get_rewards.py input=generated.jsonl output=rewards.jsonl source=verifier
    python annotate_data/get_rewards.py --config cfg.yaml source=reward_model reward_model=DIR batch_size=16
    # reward model, data-parallel on N processes (GPUs; on CPU add ACCELERATE_USE_CPU=true and --multi_gpu):
    accelerate launch --num_processes N annotate_data/get_rewards.py source=reward_model reward_model=DIR ...
    python annotate_data/get_rewards.py source=remote url=http://127.0.0.1:8000 ...    # annotate_data/reward_server.py
    python annotate_data/get_rewards.py source=judge url=http://127.0.0.1:8001/v1 judge_model=NAME ...

Output record = the generated record + ``rewards: [K float]`` (aligned with ``responses``) +
``reward_source``. A record its source cannot score is left out and counted by reason in the
stats (``skipped``); nothing is dropped silently. Config: ``RewardConfig`` (online_rlhf/stage_configs.py).

Every source module has the same entry point ``score(records, cfg) -> (rewards, stats)``:
``rewards[i]`` is a list of K floats for ``records[i]`` or ``None`` (unscorable), and
``stats["skipped"]`` (or ``stats["unscorable"]``) maps a reason to the number of ``None`` records
it explains; ``None`` records no reason accounts for are counted as ``unscorable_unspecified``.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time

from online_rlhf.config import ConfigError, run_main
from online_rlhf.jsonl import DataError, check_finite, iter_jsonl, write_json, write_jsonl
from online_rlhf.paths import setup_cache_env
from online_rlhf.records import validate_generated
from online_rlhf.stage_configs import RewardConfig

SOURCES = {
    "reward_model": "online_rlhf.reward_model",
    "remote": "online_rlhf.remote",
    "judge": "online_rlhf.judge",
    "verifier": "online_rlhf.verifiers",
}


def load_generated(path: str) -> list[dict]:
    """Read and check generated records; errors name file:line. Duplicate ids are an error."""
    records, seen = [], {}
    for ln, rec in iter_jsonl(path):
        where = f"{path}:{ln}"
        validate_generated(rec, where)
        if rec["id"] in seen:
            raise DataError(f"{where}: duplicate id {rec['id']!r} (first at line {seen[rec['id']]}). Re-run the merge of shards.")
        seen[rec["id"]] = ln
        records.append(rec)
    return records


def constant_reward_warning(records: list[dict], rewards: list[list[float]]) -> str | None:
    """A warning when all scored responses get the same reward although at least two of them differ.

    A reward model that returns one value for different texts is broken (reads a padding position,
    random head, wrong checkpoint); a verifier doing it means the prompts give no signal. Either way
    every prompt becomes a tie and no pair can be built.
    """
    texts = {r for rec in records for r in rec["responses"]}
    values = [x for rw in rewards for x in rw]
    if len(texts) < 2 or not values:
        return None
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-6 * max(1.0, abs(hi), abs(lo)):
        return (f"rewards are constant ({lo:.6g}) across {len(values)} responses with {len(texts)} distinct texts: "
                "the reward source gives no signal and every prompt will tie. Check the reward model / verifier.")
    return None


def main(cfg: RewardConfig) -> dict | None:
    setup_cache_env()
    t0 = time.time()
    records = load_generated(cfg.input)
    scorable = [r for r in records if r["responses"]]
    skipped: dict[str, int] = {}
    if len(scorable) < len(records):
        skipped["no_responses"] = len(records) - len(scorable)

    is_main, num_processes = True, 1
    if cfg.source == "reward_model":
        from online_rlhf.reward_model import distributed_state

        state = distributed_state()
        is_main, num_processes = state.is_main_process, state.num_processes
    else:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"source={cfg.source} runs in one process; only source=reward_model uses accelerate launch "
                              "with several processes.")

    source = importlib.import_module(SOURCES[cfg.source])
    rewards, src_stats = source.score(scorable, cfg) if scorable else ([], {})
    if not is_main:
        return None
    if len(rewards) != len(scorable):
        raise RuntimeError(f"source {cfg.source} returned {len(rewards)} results for {len(scorable)} records.")

    out, kept = [], []
    for rec, rw in zip(scorable, rewards):
        if rw is None:
            continue
        where = f"{cfg.input} (id={rec['id']!r})"
        if len(rw) != len(rec["responses"]):
            raise DataError(f"{where}: source {cfg.source} gave {len(rw)} rewards for {len(rec['responses'])} responses.")
        rw = [check_finite(x, f"{where}, response {j}") for j, x in enumerate(rw)]
        out.append({**rec, "rewards": rw, "reward_source": cfg.source})
        kept.append(rw)
    n_none = len(scorable) - len(out)
    # The source names its reasons under "skipped" (or "unscorable", as verifiers.py does).
    src_skipped = dict(src_stats.get("skipped") or src_stats.get("unscorable") or {})
    src_skipped = {k: int(v) for k, v in src_skipped.items() if v}
    explained = sum(src_skipped.values())
    if explained > n_none:
        raise RuntimeError(f"source {cfg.source} reports {explained} skipped records {src_skipped} but returned None for {n_none}.")
    if explained < n_none:  # the source did not account for every None: say so rather than lose count
        src_skipped["unscorable_unspecified"] = n_none - explained
    for k, v in src_skipped.items():
        skipped[k] = skipped.get(k, 0) + v

    if records and not out:
        raise DataError(f"{cfg.input}: no record could be scored by source={cfg.source} (skipped: {skipped}).")
    write_jsonl(cfg.output, out)

    values = [x for rw in kept for x in rw]
    warnings = []
    w = constant_reward_warning(out, kept)
    if w:
        warnings.append(w)
        print(f"WARNING: {w}", file=sys.stderr)
    stats = {
        "stage": "get_rewards",
        "input": cfg.input,
        "output": cfg.output,
        "source": cfg.source,
        "records_in": len(records),
        "records_scored": len(out),
        "records_skipped": sum(skipped.values()),
        "skipped": skipped,
        "responses_scored": len(values),
        "truncated_inputs": int(src_stats.get("truncated_inputs", 0)),
        "reward": {
            "mean": statistics.fmean(values) if values else None,
            "std": statistics.pstdev(values) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
        },
        "records_all_tied": sum(1 for rw in kept if len(rw) > 1 and max(rw) == min(rw)),
        "source_stats": src_stats,
        "warnings": warnings,
        "num_processes": num_processes,
        "seconds": round(time.time() - t0, 2),
    }
    assert stats["records_scored"] + stats["records_skipped"] == stats["records_in"]
    stats_path = cfg.stats_output or f"{cfg.output}.stats.json"
    write_json(stats_path, stats)
    print(f"get_rewards: {len(out)}/{len(records)} records scored by {cfg.source} -> {cfg.output} "
          f"(skipped {skipped or 0}; stats {stats_path})", file=sys.stderr)
    return stats


if __name__ == "__main__":
    run_main(main, RewardConfig)
