"""SFT stage: supervised fine-tuning with Axolotl, run once before the loop; saves an HF checkpoint.

    .venv-train/bin/python sft/run_sft.py --config configs/sft.yaml \
        base_model=default dataset=runs/x/sft/data.jsonl output_dir=runs/x/sft/model

The config file is an Axolotl config plus a few keys this stage owns (``SFTStageConfig`` in
online_rlhf/stage_configs.py): ``base_model`` ('default' allowed), ``dataset`` (one local JSONL in
the conversational ``messages`` format), ``output_dir``, ``axolotl_config_output``,
``launcher`` and ``num_processes``. Any key can be overridden as ``key=value`` (YAML values, dotted
keys for nesting: ``learning_rate=1e-5 max_steps=20``).

Order of work (:func:`main` runs one function a step: :func:`construct` 1-2, :func:`setup` 3,
:func:`train` 4, :func:`save` 5, :func:`write_stats` 6; :func:`dry_run` is 1-3 and one step):
  1. config: the stage's keys are typed; the Axolotl keys are checked against Axolotl's own schema
     (Axolotl itself silently ignores an unknown key); LoRA adapters are refused (the loop needs a
     full checkpoint);
  2. data: every row of ``dataset`` is checked (a ``messages`` list, roles system/user/assistant,
     at least one assistant turn, no empty assistant turn); the first bad row stops the stage
     with its file and line, before Axolotl or any model is loaded;
  3. the resolved Axolotl config (``datasets[0].path`` = the dataset, ``output_dir`` =
     ``<output_dir>.tmp``, eos = pad = the base model's eos unless ``special_tokens`` says
     otherwise, ``eot_tokens`` = the chat template's turn terminator when it is not the eos
     (``online_rlhf.stages.sft_axolotl_config.turn_end_tokens``), our log plugin) is written to ``<output_dir>.axolotl.yaml``;
  4. ``python -m axolotl.cli.train <yaml>`` (or ``accelerate launch -m axolotl.cli.train``) runs
     with ``AXOLOTL_DO_NOT_TRACK=1``, by way of ``online_rlhf.stages.axolotl_train`` (the same
     after this package's logging filter, see ``online_rlhf/__init__.py``); its log is echoed;
  5. the output becomes a clean HF checkpoint: only weights, config, tokenizer files and chat
     template are kept (no optimizer states, checkpoint-*/ folders, logs, model card); eos and pad
     are set in tokenizer, config and generation_config (the base model's generation_config is
     copied: Axolotl saves one with ``do_sample=true``); ``use_cache`` is switched back on; then
     ``<output_dir>.tmp`` is renamed to ``output_dir``;
  6. ``<output_dir>.stats.json`` (``online_rlhf.stats.SFTStats``): rows in, rows used, rows dropped by Axolotl by reason, steps,
     loss first/last, seconds per step, wall seconds, and ``special_token_text``.

Special-token strings in the data are NOT kept as text here. Axolotl 0.19 tokenizes each row with
``apply_chat_template(tokenize=True)``, which turns a ``<|im_end|>`` written inside a message into
the special token: an assistant turn containing it is trained as if the turn ended there, and a
user turn can open a new turn. The other stages tokenize contents as text
(``online_rlhf.chat_tokens``); changing Axolotl's tokenizer path is out of this stage's reach, so
it counts the rows that hold such strings (``special_token_text`` in the stats, per role) and
warns before training. Remove those rows from the data set if that matters.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path


import yaml

# Axolotl's telemetry is on unless this is set; the stage sets it itself (not only run_loop.sh), so a
# by-hand run never tries to reach the telemetry host, whichever module imports Axolotl first.
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")

from online_rlhf.config import ConfigError, run_main  # noqa: E402
from online_rlhf.dry_run import dummy_ids, exit_if_out_of_memory, finish, out_of_memory_errors  # noqa: E402
from online_rlhf.hardware import describe, stage_threads  # noqa: E402
from online_rlhf.jsonl import read_json  # noqa: E402
from online_rlhf.memory import PeakMemory  # noqa: E402
from online_rlhf.paths import PROJECT_ROOT, resolve_model, setup_cache_env  # noqa: E402
from online_rlhf.stage_configs import SFTStageConfig  # noqa: E402
from online_rlhf.stats import DryRunStats, SFTStats, stats_path  # noqa: E402
from online_rlhf.sft_dataset import dataset_entry, special_text_rows, validate_sft_dataset  # noqa: E402
from online_rlhf.stages.sft_axolotl_config import (AXOLOTL_TRAIN, TRAIN_LOG, axolotl_config,  # noqa: E402
                                                    check_axolotl_keys, cuda_available)

# Files of an HF checkpoint; everything else Axolotl leaves in its output_dir is removed.
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                     "vocab.json", "merges.txt", "tokenizer.model", "model.safetensors.index.json")
_WEIGHT_PATTERNS = ("model*.safetensors",)
# Axolotl 0.19's log lines about rows it removed while preparing the data.
_DROP_PATTERNS = {
    "outside_length_range": re.compile(r"Dropped (\d+) sequences outside valid range"),
    "too_short": re.compile(r"Dropped (\d+) short sequences"),
}
_DEDUP = re.compile(r"Deduplication complete for train dataset\. New size: (\d+)")
_DEDUP_START = re.compile(r"Starting deduplication for train dataset\. Original size: (\d+)")


def _precision(ax: dict) -> str:
    """What the stats say of the run's precision, e.g. ``float32 + bf16 autocast``."""
    mixed = "bf16" if ax.get("bf16") is True else "fp16" if ax.get("fp16") is True else \
        "bf16 if the GPU has it" if ax.get("bf16") == "auto" else None
    return "float32" + (f" + {mixed} autocast" if mixed else "")


