#!/usr/bin/env bash
# Online iterative RLHF (README.md); the stages come from the stage table (online_rlhf/stage_table.py):
#   [sft once] -> for i in 1..N: generate (vLLM) -> rewards -> pairs -> DPO -> held-out eval
#   (+ KL from the starting policy; IFEval at the iterations ifeval.when names: 0 and the last in the default)
# The model of iteration i is the policy of iteration i+1.
#
# Usage: bash run_loop.sh [CONFIG] [key=value ...] [--fresh]
#   CONFIG defaults to configs/loop.yaml (the embedded default: SmolLM2-135M on IF prompts, verifier reward).
#   Rerunning the same command resumes at the first stage whose .done marker is missing or stale.
#   --fresh (or fresh=true) empties the run directory first (only one this loop made).
#   dry_run=true plans, then runs SFT (if enabled) and iteration 1's generate / rewards (reward
#   model) / dpo (or grpo) once each at their largest shapes, prints peak memory vs available and what to
#   lower, and exits (1 when a stage would not fit) without training or marking anything done.
#   Every config key, with its default: .venv-train/bin/python -m online_rlhf.loop -h
#   Each stage runs as its resolved config runs/<name>/iter_<i>/configs/<stage>.yaml says (the
#   command is written on top of that file; the stage table is online_rlhf/stage_table.py).
#   Relative paths you pass (CONFIG, train_prompts=, eval_prompts=, ifeval.prompts=, policy=, sft.dataset=,
#   reward.reward_model=, dpo_config=, grpo_config=, sft.config=) are taken from where you run the
#   command when the file is there, else from the project root; output_root= always from where you
#   run it (without output_root=, runs go to this project's runs/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CALLER_PWD="$PWD"
export ONLINE_RLHF_CALLER_PWD="$CALLER_PWD"  # named in "no such file" messages of relative paths
cd "$ROOT"

