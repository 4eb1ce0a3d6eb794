"""Generation stage, one shard: K sampled responses per prompt from the policy, with vLLM.

    .venv-infer/bin/python generation/generate.py [--config FILE] prompts=P.jsonl \
        output=runs/x/iter_1/generated/shard_00.jsonl shard_index=0 num_shards=1 k=4 ...

Keys: ``online_rlhf.stage_configs.GenerateConfig`` (``-h`` lists them). ``generation/launch.py``
runs W of these (one per GPU) and merges them with ``generation/merge_data.py``.

What happens, top to bottom:
1. load the prompt set (``online_rlhf.records.load_prompt_set``) and take shard r of W:
   ``prompts[r::W]``, so the W shards hold every prompt exactly once for any N;
2. build each prompt's token ids once with the policy's own chat template, BOS exactly once,
   message contents as plain text: a special-token string such as ``<|im_end|>`` inside a prompt
   stays text and cannot open a turn (:func:`prompt_token_ids`); prompts longer than
   ``max_model_len - max_tokens`` tokens are skipped and counted (``skipped_ids`` in the stats,
   which merge_data.py reads);
3. resume: when the output and its stats already hold exactly this shard's records for this
   config (same fingerprint), nothing is regenerated;
4. start vLLM (``LLM(seed=seed + shard_index)``: vLLM-CPU kills its worker on per-request seeds)
   and sample ``n=k`` responses per prompt from the token ids, stopping at every
   EOS id of the tokenizer and of ``generation_config.json``. The seed does not make a rerun
   sample the same responses: vLLM-CPU's draws also depend on how requests were batched, which
   depends on timing (seen in tests/test_generation.py); hence resume keeps finished shards.
   With the engine in this process (one CPU shard) the random state is set to the seed's right
   before decoding, as a fresh engine has it, and the same seed gives the same samples;
5. write ``{id, prompt, responses, finish_reasons, response_tokens, prompt_tokens, ...task
   fields}`` per prompt (atomically, in shard order) and a stats JSON with every count and timing,
   including ``special_token_text`` (prompts and responses holding a special-token string, kept as
   text) and ``response_ids_differ_from_text`` (responses whose sampled ids are not what their text
   tokenizes to; later stages see only the text).

The engine itself (its dtype, start, sharing, one decode, the process's exit after it) is
``online_rlhf.stages.vllm_engine``.

Several ``--config FILE [key=value ...]`` groups co-decode (:func:`main_many`,
``online_rlhf.co_decode``): this shard of each config in turn on one engine start, each with its
own resume, output and stats.

All of it happens while holding ``<output>.lock`` (``shard_00.lock``; an ``fcntl.flock`` that holds
the pid): a second process for the same output refuses to start and names the first one's pid,
so a shard left running can never overwrite a newer output.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from online_rlhf.chat_tokens import ChatTokenError, chat_token_ids, count_special_texts, messages_have_special_text
from online_rlhf.config import ConfigError, run_main
from online_rlhf.dry_run import dummy_ids, exit_if_out_of_memory, finish
from online_rlhf.hardware import describe, describe_line, slow_dtype_warning
from online_rlhf.jsonl import DataError, iter_jsonl, write_jsonl
from online_rlhf.memory import PeakMemory
from online_rlhf.pairs import distinct_texts, low_diversity_warning
from online_rlhf.paths import setup_cache_env
from online_rlhf.procs import LockHeld, exclusive_lock
from online_rlhf.records import load_prompt_set, load_prompts
from online_rlhf.rundir import fingerprint
from online_rlhf.stage_configs import GenerateConfig
from online_rlhf.stats import DryRunStats, GenerateShardStats, stats_path
from online_rlhf.stages.vllm_engine import (SharedEngine, build_engine, engine_dtype, engine_in_this_process,
                                            engine_out_of_memory, exit_without_teardown, import_seconds,
                                            reset_import_seconds, run_engine)

# Fields this stage writes; a prompt's task field with one of these names is replaced (and counted).
GENERATED_KEYS = ("id", "prompt", "responses", "finish_reasons", "response_tokens", "prompt_tokens",
                  "prompt_token_ids", "response_token_ids")
# Config fields that change only resources, not what is sampled: left out of the resume fingerprint.
_NOT_IN_FINGERPRINT = {"output", "shards_dir", "kv_cache_gb", "gpu_memory_utilization"}

# The phases of a shard's wall time in its stats' phase_s (online_rlhf.stats), in order.
PHASES = ("process", "prompts", "engine_import", "engine_start", "decode", "write")

# Which machine runs a shard and how long machine 0 waits for it (launch.py) do not change what is sampled either.
_NOT_IN_FINGERPRINT |= {"num_machines", "machine_rank", "merge_wait_s"}


def shard_prompts(prompts: Sequence[dict], shard_index: int, num_shards: int) -> list[dict]:
    """Shard r of W: ``prompts[r::W]`` (prompts r, r+W, r+2W, ...).

    The W shards are disjoint and together hold every prompt exactly once, whatever
    ``len(prompts) mod W``; a shard may be empty when there are fewer prompts than shards.

    Raises:
        ConfigError: ``shard_index`` not in ``[0, num_shards)``.
    """
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ConfigError(f"shard_index={shard_index} must be in [0, num_shards={num_shards}).")
    return list(prompts[shard_index::num_shards])


def prompt_token_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt, as the policy will see them: BOS exactly once, contents as text.

    ``online_rlhf.chat_tokens.chat_token_ids(messages, add_generation_prompt=True)``: the policy's
    own chat template; only the special tokens the template writes are special ids, a
    special-token string inside a message (``<|im_end|>`` in a user turn) is tokenized as text
    and cannot open a new turn. When the template writes the BOS token itself (Llama-3 style) no
    second one is added; otherwise the tokenizer decides whether a BOS goes first (Llama-2/Mistral
    add one, Qwen/SmolLM do not); a doubled leading BOS is collapsed to one.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        messages: ``[{role, content}, ...]`` ending with a user turn.
    Returns:
        list of int token ids (length = prompt tokens).
    Raises:
        ConfigError: the tokenizer has no chat template.
        ChatTokenError: a message holds a special-token string and the template rewrites message
            contents beyond stripping whitespace (the contents cannot be located as text).
    """
    return chat_token_ids(tokenizer, messages, add_generation_prompt=True)


