"""The loop's stages in one declarative table: what each stage runs, in which environment, how it
is launched, which config class it reads, which of that config's fields name its inputs and
outputs, and which stats class its stats file follows. Importable without torch or vLLM.

``online_rlhf.loop plan`` walks this table to write each stage's YAML (everything the stage needs,
launch settings included) and ``plan.json``; ``online_rlhf.loop exec`` starts a stage from its YAML
with ``online_rlhf.stage_launch.launch_command``; ``run_loop.sh`` and ``scripts/other_machine.sh`` run each iteration's
planned stages in this table's order (``loop stages RUN_DIR I``), and ``loop after`` runs a row's
``after`` hook.

Adding a stage (docs/adding-a-stage.md): its config class (``online_rlhf.stage_configs``), its stats
class (``online_rlhf.stats``), its module (``online_rlhf/stages/``, a recipe: ``main`` calls one
function a step, and a stage that loads a model has a ``dry_run(cfg)``; the module may be the row's
entry itself), one :class:`Stage` row here with the function that wires its config from the loop
config, and its docs page. Its loop section, the keys the loop owns there
(``online_rlhf.loop_config.owned_keys``), its page's tables (``online_rlhf.doc_tables.PAGES``) and its
example stats follow from the row. The loop has no list of stages of its own:
``tests/test_stage_table.py`` walks every row against every consumer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

from .config import ConfigError, deep_merge, load_yaml
from .paths import PROJECT_ROOT, default_data_dir, default_model_dir
from .jsonl import read_json
from .stage_checks import DPO_CHECKS, GENERATE_CHECKS, GRPO_CHECKS, SFT_CHECKS, SFT_CONFIG, PlanChecks
from .stage_configs import (DPOStageConfig, GenerateConfig, GRPOStageConfig, IFEvalScoreConfig, KLConfig, PairsConfig,
                            RewardConfig, SFTStageConfig, StageConfig)
from .stats import (DPOStats, GenerateStats, GRPOStats, IFEvalStats, KLStats, PairsStats, RewardStats, SFTStats,
                    StageStats, stats_path)

# ``LoopConfig`` in the annotations below is the loop config (``online_rlhf.loop_config.LoopConfig``) of
# one iteration. That module types its sections from this table's rows, so the table does not import
# it, not even for type checking: the name stays text (``from __future__ import annotations``).


def section(c: LoopConfig, name: str) -> dict:
    """The keys a user set in the loop's ``name`` section (defaults left to the stage class)."""
    return getattr(c, name).model_dump(exclude_unset=True)


def stage_file(path: str | None, key: str = "dpo_config") -> dict:
    """A stage's own YAML (relative paths from the project root); {} for None.

    Raises:
        ConfigError: no such file (names the loop ``key`` that points to it).
    """
    if not path:
        return {}
    p = Path(path) if Path(path).is_absolute() else PROJECT_ROOT / path
    if not p.is_file():
        raise ConfigError(f"{key}={path}: no such file (looked at {p}; a relative path is taken from the project "
                          f"root {PROJECT_ROOT}). Give an absolute path or one relative to the project root.")
    return load_yaml(p)


def prompt_source(name: str, split: str) -> str:
    """``default`` -> the prepared default file of ``split``: ``train`` the IF prompts
    (``if_train.jsonl``: IFEval's constraint types on the project's own templates), ``eval`` IFBench's
    held-out split (``ifbench_eval.jsonl``: constraint types never trained on); anything else as given."""
    if name == "default":
        return str(default_data_dir() / ("if_train.jsonl" if split == "train" else f"ifbench_{split}.jsonl"))
    return name


def starting_policy(cfg: LoopConfig, run_dir: Path) -> str:
    if cfg.sft.get("enabled"):
        return str(run_dir / "sft" / "model")
    return str(default_model_dir()) if cfg.policy == "default" else cfg.policy


