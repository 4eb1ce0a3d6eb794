"""Shared pytest set-up.

Machines of this project's kind differ in their CPU: some have native bf16 (AVX512-BF16 / AMX),
where ``dtype: auto`` picks bf16 (generation, reward scoring) or bf16 autocast (DPO, SFT), and
some do not, where it picks float32. Tests that compare numbers were written for float32, so
the whole session runs as on a CPU without native bf16: ``ONLINE_RLHF_CPU_BF16=0``, which
``online_rlhf.hardware.cpu_has_native_bf16`` reads, set here before any fixture (module-scoped
servers included) starts a subprocess, which inherits it. Tests of the bf16 paths set
``ONLINE_RLHF_CPU_BF16=1`` with ``monkeypatch`` (e.g. test_sft) or mock torch's checks
(test_hardware).

Tests marked ``gpu`` need a CUDA device: where torch sees none they are skipped, so pytest counts
them in its "skipped" total (``-rs`` lists them with the reason).
"""

import os

os.environ["ONLINE_RLHF_CPU_BF16"] = "0"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA GPU, torch sees none here")
    for item in gpu_items:
        item.add_marker(skip)
