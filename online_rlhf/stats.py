"""Typed stats files: where each stage writes its stats, what they hold, and how they are read back.

One rule for the place (:func:`stats_path`): a stage's stats go beside its primary output,
``<output>.stats.json`` for a file (``generated.jsonl.stats.json``, generation shards'
``shard_00.jsonl.stats.json`` included) and ``<output_dir>.stats.json`` for a checkpoint folder
(``model.stats.json``). There is no per-config override.

One model per stage (pydantic, ``extra="forbid"``): every top-level key a stage writes is a typed
field, required unless said otherwise, so a missing, renamed or unknown key is an error naming the
file, the key and the stage that writes that file, never a silent ``None``. Nested free-form parts
(hardware, counts by reason, example ids, source-specific details) stay dicts.

Each stage's stats class, who writes it and the stages whose stats it is are listed in
docs/architecture.md ("The stats classes", generated from the stage table by ``python -m
online_rlhf.doc_tables --write``); :class:`DryRunStats` is what any stage run with ``dry_run=true``
writes instead (``<output>.dry_run.json``; no stats, no output).

:class:`ScoreResult` is what every reward source (``verifiers``, ``reward_model``, ``remote``,
``judge``) returns to the rewards stage. Importable without torch or vLLM.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from .jsonl import DataError, read_json, write_json
from .pairs import Strategy
from .records import RewardSource

STATS_SUFFIX = ".stats.json"


def stats_path(primary_output: str | os.PathLike) -> Path:
    """Where the stats of a stage whose primary output is ``primary_output`` go.

    ``runs/x/iter_1/generated.jsonl`` -> ``runs/x/iter_1/generated.jsonl.stats.json``;
    ``runs/x/iter_1/model`` (a checkpoint folder, trailing ``/`` or not) -> ``runs/x/iter_1/model.stats.json``.

    Raises:
        ValueError: ``primary_output`` has no file or folder name (``""``, ``"/"``, ``"."``).
    """
    p = Path(primary_output)
    if not p.name or p.name in (".", ".."):
        raise ValueError(f"{str(primary_output)!r} names no file or folder; a stage's stats go beside its output.")
    return p.with_name(p.name + STATS_SUFFIX)


def _loc(loc: tuple) -> str:
    return ".".join(str(x) for x in loc) or "(top level)"


class StageStats(BaseModel):
    """Base of every stage's stats: unknown keys are refused; :meth:`write` / :meth:`read`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    WRITTEN_BY: ClassVar[str] = "a stage"

    def write(self, path: str | os.PathLike) -> Path:
        """Write these stats as indented JSON to ``path``, atomically (temporary file + rename).

        Returns:
            ``path`` as a ``Path``.
        Raises:
            ValueError: a float is NaN or infinite (JSON has none).
        """
        write_json(path, self.model_dump(mode="json"))
        return Path(path)

    @classmethod
    def read(cls, path: str | os.PathLike):
        """Read and check a stats file written by this class's stage.

        Returns:
            an instance of the class.
        Raises:
            FileNotFoundError: no such file (the message names it).
            DataError: not JSON, not an object, or a key is missing, unknown or of the wrong type;
                the message names the file, every bad key and the stage that writes such a file.
        """
        data = read_json(path)
        if not isinstance(data, dict):
            raise DataError(f"{path}: expected a JSON object of {cls.__name__} (written by {cls.WRITTEN_BY}), "
                            f"got {type(data).__name__}.")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = []
            for err in e.errors():
                where = _loc(err["loc"])
                if err["type"] == "missing":
                    problems.append(f"missing key {where!r}")
                elif err["type"] == "extra_forbidden":
                    problems.append(f"unknown key {where!r}")
                else:
                    problems.append(f"key {where!r}: {err['msg']} (got {str(err.get('input'))[:80]!r})")
            raise DataError(f"{path}: not valid {cls.__name__} stats (written by {cls.WRITTEN_BY}): "
                            f"{'; '.join(problems)}. Rerun that stage to rewrite the file.") from None