def policy_of(cfg: LoopConfig, run_dir: Path, i: int) -> str:
    """Policy (its full weights) that iteration ``i`` samples from: the starting policy for i <= 1,
    else model of i-1; under the loop's ``lora`` key always the starting policy, with
    :func:`adapter_of` on top."""
    if cfg.lora is not None:
        return starting_policy(cfg, run_dir)
    return starting_policy(cfg, run_dir) if i <= 1 else str(run_dir / f"iter_{i - 1}" / "model")


def adapter_of(cfg: LoopConfig, run_dir: Path, i: int) -> dict:
    """``{"adapter": <folder>}``: under the loop's ``lora`` key, the LoRA adapter iteration ``i``
    samples with (the one iteration i-1's update saved in ``iter_<i-1>/model``); ``{}`` for i <= 1
    (the starting policy alone) and without ``lora``, so that a stage config without an adapter
    holds no ``adapter`` key."""
    if cfg.lora is None or i <= 1:
        return {}
    return {"adapter": str(run_dir / f"iter_{i - 1}" / "model")}


def _update_lora(c: LoopConfig, run_dir: Path, i: int) -> dict:
    """An update stage's (DPO, GRPO) LoRA keys under the loop's ``lora``: the peft config, the adapter
    to continue (iteration i-1's; none at i = 1) and adapter-only saves; ``{}`` without it."""
    if c.lora is None:
        return {}
    return {"lora": c.lora.peft_dict(), **adapter_of(c, run_dir, i), "save_adapter": True}


def _processes(c: LoopConfig) -> Optional[int]:
    """The loop's process count; None while it is still ``auto`` (the plan resolves it from the DPO
    batch sizes, which it reads from these same stage configs, then builds them again)."""
    return None if c.num_processes == "auto" else c.num_processes


# --- how the loop wires each stage's config (run_dir: the run directory; i: the iteration) ---

def _sft(c: LoopConfig, run_dir: Path, i: int) -> dict:
    s = dict(c.sft)
    s.pop("enabled", None)
    d = deep_merge(stage_file(s.pop("config", SFT_CONFIG), "sft.config"), s)
    if not d.get("dataset"):
        raise ConfigError("sft.enabled=true needs sft.dataset=<SFT JSONL of {messages: [...]}> "
                          "(e.g. from sft/build_sft_data.py).")
    d["base_model"] = str(default_model_dir()) if c.policy == "default" else c.policy
    d["output_dir"] = str(run_dir / "sft" / "model")
    return d


def _generate(c: LoopConfig, run_dir: Path, i: int) -> dict:
    it = run_dir / f"iter_{i}"
    # GRPO trains on the sampled token ids (the text need not re-tokenize to them); DPO on the text.
    ids = {"save_token_ids": True} if c.algorithm == "grpo" else {}
    return {"model": policy_of(c, run_dir, i), **adapter_of(c, run_dir, i), "seed": c.seed + 1000 * i,
            **section(c, "generation"), **ids,
            "num_shards": c.generation_shards, "num_machines": c.num_machines, "prompts": str(it / "prompts.jsonl"),
            "output": str(it / "generated.jsonl")}


def _eval_generate(c: LoopConfig, run_dir: Path, i: int) -> dict:
    # The held-out set is generated by the model *after* iteration i (iteration 0: the start).
    gen = {k: v for k, v in section(c, "generation").items() if k not in ("k", "temperature", "top_p")}
    return {"model": policy_of(c, run_dir, i + 1), **adapter_of(c, run_dir, i + 1), "seed": c.seed, **gen,
            **section(c, "evaluation"),
            "num_shards": c.generation_shards, "num_machines": c.num_machines, "prompts": prompt_source(c.eval_prompts, "eval"),
            "prompt_field": c.eval_prompt_field or c.prompt_field, "limit": c.eval_limit,
            "output": str(run_dir / f"iter_{i}" / "eval_generated.jsonl")}


