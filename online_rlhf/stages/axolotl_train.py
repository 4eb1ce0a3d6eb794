"""``python -m axolotl.cli.train YAML``, with ``online_rlhf`` imported first.

The SFT stage (``online_rlhf.stages.run_sft``) runs Axolotl through this module instead of
``-m axolotl.cli.train`` so that the logging filter of ``online_rlhf/__init__.py`` (it drops
bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" notice, and nothing
else) is in place before Axolotl imports bitsandbytes; Axolotl loads this project's plugin only
later. Arguments are Axolotl's, unchanged.
"""

import runpy

from online_rlhf import drop_bitsandbytes_kernels_notice

if __name__ == "__main__":
    drop_bitsandbytes_kernels_notice()  # done on import of online_rlhf already; said here for the reader
    runpy.run_module("axolotl.cli.train", run_name="__main__", alter_sys=True)