def stop_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """Every EOS id of the policy: ``tokenizer.eos_token_id`` plus ``generation_config.eos_token_id``
    (an int or a list; Llama-3 instruct lists both ``<|eot_id|>`` and ``<|end_of_text|>``).

    A checkpoint without ``generation_config.json`` contributes only the tokenizer's EOS.
    """
    from transformers import GenerationConfig

    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        gen_eos = None
    if gen_eos is not None:
        ids.extend(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return sorted(set(ids))


def tokenize_shard(tokenizer: Any, prompts: Sequence[dict], max_prompt_tokens: int
                   ) -> tuple[list[tuple[dict, list[int]]], dict[str, str]]:
    """Token ids of each prompt; prompts over ``max_prompt_tokens`` are set aside.

    Returns:
        ``(kept, skipped)``: kept is ``[(prompt record, token ids)]`` in shard order; skipped maps
        ``id -> reason``: ``"too_long"``, or ``"special_text_not_tokenizable"`` (a message holds a
        special-token string and the template rewrites message contents, see :func:`prompt_token_ids`;
        a warning names the prompt).
    """
    kept, skipped = [], {}
    for rec in prompts:
        try:
            ids = prompt_token_ids(tokenizer, rec["prompt"])
        except ChatTokenError as e:
            skipped[rec["id"]] = "special_text_not_tokenizable"
            print(f"warning: prompt {rec['id']!r} skipped: {e}", file=sys.stderr)
            continue
        if len(ids) > max_prompt_tokens:
            skipped[rec["id"]] = "too_long"
        else:
            kept.append((rec, ids))
    return kept, skipped


def shard_fingerprint(cfg: GenerateConfig, model_path: str) -> str:
    """Hash of what decides this shard's output: the sampling config, the prompt file, the model
    files (the LoRA adapter's too)."""
    conf = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in _NOT_IN_FINGERPRINT}
    inputs = [p for p in (model_path, cfg.adapter, cfg.prompts) if p and Path(p).exists()]
    return fingerprint(conf, inputs)


