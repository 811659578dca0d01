"""Does an L2 prefetch save a decode matmul that follows an idle window? On the GPU,
bfloat16, the Llama 3.2 1B and 3B shapes. (A ninth-session experiment: the engine wiring lost
and is kept as results/session9_2026-12-01_h200/l2_prefetch_engine.patch.)

The idea: at small decode batches the small matmuls run far below the bandwidth (o_proj of the
1B: 8.4 MB in ~6 us against a 2 us byte floor), while between the qkv projection and o_proj the
step runs RoPE, the KV store and attention, ~8 us in which HBM carries almost nothing. A tiny
kernel (below) issues Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global [addr],
bytes`: fire and forget, no registers) over the next matmul's weight, so that the matmul reads
it from L2.

Each case is one decoder-layer transition as the engine runs it at small batches:

    skinny_gemm(x, A[i])          the matmul before (qkv, or the MLP's down projection)
    [prefetch(B[i])]              "prefetch": the kernel below over B; "empty": the same kernel
                                  prefetching nothing (its launch and PDL handshake alone)
    torch.cuda._sleep(window)     the kernels in between, which leave HBM idle
    skinny_gemm(x, B[i])          the matmul after (o_proj, or the next layer's qkv)

in a CUDA graph cycling over enough copies of A and B (at least 200 MB each, 4x the H200's
L2) that without a prefetch every matmul reads its weights from HBM. PDL is on, as in the
engine. Times per transition = median replay time / transitions; "before", "after cold" and
"after in L2" time the matmuls alone (B from HBM, and B's one copy resident in L2). The
prefetch's benefit is "empty" - "prefetch"; its node cost "prefetch" - "plain" + that benefit.

    PYTHONPATH=src python3 benchmarks/l2_prefetch.py [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import torch
import triton
import triton.language as tl
from skinny_gemm import time_calls  # benchmarks/skinny_gemm.py, beside this script

from llm_inference.kernels import pdl
from llm_inference.kernels import skinny_gemm as sg

DTYPE = torch.bfloat16
FLUSH_BYTES = 200 << 20
REPLAYS = 15
# (model, before, after): (N, K) of the two weights
TRANSITIONS = {
    "1B qkv -> o": ((3072, 2048), (2048, 2048)),
    "1B down -> qkv": ((2048, 8192), (3072, 2048)),
    "3B qkv -> o": ((5120, 3072), (3072, 3072)),
    "3B down -> qkv": ((3072, 8192), (5120, 3072)),
}
WINDOWS_US = [0.0, 2.0, 4.0, 8.0]
ROWS = [1, 8, 16]
CHUNK = 16 * 1024  # bytes per bulk prefetch instruction
PER_PROGRAM = 32  # prefetches per program: one per lane of its one warp
PDL = False  # whether the kernels launch with PDL (main: on where supported, unless --no-pdl)


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    """Program p prefetches chunks [p * PER_PROGRAM, +PER_PROGRAM) of CHUNK bytes each (the
    last one short, those past the end none)."""
    chunk = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    offsets = chunk.to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offsets, 0), CHUNK).to(tl.int32)
    address = (ptr + offsets).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [address, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    if PDL:
        pdl.wait_then_release()


def prefetch(t: torch.Tensor, empty: bool = False) -> None:
    """Start bringing `t`'s bytes (a contiguous CUDA tensor, 16-byte aligned) into L2; returns
    at once, the bytes arrive while later kernels run. `empty`: the same launch, no prefetch."""
    nbytes = (t.numel() * t.element_size()) & ~15
    assert t.is_contiguous() and t.data_ptr() % 16 == 0
    grid = (triton.cdiv(nbytes, CHUNK * PER_PROGRAM),)
    _prefetch_kernel[grid](
        t.view(-1).view(torch.uint8), 0 if empty else nbytes, CHUNK=CHUNK, PER_PROGRAM=PER_PROGRAM,
        PDL=PDL, num_warps=1, **pdl.launch_kwargs(PDL),
    )  # fmt: skip


def copies(n: int, k: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(n * 7 + k)
    return [(torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(DTYPE)
            for _ in range(count)]  # fmt: skip


def time_graph(body, calls: int) -> float:
    """Microseconds per call of body(i), i = 0..calls-1, in one CUDA graph (skinny_gemm.py's
    timing: median of its replays)."""
    return time_calls(body, list(range(calls)))


def cycles_per_us() -> float:
    """torch.cuda._sleep's clock: cycles per microsecond, measured."""
    cyc = 200_000
    us = time_graph(lambda i: torch.cuda._sleep(cyc), 16)
    return cyc / us