class _Strict(BaseModel):
    """A nested part with fixed keys (unknown keys refused)."""

    model_config = ConfigDict(extra="forbid")


class RewardSummary(_Strict):
    """Mean, population std, min and max of a set of rewards (all None when there is none)."""

    mean: Optional[float]
    std: Optional[float]
    min: Optional[float]
    max: Optional[float]


# ------------------------------------------------------------------------------------------- generation

class _GenerationCommon(StageStats):
    """Keys both the per-shard and the merged generation stats hold."""

    stage: Literal["generate"]
    num_shards: int
    prompts: str
    prompts_in: int
    skipped: dict[str, int]  # prompts set aside by reason (too_long, special_text_not_tokenizable)
    skipped_ids: dict[str, str]  # prompt id -> reason
    records_out: int
    # response statistics (generate.summarize)
    responses: int
    finish_reasons: dict[str, int]
    empty_responses: int
    generated_tokens: int
    mean_response_tokens: Optional[float]
    prompts_all_distinct: int
    mean_distinct_responses: Optional[float]
    prompts_fewer_than_2_distinct: int
    warnings: list[str]
    input_fields_replaced: dict[str, int]
    special_token_text: dict[str, int]  # {"prompts": n, "responses": n}
    response_ids_differ_from_text: int
    k: int
    # prompt tokens the engine prefilled, each prompt once (its K samples share them); None in
    # stats written before the key existed
    prompt_tokens: Optional[int] = None
    engine_startup_s: Optional[float]  # None: no engine started (no prompt to generate for)
    generation_s: Optional[float]
    generated_tokens_per_s: Optional[float]
    # Loading the prompt set (online_rlhf.records.load_prompt_set); 0 in stats written before these keys existed.
    prompts_blank_lines: int = 0  # blank lines skipped in the prompt file
    prompts_assistant_turns_removed: int = 0  # prompts that ended with assistant turn(s), removed
    # co-decoding (several configs, one engine start; generation/launch.py --config A --config B): the
    # output of the config whose engine this decode reused (its engine_startup_s is then 0.0); None
    # when this config started its own engine
    engine_shared_with: Optional[str] = None
    # where the shard's wall seconds went (online_rlhf.stages.generate.PHASES, in that order): process
    # (interpreter start and imports until the stage's code runs; 0.0 for a later config of a
    # co-decoded shard), prompts (prompt set, tokenizer, chat template, resume check), engine_import
    # (importing vLLM's engine; ~0 once imported), engine_start (vLLM's LLM(): config, model load,
    # KV cache; 0.0 on a shared engine), decode, write (records, stats, output file). The merged
    # stats hold each phase's largest shard value. None in stats written before the key existed.
    phase_s: Optional[dict[str, float]] = None
    # the LoRA adapter decoded on top of `model` (vLLM's LoRA; the loop's lora key); None: the model alone
    adapter: Optional[str] = None


class GenerateShardStats(_GenerationCommon):
    """One generation shard's stats (``<shards_dir>/shard_XX.jsonl.stats.json``, or ``<output>.stats.json``
    of generate.py run alone). ``config_fingerprint`` decides whether a rerun may keep the shard."""

    WRITTEN_BY: ClassVar[str] = "generation/generate.py (online_rlhf.stages.generate)"
    shard_index: int
    model: str
    config_fingerprint: str
    shard_prompts: int
    max_prompt_tokens: int
    hardware: dict[str, Any]


class ShardSummary(_Strict):
    """One shard's line in the merged generation stats."""

    shard_index: int
    shard_prompts: int
    records_out: int
    skipped: dict[str, int]
    engine_startup_s: Optional[float]
    generation_s: Optional[float]
    generated_tokens_per_s: Optional[float]
    hardware: dict[str, Any]