def split_adapter(cfg: GenerateConfig) -> tuple[GenerateConfig, str]:
    """``(cfg, the base model's resolved path)``: a ``model`` that is a LoRA adapter folder is taken
    apart into its base (``model``) and itself (``adapter``; :func:`online_rlhf.adapters.split_model`).

    Raises:
        FileNotFoundError: ``adapter`` is not an adapter folder; ConfigError: both are adapters.
    """
    from online_rlhf.adapters import split_model

    base, adapter = split_model(cfg.model, cfg.adapter)
    if adapter != cfg.adapter:
        cfg = cfg.model_copy(update={"model": base, "adapter": adapter})
    return cfg, base


def existing_output_status(output: Path, stats_path: Path, expected_ids: list[str], k: int,
                           config_fingerprint: str) -> tuple[bool, str]:
    """Whether ``output`` already holds this shard's complete result (for resume).

    Complete means: the stats file (:class:`~online_rlhf.stats.GenerateShardStats`) records the same
    config fingerprint, and the output has one record per expected id, in order, each with ``k`` responses.

    Returns:
        ``(complete, reason)``; reason says why not (for the log).
    """
    if not output.exists():
        return False, "no output yet"
    try:
        stats = GenerateShardStats.read(stats_path)
    except (FileNotFoundError, DataError) as e:  # missing or from another version: regenerate
        return False, f"stats file unreadable ({e})"
    if stats.config_fingerprint != config_fingerprint:
        return False, "it was made with another config, model or prompt file"
    ids = []
    try:
        for _, rec in iter_jsonl(output):
            if len(rec.get("responses") or []) != k:
                return False, f"record {rec.get('id')!r} has not {k} responses"
            ids.append(rec.get("id"))
    except DataError as e:
        return False, f"unreadable ({e})"
    if ids != expected_ids:
        return False, f"it holds {len(ids)} records, this shard expects {len(expected_ids)}"
    return True, "complete"


def to_record(prompt_rec: dict, output: Any, save_token_ids: bool = False) -> tuple[dict, list[str]]:
    """One generated record from a prompt record and vLLM's ``RequestOutput``.

    ``response_tokens`` counts the generated tokens, the final EOS included; ``prompt_tokens``
    the prompt tokens the engine received. With ``save_token_ids`` the record also holds
    ``prompt_token_ids`` (list of ints) and ``response_token_ids`` (K lists of ints, as sampled).

    Returns:
        ``(record, replaced)``: replaced lists task fields dropped because their name is one
        this stage writes (e.g. a generated file reused as a prompt set).
    """
    rec = {
        "id": prompt_rec["id"],
        "prompt": prompt_rec["prompt"],
        "responses": [c.text for c in output.outputs],
        "finish_reasons": [str(c.finish_reason) for c in output.outputs],
        "response_tokens": [len(c.token_ids) for c in output.outputs],
        "prompt_tokens": len(output.prompt_token_ids),
    }
    if save_token_ids:
        rec["prompt_token_ids"] = [int(t) for t in output.prompt_token_ids]
        rec["response_token_ids"] = [[int(t) for t in c.token_ids] for c in output.outputs]
    replaced = [key for key in prompt_rec if key in GENERATED_KEYS[2:]]
    rec.update({key: v for key, v in prompt_rec.items() if key not in GENERATED_KEYS})
    return rec, replaced


