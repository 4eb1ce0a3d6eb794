"""The SFT stage's Axolotl config: the stage's YAML (``SFTStageConfig`` plus Axolotl keys) resolved
into the YAML Axolotl trains from: its dataset entry for the stage's JSONL, the keys checked against
Axolotl's schema, paths made absolute, the chat template and the turn-end tokens trained on, and the
keys the stage sets itself (output folder, prepared-data folder, the training-log plugin).
"""

from __future__ import annotations

from pathlib import Path

from online_rlhf.chat_tokens import turn_terminator
from online_rlhf.config import ConfigError
from online_rlhf.hardware import compute_dtype
from online_rlhf.paths import PROJECT_ROOT
from online_rlhf.sft_dataset import dataset_entry
from online_rlhf.stage_configs import SFTStageConfig
from online_rlhf.trl_args import check_axolotl_keys as _check_axolotl_keys


PLUGIN = "online_rlhf.stages.axolotl_plugin.TrainLogPlugin"
AXOLOTL_TRAIN = "online_rlhf.stages.axolotl_train"  # axolotl.cli.train, after online_rlhf's logging filter
TRAIN_LOG = "sft_train_log.json"  # written by the plugin into Axolotl's output_dir
# Axolotl keys the stage sets itself.
_STAGE_OWNED = {
    "dataset_prepared_path": "the stage tokenizes into <output_dir>.prepared and removes it after training",
    "hub_model_id": "the stage saves a local checkpoint only",
}


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported only when asked)."""
    import torch

    return torch.cuda.is_available()


def check_axolotl_keys(keys: dict) -> None:
    """Raise ConfigError for keys Axolotl does not know (``online_rlhf.trl_args.check_axolotl_keys``;
    the stage's own keys are allowed)."""
    _check_axolotl_keys(keys, also_known=set(SFTStageConfig.model_fields))


def _abs_path(value: str) -> str:
    """A config file path (e.g. ``deepspeed: configs/deepspeed/zero2.json``) made absolute: from the
    working directory if it exists there, else from the project root."""
    p = Path(value)
    if p.is_absolute() or p.exists():
        return str(p.absolute())
    if (PROJECT_ROOT / p).exists():
        return str(PROJECT_ROOT / p)
    raise ConfigError(f"{value}: no such file (looked in {Path.cwd()} and {PROJECT_ROOT}).")


def _training_template(ax: dict, entry: dict, tokenizer) -> str | None:
    """The chat template Axolotl will train with (its own choice from ``chat_template`` /
    ``chat_template_jinja`` of the config or the dataset entry); None when it cannot be found."""
    try:
        from axolotl.utils.chat_templates import get_chat_template_from_config
    except ImportError:
        return tokenizer.chat_template if ax.get("chat_template", "tokenizer_default") == "tokenizer_default" else None
    try:
        return get_chat_template_from_config(ax, ds_cfg=entry, tokenizer=tokenizer)
    except ValueError:
        return None


def turn_end_tokens(ax: dict, entry: dict, tokenizer, eos: str) -> list[str] | None:
    """Axolotl's ``eot_tokens`` for this run: the chat template's turn terminator when it is not the
    eos (after axolotl issue #3754).

    Axolotl 0.19 trains the end of an assistant turn only for the tokens in ``eot_tokens``, which
    default to the tokenizer's eos. Where the eos is not what the template ends a turn with (Qwen
    base: eos ``<|endoftext|>``, ChatML ``<|im_end|>``; Llama-3 base and ``<|eot_id|>``; Gemma and
    ``<end_of_turn>``) every terminator gets label -100 and the model never learns to end a turn.
    The terminator is read from the template Axolotl trains with
    (``online_rlhf.chat_tokens.turn_terminator``).

    A user's own ``eot_tokens`` are checked, not trusted (axolotl PR #2364): Axolotl only warns
    about a token the template does not contain ("not found in chat_template"), trains, and no
    assistant turn end gets a label.

    Returns:
        ``[terminator]`` to set; None to leave Axolotl's default (the config sets valid
        ``eot_tokens`` itself, or the terminator is the eos).
    Raises:
        ConfigError: the template writes no special token after an assistant message and no eos
            either (no turn end to train), or the config's ``eot_tokens`` name a token the template
            does not contain or leave out the token it ends an assistant turn with; each names the
            token(s) and the template's terminator.
    """
    template = _training_template(ax, entry, tokenizer)
    if ax.get("eot_tokens") is not None:
        if template is not None:
            check_eot_tokens(ax["eot_tokens"], template, turn_terminator(tokenizer, chat_template=template))
        return None
    if template is None:
        return None
    terminator = turn_terminator(tokenizer, chat_template=template)
    if terminator is not None:
        return None if terminator == eos else [terminator]
    if eos in template or "eos_token" in template:
        return None  # the template writes the eos somewhere: Axolotl's default trains it
    raise ConfigError(f"the chat template SFT trains with writes no special token after an assistant message, and "
                      f"not the eos {eos!r} either: the model would never learn to end a turn. Set eot_tokens: "
                      "[<the template's turn-ending token>] in the SFT config, or use a chat template that ends each "
                      "turn with a special token (chat_template / chat_template_jinja).")


def check_eot_tokens(eot_tokens, template: str, terminator: str | None) -> None:
    """A config's own ``eot_tokens`` against the chat template SFT trains with.

    Raises:
        ConfigError: not a list of strings; a token the template does not contain (Axolotl would
            only warn, and train no turn end); or, where the template's turn terminator is known
            (``online_rlhf.chat_tokens.turn_terminator``), a list without it. Each names the
            token(s), the template's terminator and the fix.
    """
    ends = f"the template ends an assistant turn with {terminator!r}" if terminator else \
        "the template writes no special token right after an assistant message"
    fix = (f"Set eot_tokens: [{terminator!r}] (or remove eot_tokens: the stage then sets it)" if terminator
           else "Remove eot_tokens, or name a token the template writes")
    if not isinstance(eot_tokens, list) or not all(isinstance(t, str) and t for t in eot_tokens):
        raise ConfigError(f"eot_tokens={eot_tokens!r}: expected a list of token strings; {ends}. {fix}.")
    missing = [t for t in eot_tokens if t not in template]
    if missing:
        raise ConfigError(f"eot_tokens: {', '.join(map(repr, missing))} not in the chat template SFT trains with; "
                          f"{ends}. Axolotl would train no assistant turn end. {fix}.")
    if terminator and terminator not in eot_tokens:
        raise ConfigError(f"eot_tokens={eot_tokens!r} leaves out {terminator!r}: {ends}, and only the tokens of "
                          f"eot_tokens get a label there, so no assistant turn end would be trained. {fix}.")


def axolotl_config(cfg: SFTStageConfig, base: str, eos: str, tmp: Path, prepared: Path, tokenizer=None) -> dict:
    """The Axolotl config to run: the file's Axolotl keys plus the keys the stage sets.

    With ``tokenizer`` (the base model's), ``eot_tokens`` is set to the chat template's turn
    terminator when that is not the eos (:func:`turn_end_tokens`).

    Raises:
        ConfigError: a key the stage owns, a LoRA adapter, ``rl``, a dataset entry it cannot use,
            or a template with no turn end (:func:`turn_end_tokens`).
    """
    ax = dict(cfg.model_extra or {})
    for key, why in _STAGE_OWNED.items():
        if key in ax:
            raise ConfigError(f"{key}: set by the stage ({why}); remove it from the config.")
    if ax.get("adapter"):
        raise ConfigError(f"adapter={ax['adapter']!r}: the SFT stage trains every weight and hands the loop a full "
                          "checkpoint (the loop's LoRA adapters start on it). Remove `adapter` (or merge the adapter "
                          "yourself with `axolotl merge-lora`); for LoRA in the updates set the loop key lora "
                          "(docs/dpo.md).")
    if ax.get("rl"):
        raise ConfigError(f"rl={ax['rl']!r}: this is the SFT stage; preference training is dpo_iteration/.")
    entry = dataset_entry(ax.pop("datasets", None), cfg.dataset)
    special = dict(ax.get("special_tokens") or {})
    special.setdefault("eos_token", eos)
    special.setdefault("pad_token", special["eos_token"])
    if ax.get("deepspeed"):
        ax["deepspeed"] = _abs_path(ax["deepspeed"])
    if ax.get("bf16", "auto") == "auto" and not cuda_available():
        # Axolotl's own "auto" looks at GPUs only; on CPU bf16 autocast pays only with native bf16.
        ax["bf16"] = compute_dtype("cpu") == "bfloat16"
    ax.setdefault("chat_template", "tokenizer_default")
    ax.setdefault("val_set_size", 0)
    ax.setdefault("save_strategy", "no")  # intermediate checkpoints would be deleted anyway
    if tokenizer is not None:
        eot = turn_end_tokens(ax, entry, tokenizer, special["eos_token"])
        if eot is not None:
            ax["eot_tokens"] = eot
    return {"base_model": base, **ax, "datasets": [entry], "special_tokens": special,
            "plugins": [*(ax.get("plugins") or []), PLUGIN],
            "output_dir": str(tmp), "dataset_prepared_path": str(prepared)}