def launch_command(cfg: SFTStageConfig, yaml_path: Path) -> list[str]:
    """``python -m axolotl.cli.train YAML`` or ``accelerate launch --num_processes N -m axolotl.cli.train YAML``
    (what ``axolotl train`` runs, with this env's interpreter instead of whatever is first on PATH),
    by way of :mod:`online_rlhf.stages.axolotl_train` (the same, with this package's logging filter first)."""
    if cfg.launcher == "python":
        return [sys.executable, "-m", AXOLOTL_TRAIN, str(yaml_path)]
    n = cfg.num_processes
    if n is None:
        import torch

        n = max(torch.cuda.device_count(), 1)
    accelerate = Path(sys.executable).parent / "accelerate"
    return [str(accelerate), "launch", "--num_processes", str(n), "-m", AXOLOTL_TRAIN, str(yaml_path)]


def run_axolotl(cmd: list[str]) -> tuple[dict, deque]:
    """Run Axolotl, echoing its output; return (rows Axolotl dropped by reason, last 40 log lines).

    Raises:
        RuntimeError: Axolotl exited with an error (the message holds the exit code; its log is above).
    """
    env = dict(os.environ)
    env["AXOLOTL_DO_NOT_TRACK"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(stage_threads()))  # one process on CPU: every usable core
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    print("+ " + " ".join(cmd), flush=True)
    dropped: dict[str, int] = {}
    dedup_in = None
    tail: deque = deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env, cwd=PROJECT_ROOT)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
            for reason, pat in _DROP_PATTERNS.items():
                if m := pat.search(line):
                    dropped[reason] = dropped.get(reason, 0) + int(m.group(1))
            if m := _DEDUP_START.search(line):
                dedup_in = int(m.group(1))
            elif (m := _DEDUP.search(line)) and dedup_in is not None:
                dropped["duplicate"] = dropped.get("duplicate", 0) + dedup_in - int(m.group(1))
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    sys.stdout.flush()
    if rc != 0:
        raise RuntimeError(f"Axolotl failed (exit {rc}); its log is above. Command: {' '.join(cmd)}")
    return dropped, tail