def summarize(records: Sequence[dict]) -> dict:
    """Response statistics of generated records (used per shard and after the merge).

    Returns:
        dict with ``records``, ``responses``, ``finish_reasons`` (counts), ``empty_responses``,
        ``generated_tokens``, ``mean_response_tokens``, ``prompts_all_distinct`` (prompts whose K
        responses are pairwise different), ``mean_distinct_responses`` (per prompt),
        ``prompts_fewer_than_2_distinct`` (prompts with K >= 2 but fewer than 2 different non-empty
        texts: no pair possible) and ``warnings`` (when those are most prompts).
    """
    finish = Counter(f for r in records for f in r["finish_reasons"])
    n_resp = sum(len(r["responses"]) for r in records)
    tokens = sum(sum(r.get("response_tokens", [])) for r in records)
    distinct = [len(set(r["responses"])) for r in records]
    sampled = [r for r in records if len(r["responses"]) >= 2]
    low = sum(distinct_texts(r["responses"]) < 2 for r in sampled)
    warning = low_diversity_warning(len(sampled), low, "generation")
    return {
        "records": len(records),
        "responses": n_resp,
        "finish_reasons": dict(sorted(finish.items())),
        "empty_responses": sum(1 for r in records for s in r["responses"] if not s.strip()),
        "generated_tokens": tokens,
        "mean_response_tokens": round(tokens / n_resp, 2) if n_resp else None,
        "prompts_all_distinct": sum(1 for d, r in zip(distinct, records) if d == len(r["responses"])),
        "mean_distinct_responses": round(sum(distinct) / len(distinct), 3) if distinct else None,
        "prompts_fewer_than_2_distinct": low,
        "warnings": [warning] if warning else [],
    }


def special_text_counts(tokenizer: Any, records: Sequence[dict]) -> dict:
    """How many prompts and responses contain a special-token string of the policy's tokenizer.

    Such strings are tokenized as text (:func:`prompt_token_ids`; the reward model and DPO do the
    same with responses), so they are kept, and counted here.

    Returns:
        ``{"prompts": n records whose prompt has one in any message, "responses": n responses}``.
    """
    return {"prompts": sum(1 for r in records if messages_have_special_text(tokenizer, r["prompt"])),
            "responses": count_special_texts(tokenizer, (s for r in records for s in r["responses"]))}


