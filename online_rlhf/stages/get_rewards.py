"""Stage: score every response of generated.jsonl -> rewards.jsonl (+ stats JSON).

    python annotate_data/get_rewards.py input=generated.jsonl output=rewards.jsonl source=verifier
    python annotate_data/get_rewards.py --config cfg.yaml source=reward_model reward_model=DIR batch_size=16
    # reward model, data-parallel on N processes (GPUs; on CPU add ACCELERATE_USE_CPU=true and --multi_gpu):
    accelerate launch --num_processes N annotate_data/get_rewards.py source=reward_model reward_model=DIR ...
    python annotate_data/get_rewards.py source=remote url=http://127.0.0.1:8000 ...    # annotate_data/reward_server.py
    python annotate_data/get_rewards.py source=judge url=http://127.0.0.1:8001/v1 judge_model=NAME ...

Output record = the generated record + ``rewards: [K float | null]`` (aligned with ``responses``)
+ ``reward_source``. ``null`` marks one response its source could not score (e.g. a remote service
answered NaN for it): pairs and SFT data leave it out, the record's other responses still count.
A record its source cannot score at all is left out. Both are counted by reason in the stats
(``skipped`` for records, ``responses_unscored`` for responses) with up to 5 example ids per
reason (``examples``); nothing is dropped silently. Config: ``RewardConfig`` (online_rlhf/stage_configs.py).

Every source module has the same entry point ``score(records, cfg) -> ScoreResult``
(``online_rlhf.stats``): ``rewards[i]`` is a list of K values (float, or ``None`` for an unscored
response) for ``records[i]``, or ``None`` (the record is unscorable); ``skipped`` maps a reason to
the number of ``None`` records it explains, ``responses_unscored`` a cause to the number of ``None``
responses, ``examples`` a reason to example ids; what no reason accounts for is counted as
``unscorable_unspecified`` / ``unspecified``. The stats file is ``online_rlhf.stats.RewardStats``
at ``<output>.stats.json``.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
from collections import Counter
from typing import Optional

from online_rlhf.config import ConfigError, run_main
from online_rlhf.dry_run import dummy_ids, exit_if_out_of_memory, finish, out_of_memory_errors
from online_rlhf.jsonl import DataError, check_finite, iter_jsonl, write_jsonl
from online_rlhf.memory import PeakMemory
from online_rlhf.paths import setup_cache_env
from online_rlhf.records import validate_generated
from online_rlhf.stage_configs import RewardConfig
from online_rlhf.hardware import check_process_count
from online_rlhf.stats import DryRunStats, RewardStats, RewardSummary, ScoreResult, stats_path

# The scoring module of each reward source (online_rlhf.records.REWARD_SOURCES, in that order).
SOURCES = {
    "reward_model": "online_rlhf.reward_model",
    "verifier": "online_rlhf.verifiers",
    "remote": "online_rlhf.remote",
    "judge": "online_rlhf.judge",
}


def load_generated(path: str) -> list[dict]:
    """Read and check generated records; errors name file:line. Duplicate ids are an error."""
    return read_generated(path)[0]


def read_generated(path: str) -> tuple[list[dict], int]:
    """:func:`load_generated` and the number of blank lines skipped in the file (also noted on stderr)."""
    records, seen = [], {}
    lines = iter_jsonl(path)
    for ln, rec in lines:
        where = f"{path}:{ln}"
        validate_generated(rec, where)
        if rec["id"] in seen:
            raise DataError(f"{where}: duplicate id {rec['id']!r} (first at line {seen[rec['id']]}). Re-run the merge of shards.")
        seen[rec["id"]] = ln
        records.append(rec)
    return records, lines.blank_lines


MAX_EXAMPLES = 5  # example ids kept per reason in the stats


def constant_reward_warning(records: list[dict], rewards: list[list[float | None]]) -> str | None:
    """A warning when all scored responses get the same reward although at least two of them differ.

    A reward model that returns one value for different texts is broken (reads a padding position,
    random head, wrong checkpoint); a verifier doing it means the prompts give no signal. Either way
    every prompt becomes a tie and no pair can be built. Unscored (``None``) responses are ignored.
    """
    texts = {r for rec in records for r in rec["responses"]}
    values = [x for rw in rewards for x in rw if x is not None]
    if len(texts) < 2 or not values:
        return None
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-6 * max(1.0, abs(hi), abs(lo)):
        return (f"rewards are constant ({lo:.6g}) across {len(values)} responses with {len(texts)} distinct texts: "
                "the reward source gives no signal and every prompt will tie. Check the reward model / verifier.")
    return None


UNSCORED_WARN_FRACTION = 0.10  # more unscored responses than this fraction of all of them: warn


def unscored_warning(n_responses: int, n_unscored: int, causes: dict, skipped: dict, source: str,
                     stats_file: str) -> str | None:
    """A warning when more than :data:`UNSCORED_WARN_FRACTION` of the responses got no reward.

    Args:
        n_responses: responses in the input; n_unscored: those without a reward (a null in a kept
            record, or in a record left out).
        causes: responses unscored by cause; skipped: records left out by reason.
        source, stats_file: named in the message (where the examples per cause are).
    Returns:
        the message, or None at or under the threshold (or with no responses).
    """
    if not n_responses or n_unscored <= UNSCORED_WARN_FRACTION * n_responses:
        return None
    checks = {"verifier": "that the prompts carry the verifier's task fields (instruction_id_list + kwargs, or answer)",
              "reward_model": "the reward model's max_length and the truncated/too-long counts",
              "remote": "the service's log and the values it returns (NaN, null, errors)",
              "judge": "the judge's replies (parse failures) and its max_tokens"}
    return (f"{n_unscored} of {n_responses} responses ({100 * n_unscored / n_responses:.0f}%) have no reward from "
            f"source={source} (unscored by cause: {dict(causes) or 'none'}; records left out: {dict(skipped) or 'none'}). "
            f"They are left out of pairs and GRPO groups, so the update learns from fewer prompts. Check "
            f"{checks.get(source, 'the reward source')}, and the example ids per cause in {stats_file}.")


def _add_example(examples: dict, reason: str, text: str) -> None:
    bucket = examples.setdefault(reason, [])
    if len(bucket) < MAX_EXAMPLES:
        bucket.append(text)


def attach_rewards(scorable: list[dict], rewards: list, cfg: RewardConfig, examples: dict) -> tuple[list[dict], Counter]:
    """Rewards records from the source's results.

    ``rewards[i]`` is None (the source could not score ``scorable[i]``: left out, its id in
    ``examples["unscorable_records"]``) or one value per response, ``None`` for an unscored response
    (kept as ``null``; a record whose every response is unscored is left out as
    ``all_responses_unscored``).

    Returns:
        ``(records, skipped)``: the output records and the records left out here by reason.
    Raises:
        DataError: a result of the wrong length, or a reward that is NaN/inf/not a number.
    """
    out, skipped = [], Counter()
    for rec, rw in zip(scorable, rewards):
        where = f"{cfg.input} (id={rec['id']!r})"
        if rw is None:
            _add_example(examples, "unscorable_records", str(rec["id"]))
            continue
        if len(rw) != len(rec["responses"]):
            raise DataError(f"{where}: source {cfg.source} gave {len(rw)} rewards for {len(rec['responses'])} responses.")
        rw = [None if x is None else check_finite(x, f"{where}, response {j}") for j, x in enumerate(rw)]
        if all(x is None for x in rw):
            skipped["all_responses_unscored"] += 1
            _add_example(examples, "all_responses_unscored", str(rec["id"]))
            continue
        out.append({**rec, "rewards": rw, "reward_source": cfg.source})
    return out, skipped


def account(n_none: int, n_unscored: int, result: ScoreResult, source: str) -> tuple[dict, dict]:
    """Records and responses the source left unscored, by the reasons it gave.

    Args:
        n_none: records the source returned None for; n_unscored: None entries in its reward lists.
        result: the source's result: record reasons in ``skipped``, response causes in
            ``responses_unscored``.
    Returns:
        ``(records skipped by reason, responses unscored by cause)``; what the source leaves
        unexplained is counted as ``unscorable_unspecified`` / ``unspecified``.
    Raises:
        RuntimeError: the source claims more than it returned.
    """
    out = []
    for given, n, rest in ((result.skipped, n_none, "unscorable_unspecified"),
                           (result.responses_unscored, n_unscored, "unspecified")):
        counts = {k: int(v) for k, v in given.items() if v}
        explained = sum(counts.values())
        if explained > n:
            raise RuntimeError(f"source {source} reports {explained} unscored {counts} but returned None for {n}.")
        if explained < n:  # the source did not account for every None: say so rather than lose count
            counts[rest] = n - explained
        out.append(counts)
    return out[0], out[1]


def _all_tied(rw: list[float]) -> bool:
    return len(rw) > 1 and max(rw) == min(rw)


def _reward_summary(values: list[float]) -> RewardSummary:
    if not values:
        return RewardSummary(mean=None, std=None, min=None, max=None)
    return RewardSummary(mean=statistics.fmean(values), std=statistics.pstdev(values), min=min(values), max=max(values))


def _leave_together(state) -> None:
    """Barrier, then tear the process group down on every rank and free what still refers to it
    while the interpreter is fully alive. Without it a rank other than the main one exits while
    gloo's threads still hold work (and tensors) of the last collectives, and that rank can die at
    exit with SIGABRT ("terminate called without an active exception"), failing a run that scored
    everything (CI saw it twice in test_reward_model_scoring_on_two_machines_equals_one_machine;
    pytorch/pytorch PR 179291 describes the same teardown order)."""
    import gc

    import torch.distributed as dist

    state.wait_for_everyone()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _exit_non_main() -> None:
    """A non-main rank has nothing left to write once the scores are gathered: flush and leave
    with status 0 without the interpreter's teardown, where the SIGABRT above happens."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _score(cfg: RewardConfig, scorable: list[dict]) -> tuple[ScoreResult, bool, int]:
    """Run the configured source. Returns ``(its result, is_main_process, num_processes)``.

    Raises:
        ConfigError: several processes for a source other than reward_model.
        TypeError: the source returned something other than a ``ScoreResult``.
        RuntimeError: the source returned one result per record too many or too few.
    """
    is_main, num_processes = True, 1
    if cfg.source == "reward_model":
        from online_rlhf.reward_model import distributed_state

        state = distributed_state()
        is_main, num_processes = state.is_main_process, state.num_processes
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"source={cfg.source} runs in one process; only source=reward_model uses accelerate launch "
                          "with several processes.")
    source = importlib.import_module(SOURCES[cfg.source])
    result = source.score(scorable, cfg) if scorable else ScoreResult(rewards=[])
    if num_processes > 1:
        _leave_together(state)
    if not isinstance(result, ScoreResult):
        raise TypeError(f"source {cfg.source}: score() returned {type(result).__name__}, not a ScoreResult.")
    if is_main and len(result.rewards) != len(scorable):
        raise RuntimeError(f"source {cfg.source} returned {len(result.rewards)} results for {len(scorable)} records.")
    return result, is_main, num_processes


