"""Programmatic dependent launch (PDL) on a chain of small dependent kernels, in a CUDA graph.

Why: at batch 1 a decode step is ~11 Triton kernels per layer (RMSNorm, the skinny GEMMs, RoPE +
KV store, attention and its merge, split-K reduces), most of them a few microseconds long, so
each kernel boundary (the next kernel's launch and ramp-up after the last one drains) is a
visible share of the step (1B: 1.05 ms of kernels against a 0.59 ms floor). With PDL
(`launch_pdl=True`; Hopper) a kernel may start while the one before finishes: it must call
`gdc_wait()` before it reads what that kernel wrote, and may load everything else (a GEMV's
weights) before. This measures what that buys on the GPU before the engine's kernels use it.

The chain mimics one decode layer at batch 1, repeated: an elementwise kernel on a 2,048-wide
vector (as RMSNorm), then a GEMV of a 2,048 x 2,048 bf16 matrix (8 MB, as o_proj of the 1B
model), 32 pairs, all captured in one CUDA graph. Variants: plain launches; PDL with
`gdc_wait()` first in each kernel; PDL where the GEMV loads its first weight tile before
waiting. Each prints microseconds per kernel (median of graph replays timed with CUDA events,
the L2 flushed before each) and whether its output equals the plain chain's (a race would not).

    PYTHONPATH=src python3 benchmarks/pdl_chain.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention import capture, median_ms  # noqa: E402

HIDDEN = 2048
PAIRS = 32
BLOCK_N, BLOCK_K = 16, 256  # GEMV: 128 programs, each 16 rows x 2,048 columns


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()  # x is the previous kernel's output
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + offs, (x * 0.5 + 0.25).to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, PDL: tl.constexpr, EARLY: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    if PDL and not EARLY:
        gdc_wait()  # x is the previous kernel's output
    w_first = tl.load(w_ptr + rows[:, None] * K + cols[None, :])  # weights: no dependency
    if PDL and EARLY:
        gdc_wait()
    x = tl.load(x_ptr + cols).to(tl.float32)
    acc = tl.sum(w_first.to(tl.float32) * x[None, :], 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptr + rows[:, None] * K + (k0 + cols)[None, :]).to(tl.float32)
        x = tl.load(x_ptr + k0 + cols).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    if PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + rows, (acc * 0.01).to(y_ptr.dtype.element_ty), mask=rows < N)


def chain(weights, x, h, pdl: bool, early: bool) -> None:
    """`PAIRS` times: h = scale(x); x = W_i h. With `early` the GEMV loads its first weight
    tile before gdc_wait, else after (without PDL there is no wait at all)."""
    for w in weights:
        _scale_kernel[(1,)](x, h, HIDDEN, PDL=pdl, BLOCK=HIDDEN, launch_pdl=pdl)
        _gemv_kernel[(HIDDEN // BLOCK_N,)](
            w, h, x, HIDDEN, HIDDEN, PDL=pdl, EARLY=early, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=4, launch_pdl=pdl,
        )  # fmt: skip


def time_graph(fn) -> float:
    """Median ms of one replay of fn's graph (paged_attention.py's timing: CUDA events, the L2
    flushed before each replay)."""
    graph = capture(fn)
    return median_ms(graph.replay)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        torch.randn(HIDDEN, HIDDEN, device="cuda", generator=gen).bfloat16() for _ in range(PAIRS)
    ]  # 256 MB: no weight stays in the L2 between replays
    x0 = torch.randn(HIDDEN, device="cuda", generator=gen).bfloat16()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{PAIRS} x (elementwise on {HIDDEN}, GEMV {HIDDEN} x {HIDDEN} bf16), one CUDA graph")
    print("| variant | ms per chain | us per kernel | output equals plain |")
    print("|---|---|---|---|")
    want = None
    for name, pdl, early in (("plain", False, False), ("PDL", True, False),
                             ("PDL, weights before the wait", True, True)):  # fmt: skip
        x, h = x0.clone(), torch.empty_like(x0)
        try:
            ms = time_graph(lambda: chain(weights, x, h, pdl, early))  # noqa: B023
        except Exception as e:  # e.g. PDL not captured by this torch/driver: say so, go on
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
            continue
        x.copy_(x0)
        chain(weights, x, h, pdl, early)
        torch.cuda.synchronize()
        if want is None:
            want = x.clone()
        same = bool(torch.equal(x, want))
        print(f"| {name} | {ms:.4f} | {ms * 1e3 / (2 * PAIRS):.2f} | {same} |")


if __name__ == "__main__":
    main()
