"""The per-token FP8 activation quantization kernels at decode and mixed-step sizes: which
config a row should take (issue 31, FP8 steps off the skinny GEMM).

At 64 rows on the 8B shape `_quantize_rows_kernel` took 0.61 ms of a 5.6 ms FP8 step (o_proj's
input, 4,096 columns, and the SiLU-and-mul before down_proj, 2 x 14,336 columns read twice; one
program per row: benchmarks/results/skinny_rows_2026-12-02_h200.md). One program per row reads
its row in BLOCK-column steps, twice; with few rows the programs are few and their loops long,
so the time is the loop's latency, not the bytes. This times `kernels/fp8_quant.py`'s kernel
at each (BLOCK, num_warps) of CONFIGS against the engine's (BLOCK 1024, 4 warps) for both
kinds of row, bfloat16 input, at M = 16 to 512 rows: microseconds per call (fp8_scaled_mm_scaling's
`time_us`: a CUDA graph of 20 calls, median of 10 replays), and the bytes moved over that time.

    PYTHONPATH=src python3 benchmarks/fp8_quantize.py
"""

from __future__ import annotations

import functools

import torch
from fp8_scaled_mm_scaling import time_us  # (benchmarks/ is the script's folder)

from llm_inference.kernels import fp8_quant
from llm_inference.kernels.reference import FP8

ROWS = (16, 64, 128, 256, 512)
KINDS = {"o_proj input": (4096, False), "SiLU-and-mul (down_proj input)": (14336, True)}
CONFIGS = ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))  # (BLOCK, num_warps)


def launch(x: torch.Tensor, cols: int, silu: bool, block: int, warps: int):
    """The kernel as `fp8_quant._launch` runs it, with another BLOCK and num_warps."""
    rows = x.shape[0]
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    fp8_quant._quantize_rows_kernel[(rows,)](
        x, q, scale, scale, x.stride(0), q.stride(0), cols,
        STATIC=False, SILU=silu, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return q, scale


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; microseconds per call (GB/s)\n")
    header = " | ".join(f"BLOCK {b}, {w} warps" for b, w in CONFIGS)
    print(f"| row | M | {header} |")
    print("|---|---:|" + "---:|" * len(CONFIGS))
    for kind, (cols, silu) in KINDS.items():
        for m in ROWS:
            x = torch.randn(m, 2 * cols if silu else cols, device="cuda", dtype=torch.bfloat16)
            want = launch(x, cols, silu, *CONFIGS[0])
            moved = x.numel() * 2 * 2 + m * cols  # read twice, write once
            cells = []
            for block, warps in CONFIGS:
                got = launch(x, cols, silu, block, warps)
                same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                assert same and torch.equal(got[1], want[1]), (kind, m, block, warps)
                us = time_us(functools.partial(launch, x, cols, silu, block, warps))
                cells.append(f"{us:.1f} ({moved / us / 1e3:.0f})")
            print(f"| {kind} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