def _ifeval_generate(c: LoopConfig, run_dir: Path, i: int) -> dict:
    # IFEval on the model after iteration i: always one greedy answer per prompt (the benchmark's
    # protocol, whatever the `evaluation` section samples), with the `ifeval` section's prompts,
    # limit and max_tokens.
    d = _eval_generate(c, run_dir, i)
    prompts = str(default_data_dir() / "ifeval.jsonl") if c.ifeval.prompts == "default" else c.ifeval.prompts
    return {**d, "k": 1, "temperature": 0.0, "top_p": 1.0, "prompts": prompts, "prompt_field": None, "limit": c.ifeval.limit, "max_tokens": c.ifeval.max_tokens,
            "output": str(run_dir / f"iter_{i}" / "ifeval_generated.jsonl")}


def _ifeval_score(c: LoopConfig, run_dir: Path, i: int) -> dict:
    it = run_dir / f"iter_{i}"
    return {"input": str(it / "ifeval_generated.jsonl"), "output": str(it / "ifeval.jsonl")}


def _ifeval_runs(c: LoopConfig, i: int) -> bool:
    """``ifeval.when``: 0 and N (``ends``), 0..N (``every``) or none (``never``)

    IFEval runs at iteration 0 and the last, at every iteration, or never."""
    return {"ends": i in (0, c.iterations), "every": True, "never": False}[c.ifeval.when]


def _kl_generate(c: LoopConfig, run_dir: Path, i: int) -> dict:
    # kl_samples responses per held-out prompt SAMPLED from the model after iteration i at
    # temperature 1, top_p 1 (its own distribution), otherwise as the held-out generation.
    d = _eval_generate(c, run_dir, i)
    return {**d, "k": c.kl_samples, "temperature": 1.0, "top_p": 1.0, "seed": c.seed + 1000 * i + 500,
            "save_token_ids": True, "output": str(run_dir / f"iter_{i}" / "kl_generated.jsonl")}


def _kl(c: LoopConfig, run_dir: Path, i: int) -> dict:
    it = run_dir / f"iter_{i}"
    return {"input": str(it / "kl_generated.jsonl"), "policy": policy_of(c, run_dir, i + 1),
            **adapter_of(c, run_dir, i + 1), "reference": starting_policy(c, run_dir), "output": str(it / "kl.jsonl")}


def _machines(c: LoopConfig) -> dict:
    """The multi-machine keys of an ``accelerate launch`` stage: the machine count, and machine 0's
    address and port only when there are several machines (one machine: left at null, so that its
    stage configs and hashes stay what they were)."""
    if c.num_machines == 1:
        return {"num_machines": 1}
    return {"num_machines": c.num_machines, "main_process_ip": c.main_process_ip,
            "main_process_port": c.main_process_port}


def _reward_launch(c: LoopConfig) -> dict:
    """A reward model runs data-parallel on the loop's processes (over its machines); other sources
    in one process on machine 0."""
    if c.reward.source == "reward_model":
        return {"num_processes": _processes(c), "launch_profile": c.launch_profile, **_machines(c)}
    return {"num_processes": 1}


def _rewards(c: LoopConfig, run_dir: Path, i: int) -> dict:
    it = run_dir / f"iter_{i}"
    return {**section(c, "reward"), **_reward_launch(c), "input": str(it / "generated.jsonl"),
            "output": str(it / "rewards.jsonl")}


def _eval_rewards(c: LoopConfig, run_dir: Path, i: int) -> dict:
    it = run_dir / f"iter_{i}"
    return {**section(c, "reward"), **_reward_launch(c), "input": str(it / "eval_generated.jsonl"),
            "output": str(it / "eval.jsonl")}


def _pairs(c: LoopConfig, run_dir: Path, i: int) -> dict:
    it = run_dir / f"iter_{i}"
    return {"seed": c.seed + i, **section(c, "pairs"), "input": str(it / "rewards.jsonl"), "output": str(it / "pairs.jsonl")}


