"""FP8 GEMMs at decode and small-prefill sizes: how much of torch._scaled_mm's time is its
scaling (issue 31, FP8 steps off the skinny GEMM).

The engine's FP8 steps of more rows than the skinny GEMM takes run `torch._scaled_mm` with a
float32 scale per activation row and per weight row ("rowwise", what layers/fp8.py does). This
times, at the Llama-3.1-8B layers' N x K and M = 16 to 512 rows, bfloat16 operands:

- `bf16`: F.linear on the bfloat16 weight (cuBLAS);
- `rowwise`: _scaled_mm on FP8 operands with the row scales, bfloat16 out (the engine's call);
- `tensorwise`: the same GEMM with one scale per tensor (another cuBLASLt kernel);
- `tensorwise+scale`: that, then the row scales applied by two PyTorch multiplies (what a
  rowwise result costs built from it without a fused epilogue).

The activations are FP8 already (their quantization is not timed). Each case is a CUDA graph of
20 calls; time per call = median of 10 replays / 20, in microseconds (weights of 25-235 MB, so
the larger ones read from HBM; the smaller fit the 50 MB L2 across calls: a lower bound).

    PYTHONPATH=src python3 benchmarks/fp8_scaled_mm_scaling.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (16, 32, 64, 128, 256, 512)
CALLS, REPLAYS = 20, 10


def time_us(fn) -> float:
    """Median microseconds per call of `fn`, replayed in a CUDA graph of CALLS calls."""
    for _ in range(5):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[REPLAYS // 2]


def columns(n: int, k: int, m: int) -> tuple[float, float, float, float]:
    """The four columns' microseconds at one N x K and M (the module docstring)."""
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    w, x = (
        torch.randn(n, k, device="cuda", dtype=bf16),
        torch.randn(m, k, device="cuda", dtype=bf16),
    )
    w8, w_scale = w.to(fp8), torch.rand(1, n, device="cuda") + 0.5
    x8, x_scale = x.to(fp8), torch.rand(m, 1, device="cuda") + 0.5
    one = torch.ones((), device="cuda")

    def tensorwise():
        return torch._scaled_mm(x8, w8.t(), one, one, out_dtype=bf16)

    return (
        time_us(lambda: F.linear(x, w)),
        time_us(lambda: torch._scaled_mm(x8, w8.t(), x_scale, w_scale, out_dtype=bf16)),
        time_us(tensorwise),
        time_us(lambda: tensorwise().mul_(x_scale).mul_(w_scale)),
    )


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; microseconds per call\n")
    print("| layer | N x K | M | bf16 | rowwise | tensorwise | tensorwise+scale |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for layer, (n, k) in SHAPES.items():
        for m in ROWS:
            cols = " | ".join(f"{c:.1f}" for c in columns(n, k, m))
            print(f"| {layer} | {n}x{k} | {m} | {cols} |")


if __name__ == "__main__":
    main()
