#!/usr/bin/env bash
# The project's test command (README.md; CI runs it through .ci/run). From a clean clone it
# builds both envs, prepares the embedded default (model + prompts, cached), then runs:
#   1. the training-env suite (everything not marked `vllm` or `trl_comparison`), slow end-to-end tests included;
#   2. the inference-env suite (tests marked `vllm`: real vLLM engines on tiny models).
# Extra arguments go to both pytest runs (e.g. -k pairs, -m "not slow", -x).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # before any env build or data preparation
  sed -n '2,6p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh all
.venv-train/bin/python scripts/prepare_default.py
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
rc=0
# The two TRL-comparison benches (marker trl_comparison) take tens of minutes: `-m trl_comparison` runs them.
.venv-train/bin/python -m pytest -m "not vllm and not trl_comparison" tests "$@" || rc=$?
# vLLM tests live in files that import only what the inference env has.
.venv-infer/bin/python -m pytest -m vllm tests/test_generation*.py "$@" || { r=$?; [[ $r -eq 5 ]] || rc=$r; }
exit "$rc"
