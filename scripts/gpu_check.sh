#!/usr/bin/env bash
# The GPU check: builds or reuses the CUDA envs, prepares the embedded default model, then runs
# every GPU component on a tiny model and on the default model (online_rlhf/gpu_check.py; what each
# one checks and the exact versions: docs/gpu.md). Prints a table and exits non-zero on any failure.
# Usage: bash scripts/gpu_check.sh [--models tiny,default] [--only COMPONENT,...] [--gpus N]
#                                  [--work-dir DIR] [--plan-only] [--min-rm-speedup 4]
# (`.venv-train/bin/python -m online_rlhf.gpu_check -h` lists every option.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh all
.venv-train/bin/python scripts/prepare_default.py
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec .venv-train/bin/python -m online_rlhf.gpu_check "$@"
