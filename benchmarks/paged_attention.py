"""Paged decode attention on the GPU: Triton kernel against the PyTorch reference.

For the Llama-3.2-1B (32 q heads, 8 KV heads, head_dim 64) and 3B (24 q heads, 8 KV heads,
head_dim 128) head shapes, bfloat16, block size 16, random non-contiguous block tables, every
sequence of a row at the same context length, prints one markdown table row per
(batch, context): PyTorch ms, Triton ms, speedup, achieved K/V bandwidth (K and V bytes read
over the Triton time) and its fraction of the device-to-device copy bandwidth measured here
(bytes read + written). Times are medians of triton.testing.do_bench, which flushes L2 before
each call. "Triton ms" is GPU time, the call replayed from a CUDA graph (as a decode step runs
once graphs are captured); "Triton eager ms" times plain calls, where the host cost of the
Python launcher shows whenever it exceeds the GPU time. The reference cannot be captured
(it syncs on seq_lens.max()), so it is timed eagerly. `--sweep` adds split-count and merge
variants, with fixed-cost probes, at SWEEP_ROWS.

    PYTHONPATH=src python benchmarks/paged_attention.py [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math

import torch
import triton
from triton.testing import do_bench

from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels import reference

ROWS = [(1, 128), (1, 512), (4, 128), (4, 512), (16, 2048), (64, 4096), (256, 1024), (1, 32768)]
SHAPES = {"Llama-3.2-1B": (32, 8, 64), "Llama-3.2-3B": (24, 8, 128)}
BANDWIDTH_ROWS = [(64, 4096), (1, 32768)]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def median_ms(fn, rep: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB of random data, bytes read + written per second."""
    src = torch.randn(1 << 30, device=DEVICE, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = median_ms(functools.partial(dst.copy_, src))
    return 2 * src.numel() * src.element_size() / ms * 1e3


def make_case(batch: int, seq: int, shape: tuple[int, int, int], gen: torch.Generator):
    num_heads, num_kv, head_dim = shape
    per_seq = math.ceil(seq / BLOCK_SIZE)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv, head_dim)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    q = torch.randn(batch, num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    lens = torch.full((batch,), seq, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE, torch.int32), lens


def kv_bytes(batch: int, seq: int, shape) -> int:
    return 2 * batch * seq * shape[1] * shape[2] * DTYPE.itemsize


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1)
    return err.max().item()


def graph_ms(fn) -> float:
    """Median GPU time of `fn` replayed from a CUDA graph (no host launch cost in it)."""
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def bench_row(batch, seq, shape, gen, copy_bw) -> dict:
    q, k_cache, v_cache, tables, lens = make_case(batch, seq, shape, gen)
    scale = shape[2] ** -0.5
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, tables, lens, scale)
    triton_fn = lambda: pa.paged_attention_decode(*args, out, max_seq_len=seq)
    torch_fn = lambda: reference.paged_attention_decode(*args)
    triton_fn()
    err = rel_error(out, torch_fn())
    t_torch = median_ms(torch_fn, rep=100 if batch * seq <= 65536 else 40)
    t_eager = median_ms(triton_fn)
    t_graph = graph_ms(triton_fn)
    bw = kv_bytes(batch, seq, shape) / (t_graph * 1e-3)
    splits, _ = pa.choose_splits(
        batch, shape[1], seq, pa.default_block_n(shape[2], BLOCK_SIZE), pa._num_sms(q.device)
    )
    return dict(batch=batch, seq=seq, torch_ms=t_torch, triton_ms=t_graph, eager_ms=t_eager,
                speedup=t_torch / t_graph, eager_speedup=t_torch / t_eager, bw_gbs=bw / 1e9,
                bw_frac=bw / copy_bw, floor_ms=kv_bytes(batch, seq, shape) / copy_bw * 1e3,
                err=err, splits=splits)  # fmt: skip