class GenerateStats(_GenerationCommon):
    """The generation stage's stats after the shards are merged (``generated.jsonl.stats.json``):
    timings are the slowest shard's, ``hardware`` the first shard's that ran an engine (None when none did)."""

    WRITTEN_BY: ClassVar[str] = "generation/launch.py / generation/merge_data.py (online_rlhf.stages.merge_data)"
    model: Optional[str]  # None only with zero shards
    hardware: Optional[dict[str, Any]]
    shards: list[ShardSummary]
    # the file these answers were decoded into when they came from the evaluation cache
    # (online_rlhf.eval_cache: iteration 0 of another run); None when decoded here
    reused_from: Optional[str] = None


# ------------------------------------------------------------------------------------------- rewards

@dataclass
class ScoreResult:
    """What a reward source's ``score(records, cfg)`` returns (one type for every source).

    Attributes:
        rewards: one entry per input record: a list of K values aligned with its ``responses``
            (a float, or ``None`` for a response the source could not score), or ``None`` when
            the source cannot score the record at all.
        skipped: reason -> records the source returned ``None`` for (the stats key ``skipped``).
        responses_unscored: cause -> ``None`` entries inside the reward lists (the stats key
            ``responses_unscored``).
        examples: reason or cause -> up to 5 example ids (``"<id> (response j)"``).
        truncated_inputs: inputs shortened to fit the source's length budget.
        hardware: what the source ran on (``online_rlhf.hardware.describe``), None when it ran no model.
        source_stats: source-specific details (free-form), copied to the stats' ``source_stats``.
    """

    rewards: list[Optional[list[Optional[float]]]]
    skipped: Counter = field(default_factory=Counter)
    responses_unscored: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    truncated_inputs: int = 0
    hardware: Optional[dict[str, Any]] = None
    source_stats: dict[str, Any] = field(default_factory=dict)


class RewardStats(StageStats):
    """The rewards stage's stats (``rewards.jsonl.stats.json``, ``eval.jsonl.stats.json``).

    ``records_scored + records_skipped == records_in``; ``skipped`` counts records left out by
    reason, ``responses_unscored`` the ``null`` rewards by cause.
    """

    WRITTEN_BY: ClassVar[str] = "annotate_data/get_rewards.py (online_rlhf.stages.get_rewards)"
    stage: Literal["get_rewards"]
    input: str
    output: str
    source: RewardSource
    records_in: int
    records_scored: int
    records_skipped: int
    skipped: dict[str, int]
    responses_scored: int
    responses_unscored: dict[str, int]
    examples: dict[str, list[str]]
    truncated_inputs: int
    reward: RewardSummary
    records_all_tied: int
    source_stats: dict[str, Any]
    warnings: list[str]
    num_processes: int
    hardware: Optional[dict[str, Any]]  # None for sources that run no model here (verifier, remote, judge)
    seconds: float
    input_blank_lines: int = 0  # blank lines skipped in the input file (0 in stats written before this key existed)


# ------------------------------------------------------------------------------------------- pairs

class TruncationPolicy(_Strict):
    policy: Literal["keep", "exclude", "penalize"]
    penalty: Optional[float]  # only with policy=penalize