CONFIG="configs/loop.yaml"
FRESH=0
OVERRIDES=()
for arg in "$@"; do
  case "$arg" in
    --fresh|fresh=true) FRESH=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-; exit 0 ;;
    -*) echo "run_loop.sh: unknown option '$arg' (rerunning the same command resumes; --fresh starts over)" >&2; exit 2 ;;
    *=*)
      key="${arg%%=*}" val="${arg#*=}"
      pkey="$key"  # per_iteration.<i>.<key>: a path in it is taken from here too
      [[ "$key" =~ ^per_iteration\.[0-9]+\.(.+)$ ]] && pkey="${BASH_REMATCH[1]}"
      case "$pkey" in
        train_prompts|eval_prompts|ifeval.prompts|policy|sft.dataset|reward.reward_model|dpo_config|grpo_config|sft.config)
          [[ "$val" != /* && -e "$CALLER_PWD/$val" ]] && arg="$key=$CALLER_PWD/$val" ;;
        output_root) [[ "$val" != /* ]] && arg="$key=$CALLER_PWD/$val" ;;
      esac
      OVERRIDES+=("$arg") ;;
    *)
      [[ -n "${CONFIG_GIVEN:-}" ]] && { echo "run_loop.sh: two config files given ('$CONFIG_GIVEN' and '$arg'); give one, and settings as key=value" >&2; exit 2; }
      CONFIG_GIVEN="$arg"
      CONFIG="$arg"; [[ "$CONFIG" != /* && -f "$CALLER_PWD/$CONFIG" ]] && CONFIG="$CALLER_PWD/$CONFIG" ;;
  esac
done
[[ -f "$CONFIG" ]] || { echo "run_loop.sh: config file '$CONFIG' not found (the first word that is not key=value names the config file; a setting is key=value, e.g. generation.k=3)" >&2; exit 2; }

# Caches inside the project (unless the user set them); wandb offline unless told otherwise.
CACHE="${ONLINE_RLHF_CACHE:-$ROOT/.cache}"
export HF_HOME="${HF_HOME:-$CACHE/hf}" TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$CACHE/torch_extensions}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$CACHE/vllm}" NLTK_DATA="${NLTK_DATA:-$CACHE/nltk_data}"
export WANDB_DIR="${WANDB_DIR:-$CACHE/wandb}" WANDB_MODE="${WANDB_MODE:-offline}" AXOLOTL_DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

T0=$SECONDS
clock() { local s=$((SECONDS - T0)); printf '%02d:%02d' $((s / 60)) $((s % 60)); }
say() { printf '[run_loop %s] %s\n' "$(clock)" "$*"; }

bash scripts/setup_envs.sh all                       # no-op when both envs are up to date
TRAIN="$ROOT/.venv-train/bin/python"
INFER="$ROOT/.venv-infer/bin/python"
"$TRAIN" scripts/prepare_default.py >/dev/null       # embedded model + prompts; cached after the first run

# The config is checked and the run directory found before anything is written to it.
RUN_DIR="$("$TRAIN" -m online_rlhf.loop run-dir "$CONFIG" "${OVERRIDES[@]}")"
# What this command creates (the first missing folder up to the run dir, the lock) goes again
# when the plan refuses the run: a refused plan leaves no trace (the plan itself writes nothing then).
NEW_TOP=""; d="$RUN_DIR"; while [[ ! -e "$d" ]]; do NEW_TOP="$d"; d="$(dirname -- "$d")"; done
NEW_LOCK=0; [[ -e "$RUN_DIR/.lock" ]] || NEW_LOCK=1
undo_new() {
  [[ "$NEW_LOCK" == 1 ]] && rm -f -- "$RUN_DIR/.lock"
  if [[ -n "$NEW_TOP" ]]; then   # only empty folders: rmdir refuses any other
    d="$RUN_DIR"; while rmdir -- "$d" 2>/dev/null && [[ "$d" != "$NEW_TOP" ]]; do d="$(dirname -- "$d")"; done
  fi
  return 0
}
mkdir -p -- "$RUN_DIR"
# One loop per run directory: the lock is inherited by every stage process, so a stage left
# running by a killed loop also keeps a second loop out until it ends (and --fresh waits for it too).
exec 9>"$RUN_DIR/.lock"
lock_holders() {  # pid and command of each process with the lock open, other than this loop and its children
  "$TRAIN" - "$RUN_DIR/.lock" "$$" <<'PY'
import os, sys
lock, me = os.path.realpath(sys.argv[1]), int(sys.argv[2])
def parent(pid):
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0
def ours(pid):
    while pid > 1:
        if pid == me:
            return True
        pid = parent(pid)
    return False
for d in sorted((d for d in os.listdir("/proc") if d.isdigit()), key=int):
    try:
        if not ours(int(d)) and any(os.path.realpath(f"/proc/{d}/fd/{fd}") == lock for fd in os.listdir(f"/proc/{d}/fd")):
            print(f"  {d} {open(f'/proc/{d}/cmdline').read().replace(chr(0), ' ').strip()[:160]}")
    except OSError:
        pass
PY
}
flock -n 9 || {
  echo "run_loop.sh: $RUN_DIR is in use by another run_loop.sh (or a stage it left running); wait for it or stop it." >&2
  holders="$(lock_holders)"
  [[ -n "$holders" ]] && printf 'processes holding it (stop them with kill PID):\n%s\n' "$holders" >&2
  exit 1
}
if [[ "$FRESH" == 1 ]]; then
  # Only a folder this loop made: empty, with the config.yaml that `loop plan` writes, or with
  # nothing but what an earlier refused plan left (iter_*/configs, plan.json, prompts.jsonl, logs).
  "$TRAIN" -m online_rlhf.loop fresh-check "$RUN_DIR" || { rc=$?; undo_new; exit "$rc"; }
  # and the new plan must pass (a bad prompt file, say) before the old run is emptied
  "$TRAIN" -m online_rlhf.loop plan-check --quiet "$CONFIG" "${OVERRIDES[@]}" || { rc=$?; undo_new; exit "$rc"; }
  say "fresh start: removing the contents of $RUN_DIR"
  find "$RUN_DIR" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf -- {} +
fi
PLAN="$("$TRAIN" -m online_rlhf.loop plan "$CONFIG" "${OVERRIDES[@]}")" || { rc=$?; undo_new; exit "$rc"; }
eval "$PLAN"    # RUN_DIR ITERATIONS LAUNCH_PROFILE DRY_RUN
say "run directory: $RUN_DIR ($ITERATIONS iterations, launch profile $LAUNCH_PROFILE)"
if [[ "$DRY_RUN" == 1 ]]; then   # dry_run=true: memory check of each model stage, then stop (docs/dry-run.md)
  say "dry run: SFT (if enabled) and iteration 1's model stages, one step each at their largest shapes"
  rc=0; "$TRAIN" -m online_rlhf.loop dry-run "$RUN_DIR" || rc=$?
  exit "$rc"
fi

CHILD=""
RESUME_HINT="rerun the same command to resume"; [[ "$FRESH" == 1 ]] && RESUME_HINT="rerun it without --fresh to resume"
trap 'say "interrupted; $RESUME_HINT"; [[ -n "$CHILD" ]] && kill -TERM -- -"$CHILD" 2>/dev/null; exit 130' INT TERM

# run_stage ITER STAGE: skip when done and fresh (or not in this run's plan, e.g. sft when it is
# off); else run it as its config file says (`loop exec`), with a log and a live status line.
run_stage() {
  local i="$1" stage="$2" rc=0 env why
  env="$("$TRAIN" -m online_rlhf.loop check "$RUN_DIR" "$i" "$stage")" || rc=$?
  case "$rc" in
    0) say "iteration $i/$ITERATIONS · $stage: done earlier, skipped"; return 0 ;;
    3) return 0 ;;
    1) ;;
    *) exit "$rc" ;;
  esac
  why="${env#*$'\n'}"; env="${env%%$'\n'*}"   # check prints the env, then why the stage runs
  case "$why" in   # a first run says nothing; a co-decoded first run says only that; a rerun says why
    "not run yet"|"$env") ;;
    "not run yet; "*) say "iteration $i/$ITERATIONS · $stage: ${why#not run yet; }" ;;
    *) say "iteration $i/$ITERATIONS · $stage: runs again: $why" ;;
  esac
  local log="$RUN_DIR/iter_$i/logs/$stage.log" start=$SECONDS
  mkdir -p "$(dirname "$log")"
  say "iteration $i/$ITERATIONS · $stage ($env env) · log $log"
  set -m; "$TRAIN" -m online_rlhf.loop exec "$RUN_DIR" "$i" "$stage" >"$log" 2>&1 & CHILD=$!; set +m
  local ticks=0
  while kill -0 "$CHILD" 2>/dev/null; do   # a status line every 15 s: stage, elapsed, last log line
    sleep 1; ticks=$((ticks + 1))
    if ((ticks % 15 == 0)) && kill -0 "$CHILD" 2>/dev/null; then
      say "  … $stage $((SECONDS - start))s: $(tail -c 400 "$log" | tr '\r' '\n' | tr -cd '\11\12\40-\176' | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-110)"
    fi
  done
  local rc=0; wait "$CHILD" || rc=$?; CHILD=""
  if [[ $rc -ne 0 ]]; then
    say "FAILED: iteration $i · stage $stage (exit $rc). Log: $log"
    tail -n 25 "$log" | sed 's/^/    | /' >&2
    if grep -q '^error: ' "$log"; then   # the stage's own one-line reason, below any launcher traceback
      reason="$(grep '^error: ' "$log" | tail -n 1 | cut -c8-)"
      say "reason: $reason"
      hint="$("$TRAIN" -m online_rlhf.loop output-hint "$RUN_DIR" "$reason" 2>/dev/null)" || true
      [[ -n "$hint" ]] && say "$hint"
    fi
    exit 1
  fi
  "$TRAIN" -m online_rlhf.loop mark "$RUN_DIR" "$i" "$stage" "$((SECONDS - start))"
  say "iteration $i/$ITERATIONS · $stage: finished in $((SECONDS - start))s"
  # the stage's warnings on the console too: its own and those of the libraries it runs (online_rlhf/console.py)
  "$TRAIN" -m online_rlhf.console warnings "$log" 2>/dev/null |
    while IFS= read -r line; do say "  $stage: $line"; done || true
}

