"""Paged decode attention on the GPU: Triton kernel against the PyTorch reference.

For the Llama-3.2-1B (32 q heads, 8 KV heads, head_dim 64) and 3B (24 q heads, 8 KV heads,
head_dim 128) head shapes, bfloat16, block size 16, random non-contiguous block tables, every
sequence of a row at the same context length, prints one markdown table row per
(batch, context): PyTorch ms, Triton ms, speedup, achieved K/V bandwidth (K and V bytes read
over the Triton time) and its fraction of the device-to-device copy bandwidth measured here
(bytes read + written), the floor (K/V bytes over that bandwidth) and the split count.

Timing: medians over CUDA events, the L2 flushed before each call by reading 256 MB (see
flush_l2_by_reading). "Triton ms" is GPU time, the call replayed from a CUDA graph, as a decode
step runs once graphs are captured. "eager us/call" is wall time per plain call, back to back:
the Python launcher's host cost wherever it exceeds the GPU time. The reference cannot be
captured (it syncs on seq_lens.max()), so it is timed eagerly. `--diagnose` adds, at the
bandwidth rows, split and merge variants, do_bench's zero-write flush, and a fixed-cost probe.
`--mixed` runs instead batches whose contexts are spread uniformly over [100, 2,048] tokens
(as in the throughput benchmark, where they are the largest kernel time) at each split count:
with one split the longest sequences' programs finish last, alone; each sequence spreads its
own tiles over the splits, so more splits shorten that tail at the cost of the partials and
the merge; each split count runs in batch order and with the programs dispatched longest
context first (`seq_order`, as the engine does from ORDER_MIN_SEQS sequences). The head
shapes include a TP=2 rank's (half the heads).

`--mixed --tiles 128,4,3;256,4,3` times instead, at the same contexts, the engine's split rule
(longest first) with each (tokens per K/V tile, warps, pipeline stages).

    PYTHONPATH=src python benchmarks/paged_attention.py [--diagnose] [--mixed [--tiles T]]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import statistics
import time

import torch
import triton
from triton.testing import do_bench

from llm_inference.entrypoints.bench import copy_bandwidth
from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels import reference
from llm_inference.kernels.device import num_sms

ROWS = [(1, 128), (1, 512), (4, 128), (4, 512), (16, 2048), (64, 4096), (256, 1024), (1, 32768)]
SHAPES = {"Llama-3.2-1B": (32, 8, 64), "Llama-3.2-3B": (24, 8, 128)}
BANDWIDTH_ROWS = [(64, 4096), (1, 32768)]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


FLUSH_ELEMS = 64 << 20  # 256 MB of float32, four times the L2


@functools.lru_cache(maxsize=1)
def _flush_buffer() -> torch.Tensor:
    return torch.rand(FLUSH_ELEMS, device=DEVICE)


def flush_l2_by_reading() -> None:
    """Evict the L2 by reading 256 MB: the lines left behind are clean. (do_bench's flush
    writes zeros; the ~50 MB of dirty lines it leaves are written back during the next
    kernel, and charged to it.)"""
    _flush_buffer().amax()


def median_ms(fn, rep: int = 100, flush: str = "read") -> float:
    """Median time of `fn` between CUDA events, the L2 flushed before each call."""
    if flush == "zero":
        return do_bench(fn, warmup=25, rep=rep, return_mode="median")
    fn()
    torch.cuda.synchronize()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for _ in range(5):
        flush_l2_by_reading()
        fn()
    last.record()
    torch.cuda.synchronize()
    n = max(5, min(2000, int(rep / (first.elapsed_time(last) / 5))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]  # fmt: skip
    for start, end in events:
        flush_l2_by_reading()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def make_case(batch: int, seq: int, shape: tuple[int, int, int], gen: torch.Generator,
              lens: list[int] | None = None):  # fmt: skip
    """Every sequence `seq` tokens long, or `lens` (each at most seq)."""
    num_heads, num_kv, head_dim = shape
    per_seq = math.ceil(seq / BLOCK_SIZE)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv, head_dim)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    q = torch.randn(batch, num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    if lens is None:
        lens = [seq] * batch
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE, torch.int32), lens


def kv_bytes(batch: int, seq: int, shape) -> int:
    return 2 * batch * seq * shape[1] * shape[2] * DTYPE.itemsize


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1)
    return err.max().item()


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def eager_us_per_call(fn, calls: int = 300) -> float:
    """Back-to-back plain calls, no flush: host launch cost or GPU time, whichever is larger."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


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
    t_graph = median_ms(capture(triton_fn).replay)
    eager_us = eager_us_per_call(triton_fn)
    bw = kv_bytes(batch, seq, shape) / (t_graph * 1e-3)
    splits = pa.choose_splits(
        batch, shape[1], seq, pa.default_block_n(shape[2], BLOCK_SIZE), num_sms(q.device)
    )
    return dict(batch=batch, seq=seq, torch_ms=t_torch, triton_ms=t_graph, eager_us=eager_us,
                speedup=t_torch / t_graph, eager_speedup=t_torch * 1e3 / eager_us,
                bw_gbs=bw / 1e9, bw_frac=bw / copy_bw,
                floor_ms=kv_bytes(batch, seq, shape) / copy_bw * 1e3, err=err,
                splits=splits)  # fmt: skip