class PairsStats(StageStats):
    """make_pairs' stats (``pairs.jsonl.stats.json``); see ``online_rlhf.pairs.build_pairs``."""

    WRITTEN_BY: ClassVar[str] = "annotate_data/make_pairs.py (online_rlhf.stages.make_pairs)"
    stage: Literal["make_pairs"]
    input: str
    output: str
    records_in: int
    pairs_out: int
    # prompts that gave at least one pair (pairs_out with a multi-pair strategy can be more); None in older stats
    prompts_with_pairs: Optional[int] = None
    skipped: dict[str, int]
    skipped_examples: dict[str, list[str]]
    responses: dict[str, int]
    prompts_fewer_than_2_distinct: int
    warnings: list[str]
    reward: RewardSummary
    chosen_reward_mean: Optional[float]
    rejected_reward_mean: Optional[float]
    margin_mean: Optional[float]
    strategy: Strategy
    min_margin: float
    max_pairs_per_prompt: Optional[int] = None  # the cap per prompt (multi-pair strategies); None: none, or older stats
    truncation: TruncationPolicy
    seed: int
    seconds: float
    input_blank_lines: int = 0  # blank lines skipped in the input file (0 in stats written before this key existed)

    def no_pair_causes(self) -> tuple[list[str], list[str]]:
        """Why the prompts gave no pair, and what to change, from the skip counts (``skipped``:
        prompts by reason) and the per-response counts (``responses``), in loop config keys
        (``generation.k``, ``pairs.min_margin``, ...), each fix once. The truncation setting is
        named only when truncated responses were left out (``pairs.truncated=exclude``).

        Returns:
            ``(causes, fixes)``, e.g. ``["2 of 2 prompts had all their responses scored the same
            (tie; every reward was 0.5)"]`` and ``["a reward that tells the responses apart ..."]``;
            both empty when nothing was counted (e.g. no input record).
        """
        n, resp = self.records_in, self.responses
        causes, fixes = [], []
        for reason, count in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            if reason == "tie":
                r = self.reward
                same = f"; every reward was {r.min:g}" if r.min is not None and r.min == r.max else ""
                causes.append(f"{count} of {n} prompts had all their responses scored the same (tie{same})")
                fixes.append("a reward that tells the responses apart (reward.source, reward.verifier), or more "
                             "samples, more varied (generation.k, generation.temperature)")
            elif reason == "margin_below_min":
                causes.append(f"{count} of {n} prompts had a best-worst reward margin <= pairs.min_margin="
                              f"{self.min_margin:g}")
                fixes.append("a lower pairs.min_margin")
            elif reason == "identical_responses":
                causes.append(f"{count} of {n} prompts got the same text for every sample")
                fixes.append("a higher generation.temperature (or generation.top_p), or more samples (generation.k)")
            elif reason == "fewer_than_2_valid":
                causes.append(f"{count} of {n} prompts had fewer than 2 usable responses")
                fixes.append("more samples per prompt (generation.k)")
            elif reason == "unscored":
                causes.append(f"{count} of {n} prompts were not scored by the rewards stage")
                fixes.append("see the rewards stage's stats (rewards.jsonl.stats.json: skipped, examples)")
            else:
                causes.append(f"{count} of {n} prompts skipped as {reason}")
        if resp.get("truncated_excluded") and self.truncation.policy == "exclude":
            causes.append(f"{resp['truncated_excluded']} truncated responses were left out (pairs.truncated=exclude)")
            fixes.append("pairs.truncated=penalize (or keep), or a larger generation.max_tokens")
        if resp.get("unscored"):
            causes.append(f"{resp['unscored']} responses had no reward")
            fixes.append("see the rewards stage's stats (rewards.jsonl.stats.json: responses_unscored)")
        if resp.get("empty"):
            causes.append(f"{resp['empty']} responses were empty")
            fixes.append("check the policy's chat template and stop tokens")
        return causes, list(dict.fromkeys(fixes))


# ------------------------------------------------------------------------------------------- DPO

class DPOReference(_Strict):
    source: Literal["policy", "explicit"]
    path: str
    precomputed_log_probs: bool
    lora_adapter_disabled: bool
    # with LoRA and no reference model: adapter_off (the base, the adapter switched off) or
    # previous_adapter (a frozen copy of the adapter the stage continued); None: no LoRA, or a model
    lora_reference: Optional[Literal["adapter_off", "previous_adapter"]] = None


class DPOSeconds(_Strict):
    total: float
    model_loading: float
    trainer_init: float
    reference_precompute: float  # inside trainer_init; 0 without precomputed reference log-probs
    train_steps: float
    save: float


