#!/usr/bin/env bash
# Machine k's part of a multi-machine run without SLURM (README: "Multi-node and SLURM").
#
#   bash scripts/other_machine.sh RUN_DIR MACHINE_RANK
#
# Start it on machine k (1 .. num_machines-1) once machine 0's `bash run_loop.sh ...` has printed its
# run directory. It goes through the stages in run_loop.sh's order with
# `python -m online_rlhf.loop exec RUN_DIR ITER STAGE machine_rank=k`, which skips the stages that
# run on machine 0 only and those already done, and waits for machine 0 to finish the stage before
# each distributed one (DPO, a reward model, generation shards), so both machines meet there.
# Rerun it after a failure, like run_loop.sh on machine 0. It stops (exit 2) when machine 0 has
# written nothing in the run directory for ONLINE_RLHF_WAIT_TIMEOUT_S seconds (default 3600; 0: never).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -eq 2 ]] || { echo "usage: bash scripts/other_machine.sh RUN_DIR MACHINE_RANK" >&2; exit 2; }
RUN_DIR="$(cd "$1" && pwd)" RANK="$2"
cd "$ROOT"
TRAIN="$ROOT/.venv-train/bin/python"
ITERATIONS="$("$TRAIN" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["iterations"])' "$RUN_DIR/config.yaml")"
stage() { echo "[machine $RANK] iteration $1 · $2"; "$TRAIN" -m online_rlhf.loop exec "$RUN_DIR" "$1" "$2" machine_rank="$RANK"; }

stage 0 eval_generate
stage 0 eval_rewards
for ((i = 1; i <= ITERATIONS; i++)); do
  stage "$i" generate
  stage "$i" rewards
  stage "$i" pairs
  stage "$i" dpo
  stage "$i" eval_generate
  stage "$i" eval_rewards
done
echo "[machine $RANK] all stages done"
