"""Benchmark: this machine's matrix-product limit, the yardstick of every stage's efficiency.

    .venv-train/bin/python -m bench.bench_matmul [--size 1024] [--seconds 3]

Times ``size x size`` fp32 matmuls on 1 thread and on every usable core, and bf16 the same way
(bf16 is emulated, and slow, on CPUs without AVX512-BF16/AMX). Prints GFLOP/s per setting with
the CPU model, torch capability and whether bf16 is native, then the ratios fp32 2-core/1-core
and bf16/fp32. A stage's share of the limit is its useful FLOPs over (seconds x this limit):
~2 x params x tokens for generation and scoring, ~6 x params x tokens for a training step.
"""

from __future__ import annotations

import argparse
import time

import torch

from online_rlhf.hardware import cpu_capability, cpu_has_native_bf16, cpu_model, usable_cores


def gflops(size: int, dtype: torch.dtype, threads: int, seconds: float) -> float:
    """Sustained GFLOP/s of ``size x size @ size x size`` in ``dtype`` on ``threads`` threads."""
    torch.set_num_threads(threads)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm-up (kernel selection, thread pool start)
    n, t0 = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 2:
            break
    return 2 * size ** 3 * n / elapsed / 1e9


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=3.0, help="time per setting")
    args = ap.parse_args()
    cores = usable_cores()
    native = cpu_has_native_bf16()
    print(f"CPU: {cpu_model()}; torch capability {cpu_capability()}; native bf16: {native}; usable cores: {cores}")
    res = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for threads in sorted({1, cores}):
            # emulated bf16 is ~100x slower: a smaller matrix keeps the run short, GFLOP/s is comparable
            size = args.size if (dtype == torch.float32 or native) else min(args.size, 256)
            g = gflops(size, dtype, threads, args.seconds)
            res[(name, threads)] = g
            print(f"  {name:9s} x{threads} threads ({size}^2): {g:8.1f} GFLOP/s", flush=True)
    f1, fn = res[("float32", 1)], res[("float32", cores)]
    print(f"fp32 limit on {cores} cores: {fn:.1f} GFLOP/s ({fn / f1:.2f}x one thread); "
          f"bf16 / fp32 on {cores} cores: {res[('bfloat16', cores)] / fn:.3f}x")
    if cores > 1 and fn < 1.2 * f1:
        print(f"warning: {cores} threads were not faster than 1: another job probably holds a core, so this is "
              "not the machine's limit; measure again when it is idle.")
    return {f"{k[0]}_x{k[1]}": round(v, 1) for k, v in res.items()}


if __name__ == "__main__":
    main()