class DPOStats(StageStats):
    """The DPO stage's stats (``<output_dir>.stats.json``, e.g. ``model.stats.json``)."""

    WRITTEN_BY: ClassVar[str] = "dpo_iteration/run_dpo.py (online_rlhf.stages.run_dpo)"
    stage: Literal["dpo"]
    policy: str
    reference: DPOReference
    pairs_file: str
    pairs_in: int
    pairs_used: int
    pairs_dropped: dict[str, int]
    dropped_examples: dict[str, list[str]]
    truncation: dict[str, Any]
    special_token_text: dict[str, int]  # {"prompts": n, "chosen": n, "rejected": n}
    loss_type: list[str]
    beta: float
    learning_rate: float
    dtype: dict[str, Any]
    lora: Optional[dict[str, Any]]
    hardware: dict[str, Any]
    num_processes: int
    deepspeed_zero_stage: Optional[int]
    steps: int
    # the LoRA adapter the policy continued (None: none); what was saved in output_dir (a full
    # checkpoint, or the adapter alone: save_adapter) and its size in MB (None in older files)
    adapter: Optional[str] = None
    saved: Literal["checkpoint", "adapter"] = "checkpoint"
    saved_mb: Optional[float] = None
    # tokens of the kept pairs' sequences (prompt + chosen and prompt + rejected, after max_length
    # truncation; no padding) and the epochs trained over them (None in older stats files)
    sequence_tokens: Optional[int] = None
    epochs: Optional[float] = None
    # how the log-probs were computed (online_rlhf/completion_logps.py): {"layout": "sequence" |
    # "side" | "packed" | None (TRL's own computation), "trl_because": why TRL's ran, or None} (None in older files)
    log_probs: Optional[dict[str, Any]] = None
    train_loss_mean: Optional[float]
    history: list[dict[str, Any]]
    train_loss_first: Optional[float]
    train_loss_last: Optional[float]
    rewards_accuracies_first: Optional[float]
    rewards_accuracies_last: Optional[float]
    rewards_margins_first: Optional[float]
    rewards_margins_last: Optional[float]
    output_dir: str
    seconds: DPOSeconds


# ------------------------------------------------------------------------------------------- GRPO

class GRPOSeconds(_Strict):
    total: float
    model_loading: float
    old_log_probs: float  # the policy's (and the reference's, beta > 0) log-probs before any update
    train_steps: float
    save: float


class GRPOStats(StageStats):
    """The GRPO stage's stats (``<output_dir>.stats.json``, e.g. ``model.stats.json``).

    ``groups_in == groups_used + sum(groups_skipped.values())``; a group is one prompt's K responses.
    ``groups_skipped`` reasons: ``all_equal`` (every reward the same: no advantage, no signal),
    ``fewer_than_2_scored``, ``prompt_too_long`` and the token-id reasons of docs/skip-reasons.md.
    Per-step values (loss, kl, clip_fraction) are means over the step's completion tokens, as TRL logs them.
    """

    WRITTEN_BY: ClassVar[str] = "grpo_iteration/run_grpo.py (online_rlhf.stages.run_grpo)"
    stage: Literal["grpo"]
    policy: str
    reference: dict[str, Any]  # {source: policy | explicit | none (beta 0), path, lora_reference: adapter_off | previous_adapter | None}
    rewards_file: str
    groups_in: int
    groups_used: int
    groups_skipped: dict[str, int]
    skipped_examples: dict[str, list[str]]
    completions_used: int
    completions_masked: dict[str, int]  # left out of the loss: {truncated: n (mask_truncated_completions), unscored: n}
    completions_cut: int  # lost tail tokens to max_length
    reward_mean: Optional[float]  # mean reward of the used groups' scored responses (after truncated_penalty)
    reward_mean_all: Optional[float]  # mean of every scored response in the file
    advantage_abs_mean: Optional[float]
    loss_type: str
    scale_rewards: str
    beta: float
    epsilon: float
    epsilon_high: float
    learning_rate: float
    num_iterations: int
    steps: int
    loss_first: Optional[float]
    loss_last: Optional[float]
    kl_last: Optional[float]  # None with beta 0
    clip_fraction_mean: Optional[float]
    ratio_first_step_max_dev: Optional[float]  # max |ratio - 1| over the first step's tokens (0 up to rounding)
    history: list[dict[str, Any]]
    dtype: dict[str, Any]
    hardware: dict[str, Any]
    num_processes: int
    deepspeed_zero_stage: Optional[int]
    output_dir: str
    seconds: GRPOSeconds
    input_blank_lines: int = 0  # blank lines skipped in the input file (0 in stats written before this key existed)
    # the LoRA adapter the policy continued (None: none); what output_dir holds (a full checkpoint, or
    # the adapter alone: save_adapter) and its size in MB (None in older files)
    adapter: Optional[str] = None
    saved: Literal["checkpoint", "adapter"] = "checkpoint"
    saved_mb: Optional[float] = None