def _dpo(c: LoopConfig, run_dir: Path, i: int) -> dict:
    own = section(c, "dpo")
    dpo = deep_merge(stage_file(c.dpo_config, "dpo_config"), own)
    # the loop's seed beats the stage file's; the loop's own dpo.training beats both
    training = {**dpo.pop("training", {}), "seed": c.seed, **own.get("training", {})}
    ref = starting_policy(c, run_dir) if c.ref_model == "initial" else None
    return {**dpo, **_update_lora(c, run_dir, i), "training": training, "policy": policy_of(c, run_dir, i), "reference": ref,
            "pairs": str(run_dir / f"iter_{i}" / "pairs.jsonl"), "output_dir": str(run_dir / f"iter_{i}" / "model"),
            "num_processes": _processes(c), "launch_profile": c.launch_profile, **_machines(c)}


def _grpo(c: LoopConfig, run_dir: Path, i: int) -> dict:
    own = section(c, "grpo")
    gen = GenerateConfig.model_fields
    sampled = {k: section(c, "generation").get(k, gen[k].default) for k in ("max_tokens", "temperature")}
    ref = starting_policy(c, run_dir) if c.ref_model == "initial" else None
    # the stage file, the loop's seed, the loop's own grpo keys; then the rollouts' max_tokens and
    # temperature, which only the generation section sets (the file and the section refuse them)
    return {**stage_file(c.grpo_config, "grpo_config"), "seed": c.seed, **own,
            "max_completion_length": sampled["max_tokens"], "temperature": sampled["temperature"] or 1.0,
            **_update_lora(c, run_dir, i), "policy": policy_of(c, run_dir, i), "reference": ref,
            "rewards": str(run_dir / f"iter_{i}" / "rewards.jsonl"),
            "output_dir": str(run_dir / f"iter_{i}" / "model"), "num_processes": _processes(c),
            "launch_profile": c.launch_profile, **_machines(c)}


def no_pairs_stop(run_dir: Path, i: int) -> str | None:
    """The line that stops the loop after iteration ``i``'s pairs stage when it made 0 pairs (DPO
    would have nothing to train on and fail), from the pairs stats (:class:`PairsStats`): the
    iteration, the pairs file, why its prompts gave no pair and what to change
    (:meth:`PairsStats.no_pair_causes`). None when the iteration has no pairs stage (GRPO: its
    stage keeps the policy when no group has a reward spread) or the file has pairs.

    Raises:
        FileNotFoundError, DataError: the iteration's plan.json or the pairs stats are missing or
            not valid (the messages name the file).
    """
    entries = read_json(run_dir / f"iter_{i}" / "plan.json")
    if "pairs" not in entries or "dpo" not in entries:
        return None
    pairs_file = entries["pairs"]["outputs"][0]
    st = PairsStats.read(stats_path(pairs_file))
    if st.pairs_out > 0:
        return None
    causes, fixes = st.no_pair_causes()
    why = "; ".join(causes) if st.records_in else "the rewards file had no records"
    fix = "; ".join(fixes) if st.records_in else "more train prompts (prompts_per_iteration, train_prompts)"
    return (f"iteration {i}: 0 pairs in {pairs_file} from {st.records_in} prompts, so DPO has nothing to train on; "
            f"stopped before DPO. Why: {why or 'see skipped_examples in ' + str(stats_path(pairs_file))}. "
            f"Change: {fix or 'see skipped_examples in the pairs stats'}; then rerun the same command.")


def _dpo_run(c: LoopConfig) -> bool:
    """``algorithm: dpo``"""
    return c.algorithm == "dpo"


def _grpo_run(c: LoopConfig) -> bool:
    """``algorithm: grpo``"""
    return c.algorithm == "grpo"


def _sft_enabled(c: LoopConfig) -> bool:
    """``sft.enabled``"""
    return bool(c.sft.get("enabled"))


def _kl_enabled(c: LoopConfig) -> bool:
    """``kl_samples > 0``"""
    return c.kl_samples > 0


def _always_enabled(c: LoopConfig) -> bool:
    """Every row's ``enabled`` unless it names its own."""
    return True


