"""Online iterative RLHF, one readable script per stage (README.md)."""

import logging as _logging

# bitsandbytes (installed for Axolotl's CPU runtime, see requirements-train.txt) logs a WARNING when
# imported on a CPU with AVX512-BF16 and without the optional `kernels` package, which every import
# of peft/trl (DPO, GRPO, KL stages, the loop's DPOConfig check) triggers: "Failed to load CPU
# gemm_4bit_forward from kernels-community: No module named 'kernels' ...". It concerns 4-bit
# quantized matmuls only, which this project never uses, and bitsandbytes has no setting to turn
# it off. So that one message of that one logger is dropped here, on import of this package, which
# every stage process does before it imports bitsandbytes (the SFT stage's Axolotl process by way of
# online_rlhf.stages.axolotl_train); every other message of bitsandbytes still shows.
_BNB_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropBnbKernelsNotice(_logging.Filter):
    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_BNB_KERNELS_NOTICE)


def drop_bitsandbytes_kernels_notice() -> None:
    """Install the filter above on bitsandbytes' CPU-ops logger (once; importing this package does it)."""
    logger = _logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropBnbKernelsNotice) for f in logger.filters):
        logger.addFilter(_DropBnbKernelsNotice())


drop_bitsandbytes_kernels_notice()