def construct(cfg: RewardConfig) -> None:
    """The stage's environment (caches) and its process-count check, before anything is read.

    Raises:
        ConfigError: the run has another process count than the config was planned for.
    """
    setup_cache_env()
    check_process_count(cfg.num_processes, f"rewards (source={cfg.source})")


def read_input(cfg: RewardConfig) -> tuple[list[dict], int, list[dict], dict[str, list[str]], Counter]:
    """The generated records and what can be scored of them.

    Returns:
        ``(records, blank lines skipped, scorable records (those with responses), examples,
        skipped)``: ``skipped`` counts the records without responses (``no_responses``),
        ``examples`` holds their ids.
    Raises:
        DataError: a malformed record, or an input without records (nothing is written).
    """
    records, blank_lines = read_generated(cfg.input)
    if not records:  # an empty result is a failure (exit 2), not an empty rewards file the next stage trips over
        raise DataError(f"{cfg.input}: no generated record to score ({blank_lines} blank lines); nothing was written. "
                        f"See why the generation stage wrote none in {stats_path(cfg.input)} (skipped prompts), or "
                        "give it prompts.")
    scorable = [r for r in records if r["responses"]]
    examples: dict[str, list[str]] = {}
    skipped: Counter = Counter()
    for r in records:
        if not r["responses"]:
            skipped["no_responses"] += 1
            _add_example(examples, "no_responses", str(r["id"]))
    return records, blank_lines, scorable, examples, skipped