@dataclass(frozen=True)
class DryRun:
    """How the loop's dry run (``loop dry-run``, ``online_rlhf.loop.memory_check``) measures a stage:
    the stage's own ``dry_run=true`` (its module's ``dry_run``; its config class's
    ``dry_run_advice`` names what to lower) on the planned config of one iteration.

    Attributes:
        iteration: the iteration whose planned config it runs on (0: before the loop).
        policy_keys: the config keys naming the model it samples from or trains (and its reference).
            When SFT runs first, that model is SFT's output, which a dry run does not make: each of
            these keys that is set is given the SFT base model instead.
        base_model_key: the key naming the model this stage starts from, when its output is the
            later stages' starting policy (SFT's ``base_model``): they are measured on that model.
        skip: ``resolved config -> why not, or None``: a stage whose config loads no model is left
            out of the measurement with that note (rewards from a verifier).
    """

    iteration: int
    policy_keys: tuple[str, ...] = ()
    base_model_key: Optional[str] = None
    skip: Optional[Callable[[dict], Optional[str]]] = None


def _no_reward_model(d: dict) -> Optional[str]:
    """Rewards load a model only from ``source=reward_model``."""
    return None if d.get("source") == "reward_model" else f"source={d.get('source')} loads no model"


# When a row runs (:attr:`Stage.schedule`): iteration 0 only (before the first update: SFT), the
# iterations that update the policy, or all of them (0: the starting policy's evaluation).
Schedule = Literal["0", "1..N", "0..N"]


@dataclass(frozen=True)
class Provenance:
    """What a stage YAML's comment block says about values the loop's layers do not explain
    (``online_rlhf.loop.provenance``): prose for the reader, which ``tests/test_stage_table.py``
    checks against what the row's ``build`` does.

    Attributes:
        set_by_plan: ``{key: origin}``: values the row's ``build`` sets itself, and why (e.g.
            kl_generate's ``temperature``); an origin ``loop key X ...`` names the loop key the
            value follows. A key every row of a section sets is also loop-owned there
            (``online_rlhf.loop_config.owned_keys``).
        derived_from: ``{key: top-level loop key}`` the stage's value of ``key`` comes from, where it
            differs from the plan's usual rule (eval_generate's ``prompts``: ``eval_prompts``).
        seed_offset: how ``build`` offsets the loop's ``seed`` per iteration (``+ 1000 x iteration``).
        stage_file_default: the stage's own YAML when the loop key :attr:`Stage.stage_file_key`
            names none.
    """

    set_by_plan: dict[str, str] = field(default_factory=dict, hash=False)
    derived_from: dict[str, str] = field(default_factory=dict, hash=False)
    seed_offset: Optional[str] = None
    stage_file_default: Optional[str] = None


