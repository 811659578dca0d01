"""Prompt-sized matmuls on the GPU: does cuBLAS leave time on the table at mixed-step sizes?

Issue 28 lists "the GEMMs at M between 256 and 8,192 tokens with the 8B's N and K (cuBLAS
heuristics, split-K, tile choice)" among the suspects for the 8B chat-like mix, whose steps
hold a few hundred tokens (256 decodes beside a prompt chunk). For one decoder layer's linear
shapes (qkv, o, gate_up, down; bfloat16, nn.Linear's layout) at M tokens, this times:

- `cublas`: F.linear, what the engine runs above the skinny GEMM's 32 rows;
- `cublas_pad`: F.linear on M rounded up to a multiple of 128 (cuBLAS may pick a better kernel
  for an aligned M; the padding rows are wasted work);
- `triton`: a plain tiled Triton GEMM (`gemm` below: grouped tile order, fp32 accumulation)
  at each config of CONFIGS, the best one reported with its config.

Floor: the larger of the FLOPs over 793 TFLOP/s and the weight bytes over 4.24 TB/s (the
H200's measured matmul rate and copy bandwidth). Times: medians between CUDA events, L2
flushed before each call (benchmarks/paged_attention.py). `err`: the Triton result's max
|difference| from cuBLAS over max |cuBLAS| (bf16 rounding, ~4e-3).

    PYTHONPATH=src python3 benchmarks/mixed_gemm.py [--models Llama-3.1-8B] [--ms 256,512]
        [--json PATH]

`--check` (CPU, with TRITON_INTERPRET=1) runs the Triton GEMM on small float32 shapes against
torch and prints `RESULT <case> ok|FAIL` (tests/kernels/test_mixed_gemm_benchmark.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import triton
import triton.language as tl

MODELS = {  # hidden, q heads, KV heads, head_dim, MLP width
    "Llama-3.2-1B": (2048, 32, 8, 64, 8192),
    "Llama-3.2-3B": (3072, 24, 8, 128, 8192),
    "Llama-3.1-8B": (4096, 32, 8, 128, 14336),
}
MS = [128, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048, 4096, 8192]
CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
]  # fmt: skip
PEAK_FLOPS, COPY_BYTES_PER_S = 793e12, 4.24e12


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):  # fmt: skip
    """out[M, N] = x[M, K] @ w[N, K]^T; K a multiple of BLOCK_K. Tiles in groups of GROUP_M
    row blocks per column block, so a group's programs share W's tiles in L2."""
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[None, :] * stride_w + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=rows[:, None] < M, other=0.0)
        acc = tl.dot(x, tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols < N))


def gemm(x: torch.Tensor, w: torch.Tensor, config: tuple) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T with one of CONFIGS; both contiguous, K a multiple of BLOCK_K."""
    block_m, block_n, block_k, warps, stages = config
    (m, k), n = x.shape, w.shape[0]
    assert k % block_k == 0 and x.is_contiguous() and w.is_contiguous(), (x.shape, w.shape)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                       num_warps=warps, num_stages=stages)  # fmt: skip
    return out


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} of one decoder layer."""
    hidden, heads, kv_heads, head_dim, inter = MODELS[model]
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (heads * head_dim, hidden),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}  # fmt: skip


def floor_ms(m: int, n: int, k: int) -> float:
    return max(2 * m * n * k / PEAK_FLOPS, 2 * n * k / COPY_BYTES_PER_S) * 1e3


def measure(m: int, n: int, k: int) -> dict:
    import paged_attention as timing  # benchmarks/paged_attention.py: median_ms, L2 flush
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(-(-m // 128) * 128, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x[:m], w)
    row = {"m": m, "n": n, "k": k, "floor_ms": floor_ms(m, n, k),
           "cublas_ms": timing.median_ms(lambda: F.linear(x[:m], w)),
           "cublas_pad_ms": timing.median_ms(lambda: F.linear(x, w))}  # fmt: skip
    best = None
    for config in CONFIGS:
        try:
            got = gemm(x[:m], w, config)
            ms = timing.median_ms(lambda c=config: gemm(x[:m], w, c))
        except triton.runtime.errors.OutOfResources:
            continue
        if best is None or ms < best[0]:
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            best = (ms, config, err)
    row["triton_ms"], row["triton_config"], row["err"] = best
    return row


def check() -> None:
    """The Triton GEMM against torch on small float32 shapes (run under TRITON_INTERPRET=1)."""
    for m, n, k in [(1, 16, 32), (37, 50, 64), (130, 33, 128)]:
        for config in [(16, 16, 32, 4, 1), (32, 64, 32, 4, 1)]:
            name = f"m{m}_n{n}_k{k}_bm{config[0]}_bn{config[1]}"
            gen = torch.Generator().manual_seed(m * n)
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            ok = torch.allclose(gemm(x, w, config), x @ w.T, rtol=1e-4, atol=1e-4)
            print(f"RESULT {name} {'ok' if ok else 'FAIL'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="Llama-3.1-8B", help=f"comma-separated: {list(MODELS)}")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M")
    p.add_argument("--json", default=None)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check:
        return check()
    props = torch.cuda.get_device_properties(0)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {props.name}, "
          f"torch {torch.__version__}, triton {triton.__version__}\n")  # fmt: skip
    report = {}
    for model in args.models.split(","):
        print(f"### {model}\n\n| layer | M | cuBLAS ms | cuBLAS, M padded to 128s ms | best Triton "
              "ms (config) | floor ms | cuBLAS / floor | best / cuBLAS | err |\n"
              "|---|---:|---:|---:|---|---:|---:|---:|---:|")  # fmt: skip
        rows = report[model] = []
        for layer, (n, k) in layer_shapes(model).items():
            for m in map(int, args.ms.split(",")):
                r = measure(m, n, k) | {"layer": layer}
                rows.append(r)
                best = min(r["cublas_ms"], r["cublas_pad_ms"], r["triton_ms"])
                print(f"| {layer} | {m} | {r['cublas_ms']:.4f} | {r['cublas_pad_ms']:.4f} "
                      f"| {r['triton_ms']:.4f} {r['triton_config']} | {r['floor_ms']:.4f} "
                      f"| {r['cublas_ms'] / r['floor_ms']:.2f} | {best / r['cublas_ms']:.2f} "
                      f"| {r['err']:.1e} |", flush=True)  # fmt: skip
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])  # paged_attention.py beside this file
    main()