def collect(cfg: RewardConfig, records: list[dict], scorable: list[dict], result: ScoreResult,
            examples: dict[str, list[str]], skipped: Counter) -> tuple[list[dict], dict]:
    """The scored records (``rewards`` and ``reward_source`` attached) and the unscored responses by
    cause; ``skipped`` and ``examples`` get the source's and this stage's reasons.

    Raises:
        DataError: no record could be scored.
    """
    rewards = result.rewards
    out, own_skips = attach_rewards(scorable, rewards, cfg, examples)
    n_unscored = sum(x is None for rw in rewards if rw is not None for x in rw)
    src_skipped, unscored = account(sum(rw is None for rw in rewards), n_unscored, result, cfg.source)
    skipped.update(src_skipped)
    skipped.update(own_skips)
    for cause, ids in result.examples.items():
        for text in ids:
            _add_example(examples, cause, text)
    if records and not out:
        raise DataError(f"{cfg.input}: no record could be scored by source={cfg.source} (skipped: {dict(skipped)}; "
                        f"unscored responses: {unscored}; e.g. {examples}).")
    return out, unscored


def write_stats(cfg: RewardConfig, records: list[dict], blank_lines: int, out: list[dict], skipped: Counter,
                unscored: dict, examples: dict, result: ScoreResult, num_processes: int, t0: float) -> RewardStats:
    """Warn (stderr and the stats' ``warnings``), write ``<output>.stats.json`` and print the summary line."""
    kept = [r["rewards"] for r in out]
    values = [x for rw in kept for x in rw if x is not None]
    n_responses = sum(len(r["responses"]) for r in records)
    warnings = [w for w in [constant_reward_warning(out, kept),
                            unscored_warning(n_responses, n_responses - len(values), unscored, skipped, cfg.source,
                                             str(stats_path(cfg.output)))] if w]
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    stats = RewardStats(
        stage="get_rewards", input=cfg.input, output=cfg.output, source=cfg.source,
        records_in=len(records), records_scored=len(out), records_skipped=sum(skipped.values()),
        skipped=dict(skipped), responses_scored=len(values),
        responses_unscored=unscored,  # null in the output's rewards (or in a left-out record), by cause
        examples=examples, truncated_inputs=result.truncated_inputs, reward=_reward_summary(values),
        records_all_tied=sum(1 for rw in kept if _all_tied([x for x in rw if x is not None])),
        source_stats=result.source_stats, warnings=warnings, num_processes=num_processes,
        hardware=result.hardware, seconds=round(time.time() - t0, 2), input_blank_lines=blank_lines,
    )
    assert stats.records_scored + stats.records_skipped == stats.records_in
    stats_file = stats.write(stats_path(cfg.output))
    print(f"get_rewards: {len(out)}/{len(records)} records scored by {cfg.source} -> {cfg.output} "
          f"(skipped {dict(skipped) or 0}; unscored responses {unscored or 0}; stats {stats_file})", file=sys.stderr)
    return stats


