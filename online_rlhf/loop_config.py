"""The loop config (``configs/loop.yaml``): its run-level keys and one section per stage section,
each typed by its stage's config class minus the keys the loop's plan sets itself.

The loop-owned keys of a section (:data:`LOOP_OWNED`) are derived from the stage table's rows whose
section it is (:func:`owned_keys`), so this module imports the table; the table imports only the
stage config classes (``online_rlhf.stage_configs``), never this module, and names ``LoopConfig``
in type hints only. A row whose section has no field below gets one here
(:func:`_with_row_sections`): a new stage's section needs no line in this file.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional, Union

from pydantic import Field, create_model, field_validator, model_validator

from .config import StageConfig, deep_merge, did_you_mean
from .stage_configs import (SEED_MAX, DPOStageConfig, GenerateConfig, GRPOStageConfig, IFEvalSection, LaunchProfile,
                            PairsConfig, RewardConfig, check_machines)
from .stage_table import STAGES

# The loop keys that name a file or folder: run_loop.sh takes a relative one from where it runs when
# the file is there, else from the project root (also under per_iteration.<i>.; output_root= always
# from where it runs). run_loop.sh's `case` line and header list them too, and docs/custom.md:
# tests/test_config.py ties the copies to this one.
PATH_KEYS = ("train_prompts", "eval_prompts", "ifeval.prompts", "policy", "sft.dataset", "reward.reward_model",
             "dpo_config", "grpo_config", "sft.config")

# The keys of a stage config that describe how the loop launches it (shards, processes, machines,
# the dry run): the plan sets each of them that the stage's class has.
LAUNCH_KEYS = ("shards_dir", "shard_index", "num_shards", "num_processes", "launch_profile", "num_machines",
               "main_process_ip", "main_process_port", "machine_rank", "dry_run")


def owned_keys(section: str) -> tuple[str, ...]:
    """The keys of the stage config behind the loop's ``section`` that the plan sets itself, so the
    section refuses them (``online_rlhf.loop_keys`` says what to set instead), from the stage
    table's rows whose own section it is (:attr:`Stage.section`): each row's inputs (but its
    ``section_inputs``) and outputs, its ``loop_owned`` keys, the :data:`LAUNCH_KEYS` its config
    class has, and the ``set_by_plan`` keys every such row sets.

    Raises:
        KeyError: no row of the stage table has ``section`` as its own section.
    """
    rows = [s for s in STAGES.values() if s.section == section]
    if not rows:
        raise KeyError(f"no stage of the stage table has the loop section {section!r}")
    keys: list[str] = []
    for s in rows:
        keys += [k for k in s.inputs if k not in s.section_inputs] + list(s.outputs) + list(s.loop_owned)
    fields = rows[0].config.model_fields
    keys += [k for k in LAUNCH_KEYS if k in fields]
    keys += [k for k in rows[0].provenance.set_by_plan if all(k in s.provenance.set_by_plan for s in rows)]
    return tuple(dict.fromkeys(keys))


# section -> the stage config class it is typed by, for every section built by section_model
SECTION_CLASSES: dict[str, type[StageConfig]] = {}
# section -> the keys of that class the loop sets itself (owned_keys)
LOOP_OWNED: dict[str, tuple[str, ...]] = {}


def section_model(cls: type[StageConfig], section: str) -> type[StageConfig]:
    """The loop config's ``section`` typed by the stage class ``cls``: the stage's fields (type,
    default, description, constraints) minus the keys the loop sets (:func:`owned_keys`, recorded in
    :data:`LOOP_OWNED`), each optional. The loop merges only the keys a user set
    (``model_dump(exclude_unset=True)``), so a default here never overrides a stage file (e.g.
    ``configs/dpo.yaml`` under the ``dpo`` section). Cross-field checks stay with the stage class,
    run by the plan on the merged stage config.

    Raises:
        KeyError: no row of the stage table has ``section`` as its own section.
    """
    owned = LOOP_OWNED[section] = owned_keys(section)
    SECTION_CLASSES[section] = cls
    fields = {}
    for name, f in cls.model_fields.items():
        if name in owned:
            continue
        info = copy.deepcopy(f)
        ann = f.annotation
        if f.is_required():
            info.default, ann = None, Optional[ann]
        fields[name] = (ann, info)
    doc = f"The loop's `{section}` section: {cls.__name__} fields ({(cls.__doc__ or '').strip().splitlines()[0]})"
    return create_model(f"{section.capitalize()}Section", __base__=StageConfig, __doc__=doc, **fields)


GenerationSection = section_model(GenerateConfig, "generation")
EvaluationSection = section_model(GenerateConfig, "evaluation")
RewardSection = section_model(RewardConfig, "reward")
PairsSection = section_model(PairsConfig, "pairs")
DPOSection = section_model(DPOStageConfig, "dpo")
GRPOSection = section_model(GRPOStageConfig, "grpo")


class LoopLora(StageConfig):
    """The loop's ``lora`` key: LoRA through the whole loop (docs/dpo.md "LoRA through the loop").

    When set, the update stage (DPO or GRPO) of every iteration trains a LoRA adapter on the starting
    policy, which stays unchanged, and saves the adapter only; the next iteration's generation,
    held-out evaluation, IFEval and KL decode the starting policy with that adapter (vLLM's LoRA), and
    the next update continues from it. The reference (``ref_model``) is the starting policy with the
    adapter switched off (``initial``) or the previous adapter (``previous``); no merged checkpoint is
    written (``scripts/merge_lora.py`` merges one for export).
    """

    r: int = Field(16, ge=1, le=512, description="LoRA rank (peft's r); vLLM decodes ranks up to 512")
    alpha: Optional[float] = Field(None, gt=0, description="LoRA scaling numerator (peft's lora_alpha; the update is scaled by alpha / r); null: 2 x r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (peft's lora_dropout); TRL's DPO turns dropout off by default anyway (disable_dropout)")
    target_modules: Union[str, list[str]] = Field("all-linear", description="the modules that get an adapter: all-linear (every linear layer but the LM head, the QLoRA recipe) or a list of module names, e.g. [q_proj, v_proj]")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """Unknown keys named with the keys ``lora`` takes (peft's own names pointed to ours)."""
        if isinstance(data, dict):
            peft_names = {"lora_alpha": "alpha", "lora_dropout": "dropout", "rank": "r"}
            for key in data:
                if key not in cls.model_fields:
                    hint = (f" (peft's {key} is {peft_names[key]} here)" if key in peft_names
                            else did_you_mean(str(key), cls.model_fields))
                    raise ValueError(f"unknown key {key!r}{hint}; lora takes r, alpha, dropout, target_modules, "
                                     "e.g. lora='{r: 16, alpha: 32}'")
        return data

    @field_validator("target_modules", mode="before")
    @classmethod
    def _module_names(cls, v: Any) -> Any:
        ok = (isinstance(v, str) and v.strip()) or (
            isinstance(v, list) and v and all(isinstance(m, str) and m.strip() for m in v))
        if not ok:
            raise ValueError(f"target_modules={v!r}: give all-linear, one module name, or a non-empty list of "
                             "names, e.g. [q_proj, v_proj]")
        if isinstance(v, str) and v != "all-linear" and v.replace("_", "-").lower() == "all-linear":
            raise ValueError(f"target_modules={v!r}: did you mean all-linear (with a hyphen)?")
        return v

    def peft_dict(self) -> dict:
        """The ``peft.LoraConfig`` fields this key stands for (``alpha`` null: ``2 r``)."""
        alpha = self.alpha if self.alpha is not None else 2 * self.r
        return {"r": self.r, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
                "lora_dropout": self.dropout, "target_modules": self.target_modules}


class LoopConfig(StageConfig):
    """run_loop.sh: the whole online iterative loop."""

    omit_when_default = ("lora",)

    run_name: str = Field("default", description="runs/<run_name>/ holds everything the run writes")
    output_root: str = Field("runs", description="parent folder of run directories")
    seed: int = Field(42, ge=0, le=SEED_MAX, description="seed of sampling, pair selection and training: iteration i's rollouts use seed + 1000 x i, its pairs seed + i, held-out generation and DPO seed (a generation.seed / pairs.seed you set is used as is in every iteration)")
    iterations: int = Field(2, ge=1, description="number of generate -> reward -> pairs -> DPO rounds")
    policy: str = Field("default", description="starting policy: dir, Hub id or 'default'")
    sft: dict[str, Any] = Field(default_factory=lambda: {"enabled": False}, description="sft.enabled: run sft/ once before iteration 1; sft.config: its YAML (default configs/sft.yaml); sft.dataset: SFT JSONL of {messages: [...]} (required when enabled); any other key of that YAML (SFTStageConfig or Axolotl) overrides it")
    train_prompts: str = Field("default", description="train prompt set ('default' = the IF prompts .cache/data/if_train.jsonl: IFEval constraint types on the project's own templates)")
    eval_prompts: str = Field("default", description="held-out prompt set ('default' = IFBench held-out split)")
    prompt_field: Optional[str] = Field(None, description="prompt column (text or message list) of the train set, if not messages/prompt; also of the held-out set unless eval_prompt_field is set")
    eval_prompt_field: Optional[str] = Field(None, description="prompt column of the held-out set (default: prompt_field)")
    train_limit: Optional[int] = Field(None, ge=1, description="the first N train prompts, the same in every iteration (not with prompts_per_iteration)")
    eval_limit: Optional[int] = Field(None, ge=1, description="first N held-out prompts")
    prompts_per_iteration: Optional[int] = Field(None, ge=1, description="iteration i takes the i-th slice of this many train prompts (wrapping); None = all (or train_limit); not with train_limit")
    launch_profile: LaunchProfile = Field("cpu", description="configs/accelerate/<profile>.yaml for DPO (and a reward model)")
    num_processes: Union[int, Literal["auto"]] = Field("auto", description="processes of accelerate launch (DPO, reward model) over all machines together (accelerate's meaning; a multiple of num_machines). auto: one per GPU of a machine x num_machines; on CPU one per usable core (each with one thread; 2 ranks over gloo trained faster than 2 threads in one process) x num_machines, the most that divides dpo.train_batch_size")
    num_machines: int = Field(1, ge=1, description="machines the distributed stages span (DPO, a reward model, generation shards); they must share a filesystem holding the project and the run directory. run_loop.sh runs on machine 0 (docs/multi-node.md)")
    machine_rank: int = Field(0, ge=0, description="this machine's rank (0-based). run_loop.sh and the plan run on machine 0 only; machine k > 0 runs each distributed stage with `python -m online_rlhf.loop exec RUN_DIR I STAGE machine_rank=k`")
    main_process_ip: Optional[str] = Field(None, description="num_machines > 1 (required): address of machine 0 that every machine can reach (accelerate's --main_process_ip)")
    main_process_port: int = Field(29500, ge=1, le=65535, description="num_machines > 1: port on machine 0 for the processes' rendezvous (accelerate's --main_process_port)")
    launcher: Literal["local", "slurm"] = Field("local", description="local: each machine starts its own part (machine 0: run_loop.sh; others: loop exec ... machine_rank=k); slurm: run_loop.sh runs on the first node of an allocation and wraps each distributed stage in `srun --nodes=num_machines --ntasks-per-node=1` (scripts/slurm_loop.sbatch)")
    generation_shards: int = Field(1, ge=1, description="vLLM shards W (one per GPU; 1 on CPU)")
    generation: GenerationSection = Field(default_factory=GenerationSection, description="GenerateConfig fields for training rollouts")
    evaluation: EvaluationSection = Field(default_factory=lambda: EvaluationSection(k=1, temperature=0.0), description="GenerateConfig fields for held-out generation (over `generation`, without its k/temperature/top_p)")
    reward: RewardSection = Field(default_factory=RewardSection, description="RewardConfig fields")
    pairs: PairsSection = Field(default_factory=PairsSection, description="PairsConfig fields")
    dpo_config: Optional[str] = Field("configs/dpo.yaml", description="DPO stage YAML that the `dpo` section is layered on (a relative path is taken from the project root; one given on run_loop.sh's command line is first looked for where you run it); null = none")
    dpo: DPOSection = Field(default_factory=DPOSection, description="DPOStageConfig fields (over dpo_config)")
    algorithm: Literal["dpo", "grpo"] = Field("dpo", description="the update of each iteration: dpo (pairs -> DPO) or grpo (group-relative policy gradient on the K scored responses per prompt)")
    grpo_config: Optional[str] = Field("configs/grpo.yaml", description="GRPO stage YAML that the `grpo` section is layered on (a relative path is taken from the project root; one given on run_loop.sh's command line is first looked for where you run it); null = none")
    grpo: GRPOSection = Field(default_factory=GRPOSection, description="GRPOStageConfig fields (over grpo_config; algorithm=grpo)")
    lora: Optional[LoopLora] = Field(None, description="LoRA through the loop: {r, alpha, dropout, target_modules}. The update stage trains an adapter on the starting policy and saves the adapter only; generation, evaluation, IFEval and KL decode the starting policy with it (vLLM LoRA); the next update continues it; the reference is the starting policy with the adapter off (ref_model: initial) or the previous adapter (previous). null: every weight is trained and each iteration saves a full checkpoint")
    ref_model: Literal["initial", "previous"] = Field("initial", description="reference of DPO and of the GRPO KL term: the starting (SFT) policy, or last iteration's policy")
    per_iteration: dict[int, dict[str, Any]] = Field(default_factory=dict, description="{i: {section: {key: value}}} overrides for iteration i")
    ifeval: IFEvalSection = Field(default_factory=IFEvalSection, description="IFEval benchmark stages (ifeval_generate, ifeval_score): when, prompts, limit, max_tokens; decoding as `evaluation` (greedy)")
    kl_samples: int = Field(1, ge=0, description="responses SAMPLED (temperature 1, as `evaluation` otherwise) per held-out prompt for the KL(policy || starting policy) estimate of iterations >= 1 (stages kl_generate, kl); 0: no KL estimate")
    kl_warn: Optional[float] = Field(5.0, ge=0, description="warn (loop metrics line, report.md) when an iteration's estimated KL(policy || starting policy) exceeds this many nats; null: never")
    eval_cache: bool = Field(True, description="reuse iteration 0's held-out and IFEval generations from an earlier run (any seed) with the same starting policy, prompts, decoding settings and hardware dtype (online_rlhf/eval_cache.py; cache under .cache/eval); false: always decode")
    co_decode: bool = Field(True, description="decode the generation stages of one policy (an iteration's eval_generate, kl_generate, ifeval_generate, and the next iteration's generate) with one vLLM engine start, each stage keeping its own output, stats and .done (online_rlhf/co_decode.py; a sampled stage joins only an in-process engine, i.e. one CPU shard); false: one engine start per stage")
    wandb: bool = Field(False, description="log the loop's metrics to wandb (offline unless WANDB_MODE is set)")
    dry_run: bool = Field(False, description="memory check instead of the run: plan as usual, then run SFT (when enabled) and iteration 1's generate, rewards (source=reward_model) and dpo (or grpo) stages once each in dry mode (one step at the largest shapes), print peak memory vs available per stage and what to lower; writes no checkpoint and marks no stage done. Exit 1 when a stage would not fit")

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_is_a_mapping(cls, v):
        if v is not None and not isinstance(v, (dict, LoopLora)):
            raise ValueError(f"lora must be a mapping of r, alpha, dropout, target_modules, e.g. lora='{{r: 16, "
                             f"alpha: 32}}' (lora='{{}}' takes every default: r 16, alpha 2 x r); lora=null turns it "
                             "off")
        return v

    @field_validator("num_processes")
    @classmethod
    def _positive_processes(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"num_processes must be >= 1 or auto, got {v}")
        return v

    @model_validator(mode="after")
    def _check_machines(self):
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank={self.machine_rank} must be < num_machines={self.num_machines} "
                             "(machines are 0-based)")
        check_machines(self.num_machines, None if self.num_processes == "auto" else self.num_processes,
                       self.main_process_ip)
        return self

    @model_validator(mode="after")
    def _one_lora_key(self):
        # the loop's lora saves adapters; dpo.lora / grpo.lora merge each iteration: not both
        for name in ("dpo", "grpo"):
            if self.lora is not None and getattr(self, name).model_dump(exclude_unset=True).get("lora") is not None:
                raise ValueError(f"lora and {name}.lora are both set: the loop's lora trains one adapter through the "
                                 f"whole loop (adapter-only saves), {name}.lora merges a fresh adapter into a full "
                                 f"checkpoint each iteration. Keep one: move its values to lora ({{r, alpha, dropout, "
                                 f"target_modules}}) and drop {name}.lora, or set lora=null")
        return self

    @model_validator(mode="after")
    def _one_train_slice_rule(self):
        # _prompt_slice takes slice i of prompts_per_iteration when it is set: train_limit would do nothing.
        if self.train_limit is not None and self.prompts_per_iteration is not None:
            raise ValueError(f"train_limit={self.train_limit} and prompts_per_iteration={self.prompts_per_iteration} "
                             "are both set, and with prompts_per_iteration each iteration takes its own slice, so "
                             "train_limit would be ignored; keep one: prompts_per_iteration=null (the first "
                             "train_limit prompts every iteration) or train_limit=null")
        return self

    @field_validator("run_name")
    @classmethod
    def _one_folder_name(cls, v: str) -> str:
        # run_loop.sh --fresh clears <output_root>/<run_name>: it must be a folder inside output_root.
        if not v or v in (".", "..") or any(c in v for c in "/\\\0"):
            raise ValueError(f"run_name must be one folder name inside output_root (no '/', not '.' or '..'), "
                             f"got {v!r}; put the parent folder in output_root")
        return v


def _with_row_sections(base: type[StageConfig]) -> type[StageConfig]:
    """``base`` plus one field per loop section that a row of the stage table names as its own
    (:attr:`Stage.section`) and ``base`` lacks, typed by :func:`section_model` of the row's config
    class (default: no keys set). ``base`` itself when every row's section has its field."""
    extra = {}
    for s in STAGES.values():
        if s.section and s.section not in base.model_fields and s.section not in extra:
            sec = section_model(s.config, s.section)
            extra[s.section] = (sec, Field(default_factory=sec, description=f"{s.config.__name__} fields (stage {s.name})"))
    if not extra:
        return base
    return create_model("LoopConfig", __base__=base, __doc__=base.__doc__, __module__=__name__, **extra)


LoopConfig = _with_row_sections(LoopConfig)


def iteration_config(cfg: LoopConfig, i: int) -> LoopConfig:
    """The loop config as seen by iteration ``i`` (``per_iteration[i]`` merged in).

    Raises:
        ConfigError: a ``per_iteration.<i>`` value of the wrong type (names ``per_iteration.<i>``).
    """
    if i not in cfg.per_iteration:
        return cfg
    merged = deep_merge(cfg.model_dump(exclude_unset=True), cfg.per_iteration[i])
    return LoopConfig.from_dict(merged, f"per_iteration.{i}")