DIAGNOSE = {  # row -> variants (name, waves, min_chunk, fused)
    (64, 4096): [("default", 0, 0, False), ("2 splits", 8, 0, False)],
    (1, 32768): [("default", 0, 0, False), ("waves 2", 2, 0, False),
                 ("waves 8", 8, 0, False), ("fused merge", 0, 0, True)],
}  # fmt: skip


def diagnose_row(batch, seq, shape, gen, copy_bw) -> list[dict]:
    """At a bandwidth row: split variants, each graph-timed with both L2 flushes, and a
    fixed-cost probe: the same graph with every sequence 1 token long (launch, dependent
    first loads, merge; no streaming)."""
    q, k_cache, v_cache, tables, lens = make_case(batch, seq, shape, gen)
    scale, head_dim = shape[2] ** -0.5, shape[2]
    out = torch.empty_like(q)
    ref = reference.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    block_n = pa.default_block_n(head_dim, BLOCK_SIZE)
    sms = num_sms(q.device)
    results = []
    for name, waves, min_chunk, fused in DIAGNOSE[(batch, seq)]:
        splits = pa.choose_splits(batch, shape[1], seq, block_n, sms, waves, min_chunk)
        fn = functools.partial(pa.launch, q, k_cache, v_cache, tables, lens, scale, out, splits,
                               block_n, fused_merge=fused)  # fmt: skip
        graph = capture(fn)
        graph.replay()
        err = rel_error(out, ref)
        ms = median_ms(graph.replay)
        zero_ms = median_ms(graph.replay, flush="zero")
        lens.fill_(1)
        fixed_ms = median_ms(graph.replay)
        lens.fill_(seq)
        bw = kv_bytes(batch, seq, shape) / (ms * 1e-3)
        results.append(dict(batch=batch, seq=seq, variant=name, splits=splits, ms=ms,
                            zero_flush_ms=zero_ms, fixed_ms=fixed_ms, bw_frac=bw / copy_bw,
                            err=err))  # fmt: skip
    return results


MIXED_SHAPES = {"1B": (32, 8, 64), "3B": (24, 8, 128), "3B TP=2 rank": (12, 4, 128)}
MIXED_BATCHES = (64, 256)
MIXED_SPLITS = (1, 2, 3, 4, 8)
MIXED_RANGE = (100, 2048)


def mixed_cases(gen):
    """(heads name, shape, batch, case) for each MIXED_SHAPES x MIXED_BATCHES, contexts uniform
    in MIXED_RANGE; case: the inputs, the reference output, a NaN-filled `out`, the K/V bytes
    and the longest-first order."""
    for name, shape in MIXED_SHAPES.items():
        for batch in MIXED_BATCHES:
            lens = torch.randint(*MIXED_RANGE, (batch,), generator=gen).tolist()
            q, k_cache, v_cache, tables, lens_t = make_case(batch, max(lens), shape, gen, lens)
            scale = shape[2] ** -0.5
            case = dict(
                inputs=(q, k_cache, v_cache, tables, lens_t, scale),
                ref=reference.paged_attention_decode(q, k_cache, v_cache, tables, lens_t, scale),
                out=torch.empty_like(q),
                nbytes=sum(kv_bytes(1, n, shape) for n in lens),
                longest_first=torch.argsort(lens_t, descending=True).to(torch.int32),
            )
            yield name, shape, batch, case
            torch.cuda.empty_cache()


def graph_ms(case: dict, *args, **kwargs) -> float:
    """Graph-timed ms of pa.launch(*case inputs, out, *args, **kwargs), out NaN-poisoned."""
    fn = functools.partial(pa.launch, *case["inputs"], case["out"], *args, **kwargs)
    case["out"].fill_(float("nan"))
    graph = capture(fn)
    graph.replay()
    return median_ms(graph.replay)


def mixed_rows(gen, copy_bw) -> list[dict]:
    """Contexts uniform in MIXED_RANGE: graph-timed ms at each split count."""
    rows = []
    for name, shape, batch, case in mixed_cases(gen):
        block_n = pa.default_block_n(shape[2], BLOCK_SIZE)
        sms = num_sms(case["out"].device)
        defaults = {"batch": pa.choose_splits(batch, shape[1], 4096, block_n, sms),
                    "longest first": pa.choose_splits(batch, shape[1], 4096, block_n, sms,
                                                      pa.ORDERED_WAVES)}  # fmt: skip
        for splits, order in itertools.product(MIXED_SPLITS, ("batch", "longest first")):
            seq_order = case["longest_first"] if order != "batch" else None
            ms = graph_ms(case, splits, block_n, seq_order=seq_order)
            default = defaults[order]
            rows.append(dict(shape=name, batch=batch, splits=splits, default=default,
                             order=order, ms=ms, bw_frac=case["nbytes"] / (ms * 1e-3) / copy_bw,
                             err=rel_error(case["out"], case["ref"])))  # fmt: skip
            r = rows[-1]
            print(
                f"| {name} | {batch} | {splits}{' (default)' if splits == default else ''} "
                f"| {order} | {ms:.4f} | {r['bw_frac']:.0%} | {r['err']:.1e} |",
                flush=True,
            )
    return rows


