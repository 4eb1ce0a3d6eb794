#!/usr/bin/env bash
# Machine k's part of a multi-machine run without SLURM (docs/multi-node.md).
#
#   bash scripts/other_machine.sh RUN_DIR MACHINE_RANK
#
# Start it on machine k (1 .. num_machines-1) once machine 0's `bash run_loop.sh ...` has printed its
# run directory. It goes through each iteration's planned stages in the stage table's order (as run_loop.sh) with
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

for ((i = 0; i <= ITERATIONS; i++)); do   # each iteration's planned stages, in the stage table's order
  while read -r s _ <&3; do stage "$i" "$s"; done 3<<< "$("$TRAIN" -m online_rlhf.loop stages "$RUN_DIR" "$i")"
done
echo "[machine $RANK] all stages done"