def main(cfg: RewardConfig) -> RewardStats | None:
    """Score ``cfg.input`` into ``cfg.output`` and write the stats (:class:`~online_rlhf.stats.RewardStats`)
    to ``<output>.stats.json``; returns them on the main process (the others leave through
    :func:`_exit_non_main` once the scores are gathered). Warnings (constant rewards; more than 10%
    of the responses unscored, with the causes and what to check) go to stderr and the stats'
    ``warnings``. With ``cfg.dry_run``: :func:`dry_run` instead.

    Order: :func:`construct`, :func:`read_input`, the source's scoring, :func:`collect`, the
    output file, :func:`write_stats`.

    Raises:
        DataError: a malformed input record, a bad reward value, an input without records, or no
            record could be scored.
    """
    if cfg.dry_run:  # one max-length batch of the reward model; the input is not read, nothing written but the result
        return dry_run(cfg)
    construct(cfg)
    t0 = time.time()
    records, blank_lines, scorable, examples, skipped = read_input(cfg)
    result, is_main, num_processes = _score(cfg, scorable)
    if not is_main:
        _exit_non_main()
    out, unscored = collect(cfg, records, scorable, result, examples, skipped)
    write_jsonl(cfg.output, out)
    return write_stats(cfg, records, blank_lines, out, skipped, unscored, examples, result, num_processes, t0)


def dry_run(cfg: RewardConfig) -> Optional[DryRunStats]:
    """The rewards stage's dry run (``dry_run=true``): :func:`construct`, then the reward model
    scores one batch of ``batch_size`` dummy inputs of ``max_length`` tokens; writes
    :class:`~online_rlhf.stats.DryRunStats` beside ``cfg.output`` (``online_rlhf.dry_run.finish``).
    The input is not read and nothing else is written. A source other than ``reward_model`` loads
    no model: prints so and writes nothing.

    Raises:
        SystemExit(1): the batch ran out of (GPU) memory, after the result was written.
    """
    construct(cfg)
    t_start = time.perf_counter()
    if cfg.source != "reward_model":
        print(f"dry run rewards: source={cfg.source} loads no model here; nothing to check.")
        return None
    import torch

    from online_rlhf.hardware import stage_threads
    from online_rlhf.reward_model import RewardModel, distributed_state

    state = distributed_state()
    if state.device.type == "cpu":
        torch.set_num_threads(stage_threads(state.num_processes))
    status, error, step_s, length = "ok", None, None, cfg.max_length
    with PeakMemory(state.device.type) as mem:
        try:
            rm = RewardModel(cfg.reward_model, dtype=cfg.dtype, device=state.device, max_length=cfg.max_length)
            length = rm.max_length
            seqs = dummy_ids(rm.tokenizer, cfg.batch_size, length, seed=4)
            t0 = time.perf_counter()
            rm.score_ids(seqs, cfg.batch_size)
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        except out_of_memory_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {"batch_size": cfg.batch_size, "max_length": cfg.max_length, "dtype": cfg.dtype,
                "num_processes": state.num_processes}
    step = f"1 batch: {cfg.batch_size} inputs x {length} tokens, forward (no grad) per process"
    result = finish("rewards", mem, cfg.output, status=status, error=error, step_s=step_s, step=step,
                    shapes={"inputs": cfg.batch_size, "tokens": length}, settings=settings, t_start=t_start)
    exit_if_out_of_memory("rewards", status, error)
    return result


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(main, RewardConfig)


if __name__ == "__main__":
    cli()