# ------------------------------------------------------------------------------------------- SFT

class SFTStats(StageStats):
    """The SFT stage's stats (``<output_dir>.stats.json``)."""

    WRITTEN_BY: ClassVar[str] = "sft/run_sft.py (online_rlhf.stages.run_sft)"
    stage: Literal["sft"]
    base_model: str
    dataset: str
    output_dir: str
    axolotl_config: str
    rows_in: int
    rows_used: Optional[int]  # None when Axolotl's log did not say
    dropped: dict[str, int]
    steps: int
    train_loss_first: Optional[float]
    train_loss_last: Optional[float]
    train_losses: list[float]
    train_runtime_s: Optional[float]
    seconds_per_step: Optional[float]
    wall_seconds: float
    launcher: Literal["python", "accelerate"]
    sequence_len: Optional[int]
    special_token_text: dict[str, Any]  # {"rows": n, "messages": {role: n}}
    hardware: dict[str, Any]
    removed_from_checkpoint: list[str]
    chat_template_from: str
    generation_config_from: str
    eos_token: str
    eos_token_id: int
    pad_token_id: int
    eot_tokens: Optional[list[str]] = None  # Axolotl's eot_tokens set by the stage (the template's turn terminator when it is not the eos)


class SFTDataStats(StageStats):
    """build_sft_data's stats (``<output>.stats.json``)."""

    WRITTEN_BY: ClassVar[str] = "sft/build_sft_data.py (online_rlhf.stages.build_sft_data)"
    stage: Literal["build_sft_data"]
    rewards: str
    output: str
    min_reward: float
    truncated: Literal["exclude", "keep"]
    prompts_in: int
    kept: int
    dropped: dict[str, int]
    dropped_examples: dict[str, list[str]]
    responses_excluded: dict[str, int]
    kept_reward_mean: Optional[float]
    input_blank_lines: int = 0  # blank lines skipped in the rewards file (0 in stats written before this key existed)


# ------------------------------------------------------------------------------------ evaluation

class IFEvalStats(StageStats):
    """ifeval_score's stats (``ifeval.jsonl.stats.json``): IFEval's four numbers in [0, 1]
    (``online_rlhf.evaluation.ifeval_scores``; None when no prompt was scored)."""

    WRITTEN_BY: ClassVar[str] = "annotate_data/ifeval_score.py (online_rlhf.stages.ifeval_score)"
    stage: Literal["ifeval_score"]
    input: str
    output: str
    records_in: int
    records_scored: int
    skipped: dict[str, int]  # records left out by reason (e.g. checker_error:LookupError)
    skipped_ids: dict[str, list[str]]  # reason -> up to 5 ids
    instructions: int
    prompt_strict: Optional[float]
    prompt_loose: Optional[float]
    instruction_strict: Optional[float]
    instruction_loose: Optional[float]
    mean_response_tokens: Optional[float]
    truncation_rate: Optional[float]
    seconds: float
    # instruction-level pass rates per instruction group (online_rlhf.evaluation.instruction_groups),
    # e.g. groups["length_constraints"]["strict"]; None in stats written before the key existed
    groups: Optional[dict[str, dict[str, float]]] = None
    # scored records whose checker draws an argument at random (the benchmark as shipped, e.g. IFEval
    # 1122 and 1129: letter '#' and '!'), id -> "instruction id: argument names"; the draw comes from
    # the record's own seed (online_rlhf.verifiers.ifeval_instruction_results); None in older stats
    arguments_drawn: Optional[dict[str, str]] = None