def response_ids_differ_from_text(tokenizer: Any, outputs: Sequence[Any], stop_ids: Sequence[int]) -> int:
    """How many sampled responses have token ids other than the tokenization of their text.

    Later stages see a response only as text and tokenize it again (contents as plain text:
    ``tokenizer(text, add_special_tokens=False, split_special_tokens=True)``); this counts the
    responses for which that does not give back the sampled ids (less a final stop id): the
    sampler took a non-canonical split of the text, generated a special id that vLLM leaves out
    of the text, or was cut inside a multi-byte character.
    """
    stops = set(stop_ids)
    n = 0
    for out in outputs:
        for c in out.outputs:
            ids = list(c.token_ids)
            if ids and ids[-1] in stops:
                ids = ids[:-1]
            text_ids = tokenizer(c.text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if c.text else []
            n += list(text_ids) != ids
    return n


def lock_path_of(cfg: GenerateConfig) -> Path:
    """The lock a running shard holds: ``<output without .jsonl>.lock`` (``shard_00.jsonl`` -> ``shard_00.lock``)."""
    return Path(cfg.output).with_suffix(".lock")


def main(cfg: GenerateConfig) -> GenerateShardStats:
    """Generate this shard's records, holding the shard's lock file the whole time (a second writer
    of the same output is refused, naming the pid that holds it); returns the stats that were written
    (``stats_path(cfg.output)``).

    Raises:
        ConfigError: another process holds the lock, or the config is unusable.
        DataError: a bad prompt set.
    """
    if cfg.dry_run:  # one max-length batch; writes only <output>.dry_run.json (no output, no lock)
        return dry_run(cfg)
    try:
        with exclusive_lock(lock_path_of(cfg), f"shard output {cfg.output}"):
            return generate_shard(cfg)
    except LockHeld as e:
        raise ConfigError(str(e)) from None


def sample_records(cfg: GenerateConfig, tokenizer: Any, model_path: str, kept: list[tuple[dict, list[int]]],
                   tag: str, engine: SharedEngine | None = None
                   ) -> tuple[list[dict], Counter, float | None, float | None, int]:
    """Sample ``cfg.k`` responses for each kept ``(prompt record, prompt ids)`` (:func:`run_engine`,
    seed ``seed + shard_index``; on ``engine`` when co-decoding) and build the output records
    (:func:`to_record`). Without a prompt the engine is not started.

    Returns:
        ``(records, input fields replaced (name -> count), engine start-up s, generation s,
        responses whose sampled ids differ from their text)``; the seconds are None without a prompt.
    Raises:
        RuntimeError: vLLM's outputs do not come back in the prompts' order.
    """
    records: list[dict] = []
    replaced: Counter = Counter()
    startup_s = generation_s = None
    ids_differ = 0
    if kept:
        stop_ids = stop_token_ids(tokenizer, model_path)
        shared = {"engine": engine} if engine is not None else {}  # (tests replace run_engine by a 5-argument fake)
        outputs, startup_s, generation_s = run_engine(cfg, model_path, [ids for _, ids in kept], stop_ids,
                                                      seed=cfg.seed + cfg.shard_index, **shared)
        ids_differ = response_ids_differ_from_text(tokenizer, outputs, stop_ids)
        for (rec, ids), out in zip(kept, outputs):
            if list(out.prompt_token_ids) != ids:  # outputs come back in input order; make sure
                raise RuntimeError(f"vLLM output order does not match the prompts (id {rec['id']!r})")
            new, dropped = to_record(rec, out, cfg.save_token_ids)
            replaced.update(dropped)
            records.append(new)
    else:
        print(f"[generate] {tag}: no prompt to generate for; the engine is not started.")
    return records, replaced, startup_s, generation_s, ids_differ


def process_age_s() -> float:
    """Seconds since this process was created (interpreter start and imports, when called first
    thing in the stage), from the process start time the OS keeps (psutil); 0.0 if unknown."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # psutil missing or the OS does not say: the phase is left at 0
        return 0.0


def generate_shard(cfg: GenerateConfig, engine: SharedEngine | None = None) -> GenerateShardStats:
    """Generate this shard's records (see the module docstring); returns the stats that were written
    to ``<output>.stats.json``, with ``phase_s`` (:data:`PHASES`) saying where its seconds went. With
    ``engine`` (co-decoding, :func:`main_many`) the records are decoded on that shared engine,
    started by whichever config needs it first."""
    phase = {"process": 0.0}
    if engine is None or not engine.process_counted:  # the first config of this process
        phase["process"] = round(process_age_s(), 2)
        if engine is not None:
            engine.process_counted = True
    t_prompts = time.perf_counter()
    setup_cache_env()
    from transformers import AutoTokenizer

    r, w = cfg.shard_index, cfg.num_shards
    tag = f"shard {r}/{w}"
    cfg, model_path = split_adapter(cfg)
    output, stats_file = Path(cfg.output), stats_path(cfg.output)

    prompts, prompt_counts = load_prompt_set(cfg.prompts, cfg.prompt_split, cfg.prompt_field, cfg.limit)
    shard = shard_prompts(prompts, r, w)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    kept, skipped = tokenize_shard(tokenizer, shard, cfg.max_model_len - cfg.max_tokens)
    expected_ids = [rec["id"] for rec, _ in kept]
    config_fp = shard_fingerprint(cfg, model_path)

    complete, why = existing_output_status(output, stats_file, expected_ids, cfg.k, config_fp)
    if complete:
        print(f"[generate] {tag}: {output} is complete ({len(expected_ids)} records); skipped, not regenerated.")
        return GenerateShardStats.read(stats_file)
    if output.exists():
        print(f"[generate] {tag}: regenerating {output}: {why}.")
    phase["prompts"] = round(time.perf_counter() - t_prompts, 2)

    reset_import_seconds()
    records, replaced, startup_s, generation_s, ids_differ = sample_records(cfg, tokenizer, model_path, kept, tag,
                                                                            engine)
    t_write = time.perf_counter()
    shared_with = engine.owner if engine is not None and kept and engine.owner != cfg.output else None
    summary = summarize(records)
    special = special_text_counts(tokenizer, records)
    hardware = describe(*engine_dtype(cfg))
    slow = slow_dtype_warning(hardware)
    stats = GenerateShardStats(
        stage="generate", shard_index=r, num_shards=w, model=model_path, adapter=cfg.adapter, prompts=cfg.prompts,
        config_fingerprint=config_fp, prompts_in=len(prompts), shard_prompts=len(shard),
        skipped=dict(Counter(skipped.values())), skipped_ids=skipped, records_out=len(records),
        **{k: v for k, v in summary.items() if k not in ("records", "warnings")},
        warnings=[*summary["warnings"], *([slow] if slow else [])],
        input_fields_replaced=dict(replaced), special_token_text=special,
        response_ids_differ_from_text=ids_differ, k=cfg.k, prompt_tokens=sum(len(ids) for _, ids in kept),
        max_prompt_tokens=cfg.max_model_len - cfg.max_tokens,
        engine_startup_s=None if startup_s is None else round(startup_s, 2),
        generation_s=None if generation_s is None else round(generation_s, 2),
        generated_tokens_per_s=round(summary["generated_tokens"] / generation_s, 1) if generation_s else None,
        hardware=hardware,
        prompts_blank_lines=prompt_counts.blank_lines,
        prompts_assistant_turns_removed=prompt_counts.assistant_turns_removed,
        engine_shared_with=shared_with,
    )
    write_jsonl(output, records)
    imported = min(import_seconds(), startup_s or 0.0)  # engine_startup_s includes the import
    phase.update(engine_import=round(imported, 2), engine_start=round((startup_s or 0.0) - imported, 2),
                 decode=round(generation_s or 0.0, 2), write=round(time.perf_counter() - t_write, 2))
    stats.phase_s = {k: phase[k] for k in PHASES}
    stats.write(stats_file)  # written last: the resume check needs both
    print(f"[generate] {tag}: {len(records)} records x {cfg.k} responses -> {output}; "
          f"skipped {stats.skipped or 'none'}; finish {stats.finish_reasons}; "
          f"special-token strings kept as text in {special['prompts']} prompts, {special['responses']} responses; "
          f"start-up {stats.engine_startup_s} s{f' (the engine of {shared_with})' if shared_with else ''}, "
          f"{stats.generated_tokens_per_s} tok/s "
          f"on {describe_line(stats.hardware)}.")
    for w in stats.warnings:
        print(f"WARNING: {tag}: {w}", file=sys.stderr)
    return stats


def dry_run(cfg: GenerateConfig) -> DryRunStats:
    """The generation stage's dry run for one shard (``dry_run=true``): the stage's vLLM engine
    (:func:`build_engine`), then one batch: as many prompts as the engine runs at once (at most the
    shard's prompt count) of dummy prompts of ``max_model_len - max_tokens`` tokens, ``k`` samples
    each, every one generating exactly ``max_tokens`` tokens (``ignore_eos``, ``min_tokens``).
    Writes :class:`~online_rlhf.stats.DryRunStats` beside ``cfg.output``
    (``online_rlhf.dry_run.finish``); no output, no stats, no lock.

    Raises:
        SystemExit(1): the engine could not start or generate for lack of memory, after the result
            was written.
    """
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    t_start = time.perf_counter()
    setup_cache_env()
    cfg, model_path = split_adapter(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    shard = shard_prompts(load_prompts(cfg.prompts, cfg.prompt_split, cfg.prompt_field, cfg.limit),
                          cfg.shard_index, cfg.num_shards)
    device, dtype = engine_dtype(cfg)
    prompt_len = cfg.max_model_len - cfg.max_tokens
    status, error, gen_s, n, tokens = "ok", None, None, 0, []
    with PeakMemory(device, children=True, device_wide=True) as mem:
        try:
            llm = build_engine(cfg, model_path, cfg.seed + cfg.shard_index)
            try:
                max_seqs = int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
            except (AttributeError, TypeError, ValueError):
                max_seqs = 256
            n = max(1, min(len(shard) or 1, max_seqs // cfg.k))
            params = SamplingParams(n=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                    min_tokens=cfg.max_tokens, ignore_eos=True)
            prompts = [{"prompt_token_ids": ids} for ids in dummy_ids(tokenizer, n, prompt_len, seed=3)]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            gen_s = time.perf_counter() - t0
            tokens = [len(c.token_ids) for o in outputs for c in o.outputs]
        except Exception as e:  # vLLM wraps a CUDA OOM or a too-small KV cache in its own errors
            if not engine_out_of_memory(e):
                raise
            status, error = "out_of_memory", f"{type(e).__name__}: {str(e)[:1000]}"
    settings = {k: getattr(cfg, k) for k in ("max_model_len", "max_tokens", "k", "kv_cache_gb", "gpu_memory_utilization",
                                             "tensor_parallel_size", "num_shards", "dtype", "enforce_eager")}
    settings["dtype"] = dtype
    step = (f"1 batch: {n} prompts x {prompt_len} tokens x k={cfg.k} samples x {cfg.max_tokens} new tokens "
            f"(the shard's prompts, at most max_num_seqs / k)" if n else "engine start")
    shapes = {"prompts": n, "prompt_tokens": prompt_len, "k": cfg.k, "max_tokens": cfg.max_tokens,
              "generated_tokens_min": min(tokens) if tokens else None,
              "generated_tokens_max": max(tokens) if tokens else None, "sequences": len(tokens),
              "tokens_per_s": round(sum(tokens) / gen_s, 1) if gen_s else None}
    result = finish("generate", mem, cfg.output, status=status, error=error, step_s=gen_s, step=step, shapes=shapes,
                    settings=settings, t_start=t_start, preallocated=device == "cuda", gather=False)
    exit_if_out_of_memory("generate", status, error)
    return result


def config_groups(argv: Sequence[str]) -> list[list[str]]:
    """Split a command line into one argument list per config: each ``--config FILE`` (or
    ``--config=FILE``) after the first starts a new one, and the ``key=value`` arguments after it
    belong to it (those before the first ``--config`` to the first). One ``--config`` or none: one list.
    """
    groups: list[list[str]] = [[]]
    seen, i = False, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" or a.startswith("--config="):
            if seen:
                groups.append([])
            seen = True
            take = 2 if a == "--config" else 1
            groups[-1].extend(argv[i:i + take])
            i += take
            continue
        groups[-1].append(a)
        i += 1
    return groups


def main_many(cfgs: Sequence[GenerateConfig]) -> list[GenerateShardStats | None]:
    """Co-decoding: this shard of each config in turn, all on one engine (:class:`SharedEngine`),
    holding every config's shard lock throughout. Each config keeps its own resume (a finished shard
    is kept), output and stats; a config's error (its prompt file, say) is printed as ``error: ...``
    and the next config goes on. Returns each config's stats (None for one that failed).

    Raises:
        ConfigError: the configs cannot share an engine (``online_rlhf.co_decode.refusal``; the
            launcher never sends such a list), a dry run, or a shard lock another process holds.
        SystemExit(2): after every config was tried, when one of them failed.
    """
    from contextlib import ExitStack

    from online_rlhf.co_decode import refusal

    first = cfgs[0].model_dump(mode="json")
    for cfg in cfgs[1:]:
        why = refusal(first, cfg.model_dump(mode="json"), engine_in_this_process(cfgs[0]))
        if why:
            raise ConfigError(f"{cfg.output} cannot share the engine of {cfgs[0].output}: {why}. "
                              "Run it with generation/launch.py alone.")
    engine, results, failed = SharedEngine(), [], []
    try:
        with ExitStack() as locks:
            for cfg in cfgs:
                locks.enter_context(exclusive_lock(lock_path_of(cfg), f"shard output {cfg.output}"))
            for n, cfg in enumerate(cfgs):
                print(f"[generate] co-decoding config {n + 1} of {len(cfgs)}: {cfg.output}", flush=True)
                try:
                    results.append(generate_shard(cfg, engine=engine))
                except (ConfigError, DataError, FileNotFoundError) as e:
                    print(f"error: {cfg.output}: {e}", file=sys.stderr, flush=True)
                    results.append(None)
                    failed.append(cfg.output)
    except LockHeld as e:
        raise ConfigError(str(e)) from None
    if failed:
        raise SystemExit(2)
    return results


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this). Several
    ``--config FILE [key=value ...]`` groups (:func:`config_groups`) co-decode (:func:`main_many`)."""
    groups = config_groups(sys.argv[1:])
    if len(groups) == 1:
        run_main(main, GenerateConfig)
    else:
        try:
            main_many([GenerateConfig.from_cli(g) for g in groups])
        except (ConfigError, DataError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    exit_without_teardown()


if __name__ == "__main__":
    cli()