def _on_machine_0(d: dict) -> bool:
    """The stage runs on machine 0 only."""
    return False


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One row of the stage table, written with a keyword for every field.

    Three words for three things: :attr:`env` is the virtual environment the stage runs in,
    :attr:`schedule` the iterations it runs in, and :attr:`launch_with` how its process is started
    (the loop key ``launcher: local | slurm`` says where the run's machines come from; the SFT
    stage's own ``launcher`` key how it starts Axolotl).

    Attributes:
        name: the stage's name in ``run_loop.sh``, ``iter_<i>/configs/<name>.yaml`` and ``<name>.done``.
        env: ``infer`` (.venv-infer, vLLM) or ``train`` (.venv-train).
        entry: the entry script, relative to the project root, or the stage module itself
            (``online_rlhf.stages.NAME``, run with ``python -m``: ``stage_launch.is_module_entry``).
        launch_with: ``python`` (one process; the stage may start its own shards) or ``accelerate``
            (``accelerate launch`` with the config's ``num_processes`` / ``launch_profile``; a single
            CPU process without a DeepSpeed profile runs as plain python).
        config: the stage's config class.
        inputs / outputs: the config fields naming the files or checkpoint folders the stage reads /
            writes (a field set to null is left out). Inputs' content goes into the freshness hash.
        stats: the stage's stats class (``online_rlhf.stats``); its file is
            ``stats_path(<first output>)``, read back through the class by ``loop.metrics``.
        schedule: the iterations it runs in: ``"0"`` (before the loop), ``"1..N"`` (each update) or
            ``"0..N"`` (the starting policy's too); or ``(loop config, i) -> bool`` when they depend
            on the config (IFEval: ``ifeval.when``), the first line of whose docstring is the
            iterations as docs/architecture.md shows them.
        build: ``(loop config of the iteration, run dir, i) -> config mapping`` (before validation).
        sections: the loop sections the stage's values come from (for the provenance comments), its
            own first (:attr:`section`).
        stage_file_key: the loop key naming the stage's own YAML that the section is layered on.
        enabled: whether the loop runs the stage at all; the first line of its docstring is the
            condition as the stage list of docs/architecture.md shows it (``algorithm: dpo``).
        after: ``(run dir, i) -> line or None``, run on machine 0 after the stage (``loop after``): a
            line stops the loop with that reason (pairs: 0 pairs, :func:`no_pairs_stop`).
        cache_iteration_0: its iteration-0 output depends only on the starting policy, the prompts
            and its settings, so ``loop exec`` reuses it from an earlier run (``online_rlhf.eval_cache``).
        dry_run: how the loop's dry run measures the stage (:class:`DryRun`: its module's
            ``dry_run``, the stage's set-up and one step at the largest shapes); None: the loop's
            dry run leaves it out (it loads no model, or it is an evaluation twin lighter than the
            training stage that is measured). Its name is in ``DryRunStats.stage``.
        every_machine: ``d -> bool``: whether the stage of resolved config ``d`` runs on every machine
            of a multi-machine run (its processes or shards span them; ``loop exec ... machine_rank=k``
            takes part), else on machine 0 only (``online_rlhf.stage_launch.stage_machines``).
        checks: what the plan checks of the stage beyond its config class
            (:class:`online_rlhf.stage_checks.PlanChecks`).
        section_inputs: inputs a user names in the stage's loop section (rewards: ``reward_model``); the
            plan sets every other input (``online_rlhf.loop_config.owned_keys``).
        loop_owned: keys the plan sets (so the section refuses them) beyond the row's files, the
            launch keys (``online_rlhf.loop_config.LAUNCH_KEYS``) and ``set_by_plan``: values taken
            from top-level loop keys (generation's ``prompt_field``, ``limit``).
        provenance: what the YAML's comment block says of the values the row's ``build`` derives
            (:class:`Provenance`).
        page: the stage's docs page, from the project root (None: ``docs/<name>.md``); it holds the
            key and stats tables ``online_rlhf.doc_tables`` generates from the two classes.
    """

    name: str
    env: Literal["infer", "train"]
    entry: str
    launch_with: Literal["python", "accelerate"]
    config: type[StageConfig]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stats: type[StageStats]
    schedule: Schedule | Callable[[LoopConfig, int], bool]
    build: Callable[[LoopConfig, Path, int], dict]
    sections: tuple[str, ...] = ()
    stage_file_key: Optional[str] = None
    enabled: Callable[[LoopConfig], bool] = _always_enabled
    after: Optional[Callable[[Path, int], Optional[str]]] = None
    cache_iteration_0: bool = False
    dry_run: Optional[DryRun] = None
    every_machine: Callable[[dict], bool] = _on_machine_0
    checks: PlanChecks = PlanChecks()
    section_inputs: tuple[str, ...] = ()
    loop_owned: tuple[str, ...] = ()
    provenance: Provenance = field(default_factory=Provenance, hash=False)
    page: Optional[str] = None

    @property
    def section(self) -> Optional[str]:
        """The loop section the stage's own keys live in (``generation`` for generate, ``reward`` for
        rewards, ...): the first of :attr:`sections`; None for a stage without one (kl, ifeval_score)."""
        return self.sections[0] if self.sections else None

    @property
    def docs_page(self) -> str:
        """The stage's docs page from the project root: :attr:`page`, else ``docs/<name>.md``."""
        return self.page or f"docs/{self.name}.md"

    @property
    def before_the_loop(self) -> bool:
        """It runs once, before the first update (``schedule="0"``: SFT); its stats belong to the
        run, not to iteration 0."""
        return self.schedule == "0"

    def runs_in(self, cfg: LoopConfig, i: int) -> bool:
        """Whether this stage is part of iteration ``i`` of the loop ``cfg``."""
        if not self.enabled(cfg):
            return False
        if callable(self.schedule):
            return self.schedule(cfg, i)
        return {"0": i == 0, "1..N": i >= 1, "0..N": True}[self.schedule]

    def io(self, d: dict) -> tuple[list[str], list[str]]:
        """(inputs, outputs) of a resolved config mapping ``d``: the paths in the table's fields."""
        return ([str(d[k]) for k in self.inputs if d.get(k)], [str(d[k]) for k in self.outputs if d.get(k)])


def _always(d: dict) -> bool:
    """The stage runs on every machine (its shards or processes span them)."""
    return True


def _reward_model_scores(d: dict) -> bool:
    """A reward model scores data-parallel over every machine; other sources run in one process on machine 0."""
    return d.get("source", "verifier") == "reward_model"


# Generation keys the loop sets from its top-level prompt keys (prompt_field, train_limit / eval_limit).
_TOP_LEVEL_PROMPTS = ("prompt_field", "limit")
_KL_SAMPLES = "the KL estimate samples from the policy itself"

# In the order of one iteration.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage(name="sft", env="train", entry="sft/run_sft.py", launch_with="python", config=SFTStageConfig,
          inputs=("base_model", "dataset"), outputs=("output_dir",), stats=SFTStats, schedule="0", build=_sft,
          sections=("sft",), stage_file_key="sft.config", enabled=_sft_enabled, checks=SFT_CHECKS,
          dry_run=DryRun(iteration=0, base_model_key="base_model"),
          provenance=Provenance(set_by_plan={"base_model": "loop key policy (SFT starts from the policy)"},
                                stage_file_default=SFT_CONFIG)),
    Stage(name="generate", env="infer", entry="generation/launch.py", launch_with="python", config=GenerateConfig,
          inputs=("model", "adapter", "prompts"), outputs=("output",), stats=GenerateStats, schedule="1..N", build=_generate,
          sections=("generation",), every_machine=_always, checks=GENERATE_CHECKS,
          dry_run=DryRun(iteration=1, policy_keys=("model",)), loop_owned=_TOP_LEVEL_PROMPTS,
          provenance=Provenance(seed_offset="+ 1000 x iteration"), page="docs/generation.md"),
    Stage(name="rewards", env="train", entry="annotate_data/get_rewards.py", launch_with="accelerate",
          config=RewardConfig, inputs=("input", "reward_model"), outputs=("output",), stats=RewardStats,
          schedule="1..N", build=_rewards, sections=("reward",), every_machine=_reward_model_scores,
          dry_run=DryRun(iteration=1, skip=_no_reward_model), section_inputs=("reward_model",),
          page="docs/rewards.md"),
    Stage(name="pairs", env="train", entry="annotate_data/make_pairs.py", launch_with="python", config=PairsConfig,
          inputs=("input",), outputs=("output",), stats=PairsStats, schedule="1..N", build=_pairs,
          sections=("pairs",), enabled=_dpo_run, after=no_pairs_stop, provenance=Provenance(seed_offset="+ iteration")),
    Stage(name="dpo", env="train", entry="dpo_iteration/run_dpo.py", launch_with="accelerate", config=DPOStageConfig,
          inputs=("policy", "adapter", "pairs", "reference"), outputs=("output_dir",), stats=DPOStats, schedule="1..N",
          build=_dpo, sections=("dpo",), stage_file_key="dpo_config", enabled=_dpo_run, every_machine=_always,
          checks=DPO_CHECKS, dry_run=DryRun(iteration=1, policy_keys=("policy", "reference")),
          loop_owned=("save_adapter",)),
    Stage(name="grpo", env="train", entry="grpo_iteration/run_grpo.py", launch_with="accelerate",
          config=GRPOStageConfig, inputs=("policy", "adapter", "rewards", "reference"), outputs=("output_dir",), stats=GRPOStats,
          schedule="1..N", build=_grpo, sections=("grpo",), stage_file_key="grpo_config", enabled=_grpo_run,
          every_machine=_always, checks=GRPO_CHECKS, dry_run=DryRun(iteration=1, policy_keys=("policy", "reference")),
          loop_owned=("save_adapter",), provenance=Provenance(set_by_plan={
              "temperature": "loop key generation.temperature (the rollouts' sampling temperature)",
              "max_completion_length": "loop key generation.max_tokens (the rollouts' max new tokens)"})),
    Stage(name="eval_generate", env="infer", entry="generation/launch.py", launch_with="python",
          config=GenerateConfig, inputs=("model", "adapter", "prompts"), outputs=("output",), stats=GenerateStats,
          schedule="0..N", build=_eval_generate, sections=("evaluation", "generation"), cache_iteration_0=True,
          every_machine=_always, loop_owned=_TOP_LEVEL_PROMPTS,
          provenance=Provenance(derived_from={"prompts": "eval_prompts"}), page="docs/generation.md"),
    Stage(name="eval_rewards", env="train", entry="annotate_data/get_rewards.py", launch_with="accelerate",
          config=RewardConfig, inputs=("input", "reward_model"), outputs=("output",), stats=RewardStats,
          schedule="0..N", build=_eval_rewards, sections=("reward",), every_machine=_reward_model_scores,
          section_inputs=("reward_model",), page="docs/rewards.md"),
    # Evaluation beyond the held-out reward: the KL of the iteration's policy from the starting
    # policy (iterations >= 1; 0 at iteration 0) and IFEval (iteration 0 and the last by default).
    Stage(name="kl_generate", env="infer", entry="generation/launch.py", launch_with="python", config=GenerateConfig,
          inputs=("model", "adapter", "prompts"), outputs=("output",), stats=GenerateStats, schedule="1..N",
          build=_kl_generate, sections=("evaluation", "generation"), enabled=_kl_enabled, every_machine=_always,
          loop_owned=_TOP_LEVEL_PROMPTS, page="docs/generation.md",
          provenance=Provenance(set_by_plan={
              "k": "loop key kl_samples", "prompts": "loop key eval_prompts (the held-out prompts)",
              "temperature": f"{_KL_SAMPLES} (temperature 1)", "top_p": f"{_KL_SAMPLES} (top_p 1)",
              "seed": "loop key seed + 1000 x iteration + 500"})),
    Stage(name="kl", env="train", entry="annotate_data/kl_estimate.py", launch_with="python", config=KLConfig,
          inputs=("input", "policy", "adapter", "reference"), outputs=("output",), stats=KLStats, schedule="1..N", build=_kl,
          enabled=_kl_enabled, provenance=Provenance(set_by_plan={
              "reference": "the starting policy (KL is measured from where the loop started)"})),
    Stage(name="ifeval_generate", env="infer", entry="generation/launch.py", launch_with="python",
          config=GenerateConfig, inputs=("model", "adapter", "prompts"), outputs=("output",), stats=GenerateStats,
          schedule=_ifeval_runs, build=_ifeval_generate, sections=("ifeval", "evaluation", "generation"),
          cache_iteration_0=True, every_machine=_always,
          provenance=Provenance(set_by_plan={"prompts": "loop key ifeval.prompts"}), page="docs/generation.md"),
    Stage(name="ifeval_score", env="train", entry="annotate_data/ifeval_score.py", launch_with="python",
          config=IFEvalScoreConfig, inputs=("input",), outputs=("output",), stats=IFEvalStats, schedule=_ifeval_runs,
          build=_ifeval_score, page="docs/ifeval-score.md"),
)}