def finalize_checkpoint(ckpt: Path, base: str, eos: str, eot_tokens: list[str] | None = None) -> dict:
    """Turn Axolotl's output_dir into a clean HF checkpoint, in place.

    Keeps weights, config, tokenizer files and chat template; removes the rest. Sets eos = pad =
    ``eos`` in tokenizer, config and generation_config; copies the base model's generation_config
    (falls back to one built from the config); ``eot_tokens`` (the turn terminator SFT trained) are
    added to generation_config's eos ids, so that generation stops where a turn ends; keeps the
    trained chat template, or copies the base tokenizer's when Axolotl saved none; turns
    ``use_cache`` back on.

    Returns a summary: removed entries, where the chat template came from, eos/pad ids.
    Raises:
        RuntimeError: no safetensors weights in ``ckpt`` (nothing a loader could use).
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    removed = []
    for p in sorted(ckpt.iterdir()):
        keep = p.is_file() and (p.name in _CHECKPOINT_FILES or any(fnmatch.fnmatch(p.name, w) for w in _WEIGHT_PATTERNS))
        if not keep:
            removed.append(p.name + ("/" if p.is_dir() else ""))
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if not any(fnmatch.fnmatch(p.name, w) for p in ckpt.iterdir() for w in _WEIGHT_PATTERNS):
        raise RuntimeError(f"{ckpt}: Axolotl saved no model*.safetensors weights.")

    tok = AutoTokenizer.from_pretrained(ckpt)
    template_from = "trained checkpoint"
    if not tok.chat_template:
        tok.chat_template = AutoTokenizer.from_pretrained(base).chat_template
        template_from = "base model"
    if not tok.chat_template:
        raise RuntimeError(f"neither {ckpt} nor the base model {base} has a chat template; set Axolotl's chat_template.")
    tok.eos_token = eos
    tok.pad_token = eos
    eos_id = tok.convert_tokens_to_ids(eos)
    tok.save_pretrained(ckpt)

    config = AutoConfig.from_pretrained(ckpt)
    config.eos_token_id = eos_id
    config.pad_token_id = eos_id
    config.use_cache = True  # Axolotl turns it off for training (gradient checkpointing)
    config.save_pretrained(ckpt)

    try:
        gen = GenerationConfig.from_pretrained(base)
        gen_from = "base model"
    except OSError:
        gen = GenerationConfig.from_model_config(config)
        gen_from = "model config"
    ids = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    ids += [tok.convert_tokens_to_ids(t) for t in eot_tokens or ()]
    gen.eos_token_id = [eos_id, *dict.fromkeys(i for i in ids if i is not None and i != eos_id)]
    gen.pad_token_id = eos_id
    gen.save_pretrained(ckpt)
    return {"removed_from_checkpoint": removed, "chat_template_from": template_from,
            "generation_config_from": gen_from, "eos_token": eos, "eos_token_id": eos_id, "pad_token_id": eos_id}


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and deleted after."""
    old = dst.with_name(dst.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def loss_summary(train_log: dict) -> dict:
    """steps, first/last logged training loss and seconds per step from the plugin's log."""
    history = train_log.get("log_history", [])
    losses = [float(h["loss"]) for h in history if "loss" in h]
    steps = int(train_log.get("global_step") or 0)
    runtime = next((float(h["train_runtime"]) for h in reversed(history) if "train_runtime" in h), None)
    return {"steps": steps, "train_loss_first": losses[0] if losses else None,
            "train_loss_last": losses[-1] if losses else None, "train_losses": losses,
            "train_runtime_s": runtime, "seconds_per_step": round(runtime / steps, 3) if runtime and steps else None}


@dataclass
class SFTRun:
    """The stage as :func:`construct` checked it: its paths, the base model, the stage's Axolotl keys
    (``extra``), the data set's entry and its row count; ``t0`` is ``time.monotonic()`` at the start."""

    cfg: SFTStageConfig
    t0: float
    out: Path
    tmp: Path
    prepared: Path
    stats_file: Path
    yaml_path: Path
    base: str
    extra: dict
    entry: dict
    rows_in: int


def construct(cfg: SFTStageConfig) -> SFTRun:
    """Steps 1-2 of the module docstring, before anything heavy: the paths, the Axolotl keys against
    Axolotl's schema, every row of the data set.

    Raises:
        ConfigError: a bad stage or Axolotl key, a LoRA adapter.  DataError: a bad dataset row.
    """
    t0 = time.monotonic()
    setup_cache_env()
    out = Path(cfg.output_dir).absolute()
    yaml_path = Path(cfg.axolotl_config_output or f"{out}.axolotl.yaml")
    base = resolve_model(cfg.base_model)
    extra = dict(cfg.model_extra or {})
    entry = dataset_entry(extra.get("datasets"), cfg.dataset)
    check_axolotl_keys(extra)
    rows_in = validate_sft_dataset(cfg.dataset, entry["field_messages"])
    return SFTRun(cfg=cfg, t0=t0, out=out, tmp=out.with_name(out.name + ".tmp"),
                  prepared=out.with_name(out.name + ".prepared"), stats_file=stats_path(out), yaml_path=yaml_path,
                  base=base, extra=extra, entry=entry, rows_in=rows_in)


def setup(run: SFTRun) -> tuple[dict, str, dict]:
    """The base model's tokenizer, eos and the rows holding special-token strings (warned about),
    then the resolved Axolotl config (step 3).

    Returns:
        ``(Axolotl config, eos, special_text_rows counts)``.
    Raises:
        ConfigError: the base model has no eos token and ``special_tokens.eos_token`` is not set.
    """
    from transformers import AutoTokenizer

    cfg, base = run.cfg, run.base
    base_tok = AutoTokenizer.from_pretrained(base)
    eos = (run.extra.get("special_tokens") or {}).get("eos_token") or base_tok.eos_token
    if not eos:
        raise ConfigError(f"the base model {base} has no eos token; set special_tokens.eos_token.")
    special = special_text_rows(cfg.dataset, base_tok, run.entry["field_messages"])
    print(f"[sft] {run.rows_in} rows in {cfg.dataset}; base {base}; eos = pad = {eos!r}", flush=True)
    if special["rows"]:
        print(f"[sft] warning: {special['rows']} rows hold special-token strings in their messages "
              f"({special['messages']}); Axolotl tokenizes them as special tokens (e.g. an end of turn inside an "
              "assistant turn), not as text. Remove those rows from the data set to avoid that.",
              file=sys.stderr, flush=True)
    ax = axolotl_config(cfg, base, eos, run.tmp, run.prepared, tokenizer=base_tok)
    if ax.get("eot_tokens") and not run.extra.get("eot_tokens"):
        print(f"[sft] the chat template ends a turn with {ax['eot_tokens'][0]!r}, not the eos {eos!r}: eot_tokens = "
              f"{ax['eot_tokens']} (Axolotl then trains the turn terminator; it also stops generation)", flush=True)
    return ax, eos, special


def write_axolotl_config(run: SFTRun, ax: dict) -> None:
    """Write the resolved Axolotl config to ``run.yaml_path`` (atomically)."""
    run.yaml_path.parent.mkdir(parents=True, exist_ok=True)
    write_text = f"# written by sft/run_sft.py; Axolotl trains into {run.tmp}, renamed to {run.out}\n" + \
        yaml.safe_dump(ax, sort_keys=False, allow_unicode=True)
    tmp_yaml = run.yaml_path.with_name(run.yaml_path.name + ".tmp")
    tmp_yaml.write_text(write_text, encoding="utf-8")
    os.replace(tmp_yaml, run.yaml_path)


def train(run: SFTRun) -> tuple[dict, dict]:
    """Step 4: Axolotl trains into ``<output_dir>.tmp`` (stale ``.tmp`` / ``.prepared`` removed first).

    Returns:
        ``(rows Axolotl dropped, by reason; the log plugin's train log)``.
    Raises:
        RuntimeError: Axolotl failed.
    """
    for stale in (run.tmp, run.prepared):
        shutil.rmtree(stale, ignore_errors=True)
    dropped, _ = run_axolotl(launch_command(run.cfg, run.yaml_path))
    train_log = read_json(run.tmp / TRAIN_LOG)
    (run.tmp / TRAIN_LOG).unlink()
    return dropped, train_log


def save(run: SFTRun, ax: dict, eos: str) -> dict:
    """Step 5: a clean HF checkpoint (:func:`finalize_checkpoint`), renamed to ``output_dir``; the
    tokenized data set removed. Returns :func:`finalize_checkpoint`'s summary."""
    summary = finalize_checkpoint(run.tmp, run.base, eos, ax.get("eot_tokens"))
    _replace_dir(run.tmp, run.out)
    shutil.rmtree(run.prepared, ignore_errors=True)
    return summary


def write_stats(run: SFTRun, ax: dict, special: dict, dropped: dict, train_log: dict, summary: dict) -> SFTStats:
    """Step 6: ``<output_dir>.stats.json`` and the summary line."""
    cfg, rows_in = run.cfg, run.rows_in
    rows_used = train_log.get("rows_used")
    if rows_used is not None:
        other = rows_in - rows_used - sum(dropped.values())
        if other:
            dropped["other"] = other  # e.g. rows whose assistant turns Axolotl could not find
    stats = SFTStats(stage="sft", base_model=run.base, dataset=str(cfg.dataset), output_dir=str(run.out),
                     axolotl_config=str(run.yaml_path), rows_in=rows_in, rows_used=rows_used, dropped=dropped,
                     **loss_summary(train_log), wall_seconds=round(time.monotonic() - run.t0, 1),
                     launcher=cfg.launcher, sequence_len=ax.get("sequence_len"), special_token_text=special,
                     eot_tokens=ax.get("eot_tokens"),
                     hardware=describe("cuda" if cuda_available() else "cpu", _precision(ax),
                                       threads=None if cuda_available() else stage_threads()),
                     **summary)
    stats.write(run.stats_file)
    print(f"[sft] saved {run.out}: {stats.steps} steps, loss {stats.train_loss_first} -> {stats.train_loss_last}, "
          f"{rows_used}/{rows_in} rows used, {stats.wall_seconds} s. Stats: {run.stats_file}", flush=True)
    return stats


def main(cfg: SFTStageConfig) -> SFTStats:
    """Run the SFT stage (see the module docstring); returns the stats written to
    ``<output_dir>.stats.json`` (:class:`~online_rlhf.stats.SFTStats`). With ``cfg.dry_run``:
    :func:`dry_run` instead, returning :class:`~online_rlhf.stats.DryRunStats`.

    Raises:
        ConfigError: a bad stage or Axolotl key, a LoRA adapter, a base model without eos.
        DataError: a bad dataset row (names file and line).
        RuntimeError: Axolotl failed, or saved no weights.
    """
    if cfg.dry_run:  # memory check with transformers at Axolotl's shapes; nothing written but the result
        return dry_run(cfg)
    run = construct(cfg)
    ax, eos, special = setup(run)
    write_axolotl_config(run, ax)
    dropped, train_log = train(run)
    summary = save(run, ax, eos)
    return write_stats(run, ax, special, dropped, train_log, summary)


def dry_run(cfg: SFTStageConfig) -> DryRunStats:
    """The SFT stage's dry run (``dry_run=true``): :func:`construct` and :func:`setup` (the config
    and data checks, the resolved Axolotl config), then one step, not through Axolotl: the base
    model loaded with transformers in Axolotl's dtype (bf16 when ``bf16`` is on, fp16 with
    ``fp16``, else fp32) and attention, ``micro_batch_size`` dummy rows of ``sequence_len`` tokens,
    forward + backward + one ``torch.optim.AdamW`` step, in one process (under DeepSpeed ZeRO the
    real per-GPU share of optimizer state is smaller). Writes only
    :class:`~online_rlhf.stats.DryRunStats` beside ``output_dir`` (``online_rlhf.dry_run.finish``).

    Raises:
        ConfigError, DataError: as :func:`main`.
        SystemExit(1): the step ran out of (GPU) memory, after the result was written.
    """
    run = construct(cfg)
    ax, _, _ = setup(run)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.set_num_threads(stage_threads())
    seq, mb = int(ax.get("sequence_len") or 2048), int(ax.get("micro_batch_size") or 1)
    bf16 = ax.get("bf16") is True or (ax.get("bf16") == "auto" and on_gpu and torch.cuda.is_bf16_supported())
    dtype = torch.bfloat16 if bf16 else torch.float16 if ax.get("fp16") is True else torch.float32
    attn = "flash_attention_2" if ax.get("flash_attention") else (ax.get("attn_implementation") or "sdpa")
    checkpointing = bool(ax.get("gradient_checkpointing"))
    device = torch.device("cuda" if on_gpu else "cpu")
    status, error, step_s = "ok", None, None
    with PeakMemory(device.type) as mem:
        try:
            tok = AutoTokenizer.from_pretrained(run.base)
            model = AutoModelForCausalLM.from_pretrained(run.base, dtype=dtype, attn_implementation=attn).to(device)
            if checkpointing:
                model.gradient_checkpointing_enable()
            model.config.use_cache = False
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=float(ax.get("learning_rate") or 1e-5))
            ids = torch.tensor(dummy_ids(tok, mb, seq, seed=2), device=device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on_gpu:
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
        except out_of_memory_errors() as e:
            status, error = "out_of_memory", str(e)[:1000]
    settings = {k: ax.get(k) for k in ("micro_batch_size", "sequence_len", "gradient_accumulation_steps",
                                       "gradient_checkpointing", "sample_packing", "bf16", "fp16", "optimizer",
                                       "deepspeed")}
    settings.update(micro_batch_size=mb, sequence_len=seq)
    step = (f"1 step: {mb} rows x {seq} tokens, forward + backward + AdamW step, {str(dtype).replace('torch.', '')} "
            f"weights, {attn}, one process (transformers, not Axolotl)")
    result = finish("sft", mem, cfg.output_dir, status=status, error=error, step_s=step_s, step=step,
                    shapes={"rows": mb, "sequence_tokens": seq}, settings=settings, t_start=run.t0, gather=False)
    exit_if_out_of_memory("sft", status, error)
    return result


def cli() -> None:
    """Command-line entry point (the script in the design card's folder calls this)."""
    try:
        run_main(main, SFTStageConfig)
    except RuntimeError as e:  # Axolotl failed: its log is above; one line here, no traceback
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    cli()