SWEEP_ROWS = [(4, 512), (16, 2048), (64, 4096), (1, 32768)]
SWEEP = [  # (waves, min_chunk, fused, num_stages)
    (4, 256, True, 3), (4, 256, False, 3), (1, 256, True, 3), (2, 256, True, 3),
    (8, 256, True, 3), (4, 512, True, 3), (4, 1024, True, 3), (4, 256, True, 4),
]  # fmt: skip


def sweep_row(batch, seq, shape, gen, copy_bw) -> list[dict]:
    """Split-count and merge variants, graph-timed, each with a fixed-cost probe: the same
    grid with every sequence 1 token long (launch, first loads, merge; no streaming)."""
    q, k_cache, v_cache, tables, lens = make_case(batch, seq, shape, gen)
    scale, head_dim = shape[2] ** -0.5, shape[2]
    out = torch.empty_like(q)
    ref = reference.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    block_n = pa.default_block_n(head_dim, BLOCK_SIZE)
    sms = pa._num_sms(q.device)
    results = []
    for waves, min_chunk, fused, stages in SWEEP:
        splits, chunk = pa.choose_splits(batch, shape[1], seq, block_n, sms, waves, min_chunk)
        fn = functools.partial(pa.launch, q, k_cache, v_cache, tables, lens, scale, out, splits,
                               chunk, block_n, 4, stages, fused)  # fmt: skip
        fn()
        err = rel_error(out, ref)
        ms = graph_ms(fn)
        lens.fill_(1)
        fixed_ms = graph_ms(fn)
        lens.fill_(seq)
        bw = kv_bytes(batch, seq, shape) / (ms * 1e-3)
        results.append(dict(batch=batch, seq=seq, waves=waves, min_chunk=min_chunk,
                            fused=fused, stages=stages, splits=splits, ms=ms,
                            fixed_ms=fixed_ms, bw_frac=bw / copy_bw, err=err))  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {props.name}, "
          f"{props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s\n")
    report = dict(gpu=props.name, copy_gbs=copy_bw / 1e9, rows={}, sweep={})
    for name, shape in SHAPES.items():
        print(f"### {name}: {shape[0]} q heads, {shape[1]} KV heads, head_dim {shape[2]}\n")
        print("| batch | context | PyTorch ms | Triton ms | speedup | K/V GB/s | of copy BW "
              "| floor ms | splits | Triton eager ms | eager speedup | rel err |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        rows = report["rows"][name] = []
        for batch, seq in ROWS:
            r = bench_row(batch, seq, shape, gen, copy_bw)
            rows.append(r)
            print(f"| {batch} | {seq} | {r['torch_ms']:.3f} | {r['triton_ms']:.4f} "
                  f"| {r['speedup']:.1f}x | {r['bw_gbs']:.0f} | {r['bw_frac']:.0%} "
                  f"| {r['floor_ms']:.4f} | {r['splits']} | {r['eager_ms']:.4f} "
                  f"| {r['eager_speedup']:.1f}x | {r['err']:.1e} |", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        print()
    if args.sweep:
        for name, shape in SHAPES.items():
            print(f"### sweep {name}\n")
            print("| batch | context | waves | min chunk | fused | stages | splits | ms "
                  "| fixed ms | of copy BW | rel err |")  # fmt: skip
            print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
            out = report["sweep"][name] = []
            for batch, seq in SWEEP_ROWS:
                for r in sweep_row(batch, seq, shape, gen, copy_bw):
                    out.append(r)
                    print(f"| {batch} | {seq} | {r['waves']} | {r['min_chunk']} | {r['fused']} "
                          f"| {r['stages']} | {r['splits']} | {r['ms']:.4f} "
                          f"| {r['fixed_ms']:.4f} | {r['bw_frac']:.0%} | {r['err']:.1e} |",
                          flush=True)  # fmt: skip
                torch.cuda.empty_cache()
            print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