def tile_rows(gen, copy_bw, tiles: list[tuple[int, int, int]]) -> list[dict]:
    """Contexts uniform in MIXED_RANGE, longest first, the split count by the engine's rule
    (ORDERED_WAVES) for each tile's size: graph-timed ms per (block_n, warps, stages)."""
    rows = []
    for name, shape, batch, case in mixed_cases(gen):
        sms = num_sms(case["out"].device)
        default = pa.default_block_n(shape[2], BLOCK_SIZE)
        for block_n, warps, stages in tiles:
            splits = pa.choose_splits(batch, shape[1], 4096, block_n, sms, pa.ORDERED_WAVES)
            try:
                ms = graph_ms(case, splits, block_n, num_warps=warps, num_stages=stages,
                              seq_order=case["longest_first"])  # fmt: skip
            except Exception as e:  # e.g. out of shared memory: report, go on
                print(f"| {name} | {batch} | {block_n}, {warps}, {stages} | failed: "
                      f"{type(e).__name__} |", flush=True)  # fmt: skip
                continue
            is_default = (block_n, warps, stages) == (default, 4, 3)
            rows.append(dict(shape=name, batch=batch, block_n=block_n, num_warps=warps,
                             num_stages=stages, splits=splits, default=is_default, ms=ms,
                             bw_frac=case["nbytes"] / (ms * 1e-3) / copy_bw,
                             err=rel_error(case["out"], case["ref"])))  # fmt: skip
            r = rows[-1]
            print(
                f"| {name} | {batch} | {block_n}, {warps}, {stages}"
                f"{' (default)' if is_default else ''} | {splits} | {ms:.4f} "
                f"| {r['bw_frac']:.0%} | {r['err']:.1e} |",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument(
        "--mixed", action="store_true", help="only: mixed context lengths by split count"
    )
    parser.add_argument(
        "--tiles", default="", help="with --mixed: block_n,warps,stages;... to time instead"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth(DEVICE, 2 << 30)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {props.name}, "
          f"{props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s\n")
    report = dict(gpu=props.name, copy_gbs=copy_bw / 1e9, rows={}, diagnosis={})
    for name, shape in {} if args.mixed else SHAPES.items():
        print(f"### {name}: {shape[0]} q heads, {shape[1]} KV heads, head_dim {shape[2]}\n")
        print("| batch | context | PyTorch ms | Triton ms | speedup | K/V GB/s | of copy BW "
              "| floor ms | splits | eager us/call | eager speedup | rel err |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        rows = report["rows"][name] = []
        for batch, seq in ROWS:
            r = bench_row(batch, seq, shape, gen, copy_bw)
            rows.append(r)
            print(f"| {batch} | {seq} | {r['torch_ms']:.3f} | {r['triton_ms']:.4f} "
                  f"| {r['speedup']:.1f}x | {r['bw_gbs']:.0f} | {r['bw_frac']:.0%} "
                  f"| {r['floor_ms']:.4f} | {r['splits']} | {r['eager_us']:.0f} "
                  f"| {r['eager_speedup']:.1f}x | {r['err']:.1e} |", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        print()
    if args.diagnose:
        for name, shape in SHAPES.items():
            print(f"### diagnosis {name}\n")
            print("| batch | context | variant | splits | ms | ms, zero-write flush | fixed ms "
                  "| of copy BW | rel err |")  # fmt: skip
            print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
            out = report["diagnosis"][name] = []
            for batch, seq in DIAGNOSE:
                for r in diagnose_row(batch, seq, shape, gen, copy_bw):
                    out.append(r)
                    print(f"| {batch} | {seq} | {r['variant']} | {r['splits']} | {r['ms']:.4f} "
                          f"| {r['zero_flush_ms']:.4f} | {r['fixed_ms']:.4f} "
                          f"| {r['bw_frac']:.0%} | {r['err']:.1e} |", flush=True)  # fmt: skip
                torch.cuda.empty_cache()
            print()
    if args.mixed and args.tiles:
        tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
        print(f"### contexts uniform in {MIXED_RANGE}, longest first, by tile\n")
        print("| heads | batch | tokens, warps, stages | splits | Triton ms | of copy BW "
              "| rel err |")  # fmt: skip
        print("|---|---:|---|---:|---:|---:|---:|")
        report["mixed_tiles"] = tile_rows(gen, copy_bw, tiles)
        print()
    elif args.mixed:
        print(f"### contexts uniform in {MIXED_RANGE}, by split count\n")
        print("| heads | batch | splits | program order | Triton ms | of copy BW | rel err |")
        print("|---|---:|---:|---|---:|---:|---:|")
        report["mixed"] = mixed_rows(gen, copy_bw)
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