class KLStats(StageStats):
    """kl_estimate's stats (``kl.jsonl.stats.json``): KL(policy || reference) in nats per response,
    the mean over sampled responses of ``log p_policy(y|x) - log p_reference(y|x)`` (summed over the
    response tokens), with its standard error."""

    WRITTEN_BY: ClassVar[str] = "annotate_data/kl_estimate.py (online_rlhf.stages.kl_estimate)"
    stage: Literal["kl"]
    input: str
    output: str
    policy: str
    reference: str
    records_in: int
    samples: int
    skipped: dict[str, int]  # responses left out by reason (e.g. special_text_not_tokenizable)
    kl_mean: Optional[float]
    kl_se: Optional[float]
    retokenized_length_differs: int  # responses whose re-tokenized length is not the sampled count (response_tokens)
    retokenized: int = 0  # responses whose ids were rebuilt from the text (records without the sampled ids)
    mean_response_tokens: Optional[float]
    dtype: str
    hardware: dict[str, Any]
    seconds: float
    tokens: Optional[int] = None  # prompt + response tokens scored by each model (None in older stats files)
    adapter: Optional[str] = None  # the policy's LoRA adapter on top of `policy` (the loop's lora key); None: none
    reference_adapter_off: bool = False  # the reference was the policy's model with its adapter switched off


# --------------------------------------------------------------------------------------- dry run

class DryRunStats(StageStats):
    """What a stage's dry run measured (``dry_run=true``; ``<output>.dry_run.json`` beside the stage's
    output, see :func:`online_rlhf.dry_run.dry_run_path`; never its stats file, never a ``.done``).

    Memory is in GiB (2**30 bytes), time in seconds. ``peak_memory_gib`` is what the stage used at
    its peak, ``memory_limit_gib`` what it may use (see ``memory_measure``); the loop's dry run
    compares the two (:func:`online_rlhf.loop.memory_check.verdict`). ``stage`` names the stage table's rows
    with a dry run (``Stage.dry_run``; tests/test_stage_table.py ties the two).
    """

    WRITTEN_BY: ClassVar[str] = "a stage run with dry_run=true (its module's dry_run)"
    stage: Literal["dpo", "grpo", "sft", "generate", "rewards"]
    status: Literal["ok", "out_of_memory"]
    error: Optional[str]  # the out-of-memory message, when status says so
    device: Literal["cpu", "cuda"]
    memory_measure: str  # how peak and limit were measured, in words
    peak_memory_gib: Optional[float]  # None: the run failed before anything could be measured
    memory_limit_gib: Optional[float]  # CPU: available at the stage's start + its own RSS then; CUDA: device total
    preallocated: bool  # the engine reserves a share of the limit up front (vLLM on a GPU): "tight" is by design
    per_process_peak_gib: list[float]  # one entry per rank (DPO, reward model on N processes); CPU: summed, CUDA: max
    processes: int
    seconds_per_step: Optional[float]
    step: str  # what one step is, in words (shapes, forward/backward/optimizer step)
    shapes: dict[str, Any]
    settings: dict[str, Any]  # the stage's memory-relevant settings (stage key -> value), for the advice
    seconds_total: float
