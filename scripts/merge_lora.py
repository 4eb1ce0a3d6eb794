"""Merge a LoRA adapter of the loop into a full checkpoint, for export (training env).

    .venv-train/bin/python scripts/merge_lora.py runs/x/iter_2/model runs/x/merged
    .venv-train/bin/python scripts/merge_lora.py ADAPTER_DIR OUT_DIR [--base BASE] [--dtype bfloat16]

A run with the loop's ``lora`` key saves each iteration's policy as an adapter folder
(``adapter_config.json`` naming its base + ``adapter_model.safetensors`` + the tokenizer). This
loads the base (``--base``, default the one the adapter names), applies the adapter with peft,
merges it (``merge_and_unload``) and saves a plain checkpoint (safetensors, config,
generation_config, tokenizer with its chat template) into ``OUT_DIR.tmp``, renamed to ``OUT_DIR``
when complete. The result loads in transformers and vLLM like any checkpoint and gives the
base-plus-adapter outputs (tests/test_lora.py checks the logits). ``--dtype``: the weights'
dtype (default: the base's as stored).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Merge a LoRA adapter folder into a full checkpoint.")
    parser.add_argument("adapter", help="the adapter folder (e.g. runs/x/iter_2/model of a run with lora)")
    parser.add_argument("out_dir", help="where the merged checkpoint is written (must not exist)")
    parser.add_argument("--base", default=None, help="the base model (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="dtype of the merged weights (auto: as the base is stored)")
    args = parser.parse_args(argv)
    from online_rlhf.adapters import ADAPTER_WEIGHTS, adapter_base, is_adapter, merge_adapter
    from online_rlhf.paths import hub_id_shaped

    if not Path(args.adapter).is_dir():
        print(f"error: {args.adapter}: no such folder; give the iter_<i>/model folder of a run with the loop's lora key.",
              file=sys.stderr)
        return 2
    if not is_adapter(args.adapter):
        print(f"error: {args.adapter} holds no adapter_config.json, so it is not a LoRA adapter folder; give the "
              "iter_<i>/model folder of a run with the loop's lora key (a full checkpoint needs no merge).",
              file=sys.stderr)
        return 2
    if not (Path(args.adapter) / ADAPTER_WEIGHTS).is_file():
        print(f"error: {args.adapter} has adapter_config.json but no {ADAPTER_WEIGHTS} (a save that was cut short?); "
              "rerun the stage that wrote it (run_loop.sh resumes it).", file=sys.stderr)
        return 2
    try:
        base = args.base or adapter_base(args.adapter)
    except (OSError, ValueError) as e:  # a damaged adapter_config.json, missing weights
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not Path(base).exists() and not hub_id_shaped(base):
        print(f"error: the base model {base} does not exist here (a run directory copied from another machine "
              "names that machine's path); give the base with --base.", file=sys.stderr)
        return 2
    try:
        out = merge_adapter(args.adapter, Path(args.out_dir), base=base, dtype=args.dtype)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ValueError) as e:  # a base that cannot be loaded (offline Hub id, no weights)
        print(f"error: cannot merge {args.adapter} into {base}: {type(e).__name__}: {str(e)[:400]}. Give a local "
              "base checkpoint (config.json + safetensors weights) with --base.", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {base} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