# Each iteration's planned stages in the stage table's order (online_rlhf/stage_table.py; iteration 0:
# SFT when enabled, then the starting policy's evaluations), each followed by its row's `after` check
# (pairs: stop before DPO when it made 0 pairs), then the iteration's metrics line.
for ((i = 0; i <= ITERATIONS; i++)); do
  STAGE_LIST="$("$TRAIN" -m online_rlhf.loop stages "$RUN_DIR" "$i")"
  while read -r stage hook <&3; do   # fd 3: a stage reading stdin cannot eat the list
    run_stage "$i" "$stage"
    [[ "$hook" == after ]] || continue
    rc=0; why="$("$TRAIN" -m online_rlhf.loop after "$RUN_DIR" "$i" "$stage")" || rc=$?
    case "$rc" in 0) ;; 1) say "STOPPED: $why"; exit 1 ;; *) exit "$rc" ;; esac
  done 3<<< "$STAGE_LIST"
  "$TRAIN" -m online_rlhf.loop metrics "$RUN_DIR" "$i" | while read -r line; do say "$line"; done
done
REPORT="$("$TRAIN" -m online_rlhf.loop report "$RUN_DIR")"
say "done in $(clock). Report: $REPORT and ${REPORT%.md}.png"
say "$("$TRAIN" -m online_rlhf.loop verdict "$RUN_DIR")"   # the last line: did IFEval rise, and is it significant?
