"""Merge the W shard files of the generation stage into one ``generated.jsonl`` (+ one stats JSON).

    .venv-infer/bin/python generation/merge_data.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated.jsonl num_shards=W [shards_dir=runs/x/iter_1/generated]

Same keys as ``generation/generate.py`` (``GenerateConfig``); ``generation/launch.py`` calls
:func:`merge_shards` after its shards finish. Shard r is ``<shards_dir>/shard_{r:02d}.jsonl``
with its stats ``shard_{r:02d}.jsonl.stats.json`` beside it.

Where the expected ids come from: the prompt set is read again with the same
``prompts``/``prompt_split``/``prompt_field``/``limit`` (the source of truth), and each shard's
stats lists the ids it skipped (``skipped_ids``, e.g. too long). Every prompt id must then be in
exactly one shard file or one shard's skipped list; anything else is a DataError naming the file.
Output order: the prompt set's order (not the shard layout), so the merged file is the same for
any W.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path


from .generate import summarize
from online_rlhf.config import run_main
from online_rlhf.hardware import slow_dtype_warning
from online_rlhf.jsonl import DataError, iter_jsonl, write_jsonl
from online_rlhf.records import load_prompt_set, validate_generated
from online_rlhf.stage_configs import GenerateConfig
from online_rlhf.stats import GenerateShardStats, GenerateStats, ShardSummary, stats_path


def default_shards_dir(output: str | Path) -> Path:
    """``generated.jsonl`` -> ``generated/`` (the run directory layout in docs/run-directory.md)."""
    out = Path(output)
    return out.with_suffix("") if out.suffix == ".jsonl" else out.parent / (out.name + "_shards")


def shards_dir_of(cfg: GenerateConfig) -> Path:
    return Path(cfg.shards_dir) if cfg.shards_dir else default_shards_dir(cfg.output)


def shard_path(shards_dir: str | Path, shard_index: int) -> Path:
    """``<shards_dir>/shard_{r:02d}.jsonl``."""
    return Path(shards_dir) / f"shard_{shard_index:02d}.jsonl"


def read_shards(cfg: GenerateConfig, order: dict[str, int]
                ) -> tuple[dict[str, dict], dict[str, str], dict[str, str], list[GenerateShardStats]]:
    """Read and check every shard file and its stats.

    Args:
        order: the prompt set's ids and their positions.
    Returns:
        ``(records by id, where each id is (file:line, or the stats that list it as skipped),
        skipped ids -> reason, each shard's stats)``.
    Raises:
        DataError: as :func:`merge_shards`, for one shard.
    """
    shards_dir, w = shards_dir_of(cfg), cfg.num_shards
    by_id: dict[str, dict] = {}
    where: dict[str, str] = {}
    skipped: dict[str, str] = {}
    shard_stats = []
    for r in range(w):
        path = shard_path(shards_dir, r)
        shard_stats_path = stats_path(path)
        if not path.is_file():
            raise DataError(f"{path}: shard {r} of {w} is missing. Rerun generation for it (generation/launch.py "
                            f"resumes finished shards) or check num_shards={w}.")
        if not shard_stats_path.is_file():
            raise DataError(f"{shard_stats_path}: stats of shard {r} missing (it lists the shard's skipped prompts). "
                            "Rerun that shard.")
        st = GenerateShardStats.read(shard_stats_path)
        if st.shard_index != r or st.num_shards != w:
            raise DataError(f"{shard_stats_path}: written as shard {st.shard_index} of {st.num_shards}, "
                            f"expected shard {r} of {w}. Remove the stale shard files and rerun.")
        shard_stats.append(st)
        for lineno, rec in iter_jsonl(path):
            at = f"{path}:{lineno}"
            validate_generated(rec, at)
            rid = rec["id"]
            if rid in where:
                raise DataError(f"{at}: id {rid!r} is duplicated (also at {where[rid]}). Each prompt must be in "
                                "exactly one shard; remove stale shard files and rerun.")
            if rid not in order:
                raise DataError(f"{at}: id {rid!r} is not in the prompt set {cfg.prompts} (limit={cfg.limit}). "
                                "The shards were made from another prompt set.")
            where[rid], by_id[rid] = at, rec
        for rid, reason in st.skipped_ids.items():
            if rid in where:
                raise DataError(f"{shard_stats_path}: id {rid!r} is listed as skipped but also generated at {where[rid]}.")
            where[rid], skipped[rid] = f"{shard_stats_path} (skipped: {reason})", reason
    return by_id, where, skipped, shard_stats


def merge_shards(cfg: GenerateConfig) -> GenerateStats:
    """Merge ``num_shards`` shard files into ``cfg.output`` in prompt-set order; write merged stats.

    Returns:
        the merged stats (also written to ``stats_path(cfg.output)``: ``<output>.stats.json``).
    Raises:
        DataError: a shard file or its stats is missing or invalid (not :class:`GenerateShardStats`),
            a record is malformed, an id is
            duplicated (names both places), unknown to the prompt set, or missing from every
            shard (names the shard that should hold it).
    """
    shards_dir, w = shards_dir_of(cfg), cfg.num_shards
    prompts, prompt_counts = load_prompt_set(cfg.prompts, cfg.prompt_split, cfg.prompt_field, cfg.limit)
    order = {p["id"]: i for i, p in enumerate(prompts)}

    by_id, where, skipped, shard_stats = read_shards(cfg, order)

    missing = [p["id"] for p in prompts if p["id"] not in where]
    if missing:
        first = ", ".join(f"{rid!r} (shard {order[rid] % w})" for rid in missing[:5])
        raise DataError(f"{shards_dir}: {len(missing)} prompt id(s) of {cfg.prompts} are in no shard: {first}"
                        f"{' ...' if len(missing) > 5 else ''}. Rerun those shards.")

    records = sorted(by_id.values(), key=lambda rec: order[rec["id"]])
    summary = summarize(records)
    gen_s = [s.generation_s for s in shard_stats if s.generation_s]
    start_s = [s.engine_startup_s for s in shard_stats if s.engine_startup_s is not None]  # 0.0: a shared engine
    replaced: Counter = Counter()
    special: Counter = Counter({"prompts": 0, "responses": 0})
    for s in shard_stats:
        replaced.update(s.input_fields_replaced)
        special.update(s.special_token_text)
    # device, dtype, threads and CPU of the first shard (all shards share them)
    hardware = shard_stats[0].hardware if shard_stats else None
    slow = slow_dtype_warning(hardware) if hardware else None
    stats = GenerateStats(
        stage="generate", num_shards=w, model=shard_stats[0].model if shard_stats else None,
        adapter=shard_stats[0].adapter if shard_stats else None, prompts=cfg.prompts,
        prompts_in=len(prompts), skipped=dict(Counter(skipped.values())), skipped_ids=skipped,
        records_out=len(records), **{k: v for k, v in summary.items() if k not in ("records", "warnings")},
        warnings=[*summary["warnings"], *([slow] if slow else [])],
        input_fields_replaced=dict(replaced), special_token_text=dict(special),
        response_ids_differ_from_text=sum(s.response_ids_differ_from_text for s in shard_stats), k=cfg.k,
        prompt_tokens=(None if any(s.prompt_tokens is None for s in shard_stats)
                       else sum(s.prompt_tokens for s in shard_stats)),
        # shards run side by side: wall time is the slowest shard's
        engine_startup_s=max(start_s) if start_s else None,
        engine_shared_with=next((s.engine_shared_with for s in shard_stats if s.engine_shared_with), None),
        generation_s=max(gen_s) if gen_s else None,
        generated_tokens_per_s=round(summary["generated_tokens"] / max(gen_s), 1) if gen_s else None,
        hardware=hardware,
        shards=[ShardSummary(**{k: getattr(s, k) for k in ShardSummary.model_fields}) for s in shard_stats],
        prompts_blank_lines=prompt_counts.blank_lines,
        prompts_assistant_turns_removed=prompt_counts.assistant_turns_removed,
        phase_s=({k: max(s.phase_s[k] for s in shard_stats) for k in shard_stats[0].phase_s}
                 if shard_stats and all(s.phase_s for s in shard_stats) else None),
    )
    write_jsonl(cfg.output, records)
    stats.write(stats_path(cfg.output))
    print(f"[merge] {w} shard(s) -> {cfg.output}: {len(records)} records, skipped {stats.skipped or 'none'}.")
    for warning in stats.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    return stats


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    run_main(merge_shards, GenerateConfig)


if __name__ == "__main__":
    cli()
