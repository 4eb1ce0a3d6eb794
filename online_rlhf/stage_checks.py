"""The plan's own checks of single stages, beyond what each stage's config class validates: each
row of the stage table names its checks (``online_rlhf.stage_table.Stage.checks``, a
:class:`PlanChecks`), so that the loop's plan (``online_rlhf.loop``) runs them without a branch per
stage. Importable without torch or vLLM (transformers is imported inside the check that needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .config import ConfigError, StageConfig
from .paths import default_model_dir
from .dpo_config import check_dpo_config, check_dpo_keys, check_dpo_launch, dpo_batch
from .trl_args import check_axolotl_keys

# ``LoopConfig`` in the annotations below is ``online_rlhf.loop_config.LoopConfig``, which is built
# from the stage table, which imports this module: the name stays text, never imported here.

SFT_CONFIG = "configs/sft.yaml"  # the Axolotl stage file of sft.config when the loop config names none


@dataclass(frozen=True)
class PlanChecks:
    """What the plan checks of one stage; each check optional (None: nothing to check).

    Attributes:
        config: ``(cfg, i, d, stage_cfg, where) -> None``, while the plan builds every stage of
            every iteration dry: iteration ``i``'s resolved stage mapping ``d`` and its validated
            config ``stage_cfg`` (``cfg``: the run's loop config; ``where``: ``"<source>,
            iteration <i>"``, to start the message with). Raises ConfigError.
        batch: ``d -> (train_batch_size, gradient_accumulation_steps)``: the batch that the
            loop's ``num_processes`` (``auto`` included) must split evenly (``train_batch_size``
            None: any count).
        launch: ``(cfg, i, d, source) -> None``, once ``num_processes`` is resolved: the batch
            per device, and what a dry run needs (``source``: the config file and overrides).
            Raises ConfigError.
        library: ``(d, i, provenance) -> None``: builds the library config the stage builds from
            its YAML values (DPO: ``trl.DPOConfig``, :func:`online_rlhf.dpo_config.check_dpo_config`)
            as the stage will, so that values the library refuses together stop the plan, naming
            each key and where it was set (``provenance``: the stage YAML's ``(key, value, origin)``
            list). Raises ConfigError.
        prompts: ``(c, i, rows, d, tokenizers) -> warnings``: iteration ``i``'s train prompts
            ``rows`` against the stage's values ``d`` (``c``: the iteration's loop config;
            ``tokenizers``: a cache the plan keeps across iterations).
    """

    config: Optional[Callable[[LoopConfig, int, dict, StageConfig, str], None]] = None
    batch: Optional[Callable[[dict], tuple[Optional[int], int]]] = None
    launch: Optional[Callable[[LoopConfig, int, dict, str], None]] = None
    library: Optional[Callable[[dict, int, list[tuple[str, Any, str]]], None]] = None
    prompts: Optional[Callable[[LoopConfig, int, list[dict], dict, dict], list[str]]] = None


def check_sft_keys(cfg: LoopConfig, i: int, d: dict, sft: StageConfig, where: str) -> None:
    """The SFT stage file's Axolotl keys (the loop's own ``sft`` keys are checked with the loop config).

    Raises:
        ConfigError: a key Axolotl does not know (named with the stage file).
    """
    check_axolotl_keys(sft.model_extra or {}, prefix=f"{cfg.sft.get('config', SFT_CONFIG)}: ",
                       also_known=set(type(sft).model_fields))
    adapter = (sft.model_extra or {}).get("adapter")
    if adapter and cfg.sft.get("enabled"):  # the stage refuses it too; here before any stage runs
        raise ConfigError(f"{where}: sft.adapter={adapter!r} (sft section or {cfg.sft.get('config', SFT_CONFIG)}): the "
                          "SFT stage trains every weight and hands the loop a full checkpoint. Remove adapter; for "
                          "LoRA in the updates set the loop key lora (lora='{r: 16}', docs/dpo.md).")
    if cfg.sft.get("enabled"):
        check_sft_data(sft)


def check_sft_data(sft: StageConfig) -> None:
    """With SFT on, every row of ``sft.dataset`` as the stage checks it before Axolotl starts
    (:func:`online_rlhf.sft_dataset.validate_sft_dataset`, with the dataset entry's message field).

    Raises:
        ConfigError: the file does not exist (naming ``sft.dataset``, the path and the fix).
        DataError: a malformed row or an empty file (naming ``sft.dataset``, the file and the line).
    """
    from .jsonl import DataError
    from .sft_dataset import dataset_entry, validate_sft_dataset

    path = Path(sft.dataset)
    if not path.is_file():
        raise ConfigError(f"sft.dataset={sft.dataset}: no such file (looked at {path.absolute()}); sft.enabled=true "
                          "trains on it before iteration 1. Fix the path (an absolute one is the surest) to a JSONL "
                          "file of {\"messages\": [{role, content}, ...]} rows, or set sft.enabled=false.")
    field = dataset_entry((sft.model_extra or {}).get("datasets"), sft.dataset)["field_messages"]
    try:
        validate_sft_dataset(path, field)
    except DataError as e:
        raise DataError(f"sft.dataset={sft.dataset}: {e}") from None


def check_generation_k(cfg: LoopConfig, i: int, d: dict, g: StageConfig, where: str) -> None:
    """The train rollouts need at least 2 responses per prompt (a pair; GRPO: a group).

    Raises:
        ConfigError: ``generation.k < 2``, with the usual range for the run's algorithm.
    """
    if g.k < 2:
        need = ("GRPO needs a group of at least 2 responses per train prompt (each response's advantage is "
                "its reward against the group's)" if cfg.algorithm == "grpo" else
                "a chosen/rejected pair needs at least 2 responses per train prompt")
        raise ConfigError(f"{where}: generation.k={g.k}, but {need}; set generation.k >= 2 "
                          f"({'4-16' if cfg.algorithm == 'grpo' else '4-8'} is usual).")


def check_grpo_length(cfg: LoopConfig, i: int, d: dict, grpo: StageConfig, where: str) -> None:
    """``grpo.max_length`` (prompt + completion tokens) must leave room for a prompt beside a
    completion of ``generation.max_tokens`` (the stage's ``max_completion_length``); the longest
    prompt is not tokenized here (the stage counts and warns about what it cuts or drops).

    Raises:
        ConfigError: ``max_length <= generation.max_tokens``, naming both keys and where max_length was set.
    """
    L, T = d.get("max_length"), d["max_completion_length"]
    if L is None or L > T:
        return
    if "max_length" in ((cfg.per_iteration.get(i) or {}).get("grpo") or {}):
        origin = f"per_iteration.{i}.grpo.max_length"
    elif "max_length" in cfg.grpo.model_dump(exclude_unset=True):
        origin = "the grpo section"
    else:  # the iteration's grpo_config: per_iteration.<i> over the run's
        origin = f"grpo_config={(cfg.per_iteration.get(i) or {}).get('grpo_config', cfg.grpo_config)}"
    raise ConfigError(f"{where}: grpo.max_length={L} ({origin}) is not above generation.max_tokens={T}: a completion "
                      "of max_tokens would leave no room for its prompt, so every group is dropped or cut. Set "
                      f"grpo.max_length above the longest prompt + generation.max_tokens (e.g. {T + 512}), lower "
                      "generation.max_tokens, or set grpo.max_length=null (no cap).")


def check_grpo_launch(cfg: LoopConfig, i: int, d: dict, src: str) -> None:
    """With ``dry_run=true``, iteration 1's ``grpo.max_length`` (the dry run's dummy prompt +
    completion is that long).

    Raises:
        ConfigError: a dry run without ``grpo.max_length``.
    """
    if cfg.dry_run and i == 1 and d.get("max_length") is None:
        raise ConfigError(f"{src}: dry_run=true needs grpo.max_length (the dummy prompt + completion is that "
                          "long); set it, e.g. grpo.max_length=1024.")


def grpo_prompt_length_warnings(c: LoopConfig, i: int, rows: list[dict], d: dict, tokenizers: dict) -> list[str]:
    """Iteration ``i``'s GRPO length check against its train prompts: the longest prompt (the starting
    policy's chat template, as the generation stage renders it) + ``generation.max_tokens`` against
    ``grpo.max_length``. Only where it is cheap: the starting policy's tokenizer is in a local folder
    (a Hub id or a model not made yet, e.g. the SFT model, is not checked here; the stage counts and
    warns about what it drops or cuts).

    Returns:
        one warning when a prompt would be dropped (it fills max_length) or a full-length completion cut.
    """
    L, T = d.get("max_length"), d["max_completion_length"]
    if L is None:
        return []
    path = str(default_model_dir()) if c.policy == "default" else c.policy  # the SFT model keeps its base's tokenizer
    if path not in tokenizers:
        tokenizers[path] = None
        if (Path(path) / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tokenizers[path] = AutoTokenizer.from_pretrained(path)
    tok = tokenizers[path]
    if tok is None or tok.chat_template is None:
        return []
    from .chat_tokens import ChatTokenError, chat_token_ids

    lengths = []
    for r in rows:
        try:
            lengths.append((len(chat_token_ids(tok, r["prompt"], add_generation_prompt=True)), r["id"]))
        except ChatTokenError:
            continue  # the generation stage skips and counts it
    if not lengths:
        return []
    longest, rid = max(lengths)
    if longest + T <= L:
        return []
    over = sum(n >= L for n, _ in lengths)
    return [f"iteration {i}: the longest train prompt ({rid!r}) is {longest} tokens; with generation.max_tokens={T} "
            f"a completion can reach {longest + T} > grpo.max_length={L} tokens, so long completions lose their tail"
            + (f" and {over} prompt(s) that fill max_length drop their group" if over else "")
            + f". Set grpo.max_length >= {longest + T} (or null), or lower generation.max_tokens."]


SFT_CHECKS = PlanChecks(config=check_sft_keys)
GENERATE_CHECKS = PlanChecks(config=check_generation_k)
DPO_CHECKS = PlanChecks(config=check_dpo_keys, batch=dpo_batch, launch=check_dpo_launch, library=check_dpo_config)
GRPO_CHECKS = PlanChecks(config=check_grpo_length, launch=check_grpo_launch, prompts=grpo_prompt_length_warnings)