def transition(a, b, rows: int, windows, cpu: float, name: str) -> list[dict]:
    """The rows of one transition at one batch size (a, b: the weight copies)."""
    count = len(a)
    xa = torch.randn(rows, a[0].shape[1], device="cuda", dtype=DTYPE)
    xb = torch.randn(rows, b[0].shape[1], device="cuda", dtype=DTYPE)
    before = time_graph(lambda i: sg.skinny_gemm(xa, a[i % count], pdl=PDL), count)
    after_cold = time_graph(lambda i: sg.skinny_gemm(xb, b[i % count], pdl=PDL), count)
    after_hot = time_graph(lambda i: sg.skinny_gemm(xb, b[0], pdl=PDL), count)
    out = []
    for w_us in windows:
        cyc = int(w_us * cpu)

        def body(i, pre, cyc=cyc):
            sg.skinny_gemm(xa, a[i % count], pdl=PDL)
            if pre:
                prefetch(b[i % count], empty=pre == "empty")
            if cyc:
                torch.cuda._sleep(cyc)
            sg.skinny_gemm(xb, b[i % count], pdl=PDL)

        window = time_graph(lambda i, cyc=cyc: torch.cuda._sleep(cyc), count) if cyc else 0.0
        plain = time_graph(lambda i: body(i, False), count)
        empty = time_graph(lambda i: body(i, "empty"), count)
        pre = time_graph(lambda i: body(i, "prefetch"), count)
        out.append(dict(transition=name, rows=rows, window_us=round(window, 2),
                        before_us=round(before, 2), after_cold_us=round(after_cold, 2),
                        after_hot_us=round(after_hot, 2), total_us=round(plain, 2),
                        total_empty_kernel_us=round(empty, 2),
                        total_prefetch_us=round(pre, 2), saved_us=round(plain - pre, 2),
                        benefit_us=round(empty - pre, 2)))  # fmt: skip
        print(
            f"| {name} | {rows} | {window:.1f} | {before:.1f} | {after_cold:.1f} | "
            f"{after_hot:.1f} | {plain:.1f} | {empty:.1f} | {pre:.1f} | {plain - pre:+.1f} | "
            f"{empty - pre:+.1f} |",
            flush=True,
        )
    return out


def run(rows_list, windows) -> list[dict]:
    cpu = cycles_per_us()
    print(f"sleep clock: {cpu:.0f} cycles/us")
    results = []
    for name, ((na, ka), (nb, kb)) in TRANSITIONS.items():
        count = max(2, math.ceil(FLUSH_BYTES / (min(na * ka, nb * kb) * DTYPE.itemsize)))
        a, b = copies(na, ka, count), copies(nb, kb, count)
        for rows in rows_list:
            results += transition(a, b, rows, windows, cpu, name)
        del a, b
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS_US)), help="us, comma list")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    global PDL
    PDL = not args.no_pdl and pdl.resolve(None, "cuda")
    print(f"{torch.cuda.get_device_name()}, PDL {'on' if PDL else 'off'}")
    print("| transition | rows | window us | before us | after cold | after in L2 | "
          "plain us | empty kernel | prefetch | saved | benefit |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [int(r) for r in args.rows.split(",")]
    windows = [float(w) for w in args.windows.split(",")]
    results = run(rows, windows)
    if args.json:
        meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                    pdl=PDL, torch=torch.__version__)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
