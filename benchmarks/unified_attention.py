"""Unified paged attention (a step's prompt chunks and decodes) on the GPU.

Llama-3.2-1B heads (32 q, 8 KV, head_dim 64), 3B heads (24 q, 8 KV, head_dim 128) and
Llama-3.1-8B heads (32 q, 8 KV, head_dim 128), bfloat16, block size 16, random non-contiguous
block tables. Per layer, three tables:
- Prefill: one 8,000-token prompt, one of 2,048, 64 x 512-token prompts, 4 x 2,000 (a step
  of issue 28's prefill-heavy mix) and a 4,000-token chunk after 8,000 cached tokens (a
  12,000-token prompt's second step; `--quick`: the first two). Triton `unified_attention`
  (CUDA-graph replay: GPU time), PyTorch SDPA on its cuDNN and flash backends (one call per
  sequence, GQA by enable_gqa: on its new tokens' K/V, causal, where it has no cached context;
  else on its K/V gathered from the cache in the timed call, a lower-right causal mask;
  graph-replayed; with their errors and cuDNN's first call at the row's lengths, which builds
  its plan: whether cuDNN's fused attention could take such chunks),
  with `--fa3` vLLM's FlashAttention 3 on the same paged cache
  (`vllm.vllm_flash_attn`, when vLLM is installed; graph-replayed), FlashAttention 4 on it
  where the flash-attn-4 package is installed (kernels/flash_attention.py's varlen call, with
  its first call's JIT compile, and again on a copy of the cache in 128-token pages, which it
  loads by TMA; scripts/wheels_carry.sh brings it), the causal FLOP floor at
  793 TFLOP/s (4 x L x (c + (L + 1) / 2) x Hq x D flops per sequence of L new tokens after c
  cached) and the Triton kernel's achieved TFLOP/s.
- Decode: batch 1/64/256 at contexts 128..4,096 and 16 at 12,288 (the long-prompt mix's
  decodes): unified_attention (max_query_len=1) against paged_attention_decode, both
  graph-replayed (ratio > 1: the unified op is slower), with `--fa3` FA3 on the same cache, and
  the floor: the cached K/V bytes over COPY_BYTES_PER_S.
- Mixed: one 2,048-token chunk beside 255 decodes at context 1,024, a chat-like step (a
  411-token prompt beside 255 decodes at context 600), and 16 chunks of 256 tokens after 3,840
  cached tokens: the unified op (its decodes in the decode kernel, the chunks in the tiled
  one) against one tiled launch over every row (`ua.launch` with the default tiles: before
  2026-12-02) and, where FA4 is installed, its call on the chunks followed by our decode
  kernel (the engine's path for steps of flash_attention.MIN_TOKENS or more at head size 128
  and pages of 16 or 32 tokens: flash_attention.applies), with the floor:
  the larger of the FLOP floor and the K/V bytes over COPY_BYTES_PER_S.
Times: medians over CUDA events after warm-up, L2 flushed before each call by reading 256 MB
(benchmarks/paged_attention.py). rel err: worst per-sequence relative L2 error against
reference.unified_attention in float32. `--sweep` adds timings of other tile configs (BLOCK_M,
BLOCK_N, warps, stages) to tune `default_tiles`: of the prefill rows, and of the mixed rows'
tiled launch alone (its decodes skipped, as `unified_attention` launches it); all of SWEEP, or
the configs given (`--sweep "128,64,8,3;256,64,8,3"`); `--quick` runs fewer rows.

    PYTHONPATH=src python benchmarks/unified_attention.py [--quick] [--sweep [CONFIGS]] [--fa3]
        [--shapes Llama-3.1-8B] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import time

import paged_attention as decode_bench  # benchmarks/paged_attention.py: timing helpers
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from llm_inference.kernels import flash_attention, reference
from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels import unified_attention as ua

SHAPES = {"Llama-3.2-1B": (32, 8, 64), "Llama-3.2-3B": (24, 8, 128),
          "Llama-3.1-8B": (32, 8, 128)}  # fmt: skip
# (sequences, new tokens each, cached tokens each)
PREFILL_ROWS = [(1, 8000, 0), (1, 2048, 0), (64, 512, 0), (4, 2000, 0), (1, 4000, 8000)]
# (batch, context); the last: the long-prompt mix's decodes (16 sequences at ~12,000 tokens)
DECODE_ROWS = [(b, c) for b in (1, 64, 256) for c in (128, 512, 1024, 4096)] + [(16, 12288)]
QUICK_DECODE_ROWS = [(1, 4096), (64, 1024), (256, 128)]
MIXED_ROWS = {"2048 + 255 decodes": ([2048] + [1] * 255, [0] + [1023] * 255),
              "411 + 255 decodes at 600": ([411] + [1] * 255, [0] + [599] * 255),
              "16 x 256 after 3840": ([256] * 16, [3840] * 16)}  # fmt: skip
SWEEP = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
         (128, 128, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 64, 4, 4), (128, 64, 8, 4),
         (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 2), (256, 128, 8, 2),
         (64, 128, 4, 3), (128, 32, 4, 4), (128, 64, 8, 2)]  # fmt: skip
PEAK_FLOPS = 793e12  # H200 dense bf16
COPY_BYTES_PER_S = 4.24e12  # H200 device copy, measured
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def causal_flops(length: int, context: int, shape) -> float:
    """The attention FLOPs of one sequence's `length` new tokens after `context` cached ones:
    4 x L x (c + (L + 1) / 2) x Hq x D (QK^T and PV, each row over its visible keys)."""
    return 4 * length * (context + (length + 1) / 2) * shape[0] * shape[2]


def make_batch(q_lens, contexts, shape, gen):
    """(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)."""
    num_heads, num_kv, head_dim = shape
    lens = [c + n for c, n in zip(contexts, q_lens)]
    need = [math.ceil(n / BLOCK_SIZE) for n in lens]
    width = max(need)
    perm = torch.randperm(sum(need), generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used : used + n]
        used += n
    cache_shape = (sum(need), BLOCK_SIZE, num_kv, head_dim)
    k_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device=DEVICE, dtype=DTYPE)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), cu, seq_lens


def rel_error(out, case, scale) -> float:
    f = torch.float32
    q, k_cache, v_cache, table, cu, lens = case
    ref = reference.unified_attention(q.to(f), k_cache.to(f), v_cache.to(f), table, cu, lens,
                                      scale)  # fmt: skip
    bounds, worst = cu.tolist(), 0.0
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            err = (out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()
            worst = max(worst, err.item())
    return worst


def graph_ms(fn) -> float:
    return decode_bench.median_ms(decode_bench.capture(fn).replay)


def first_call(run):
    """`run()`'s result and its wall ms: the first call at these sizes, where a backend builds
    its plan (cuDNN) or compiles (FA4's JIT)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = run()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3


def refused(name: str, e: Exception) -> tuple[float, float, float]:
    """NaNs for a backend that refused the call, the reason printed."""
    print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    return (float("nan"),) * 3


SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def sdpa_ms(case, q_lens, scale, backend: str) -> tuple[float, float, float]:
    """(ms, rel err, the first call's wall ms) of PyTorch SDPA on one backend, one call per
    sequence: over its new tokens' K/V where it has no cached context (causal; the step's k/v
    would serve as they are), else over its whole K/V gathered from the cache inside the timed
    call (a lower-right causal mask); GQA by enable_gqa; graph-replayed, eager where the
    backend refuses capture; NaNs where it refuses the call (the reason printed)."""
    q, k_cache, v_cache, table, cu, seq_lens = case
    bounds, lens, block = cu.tolist(), seq_lens.tolist(), k_cache.shape[1]
    blocks = [table[s, : -(-n // block)].long() for s, n in enumerate(lens)]

    def kv(cache, s):  # [1, Hkv, len, D] in the token-major layout of the step's k/v
        return cache[blocks[s]].flatten(0, 1)[: lens[s]].transpose(0, 1)[None]

    fresh = all(n == lens[s] for s, n in enumerate(q_lens))
    ks = [kv(k_cache, s) for s in range(len(q_lens))] if fresh else None
    vs = [kv(v_cache, s) for s in range(len(q_lens))] if fresh else None
    out = torch.zeros_like(q)

    def run():
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
                k, v = (ks[s], vs[s]) if fresh else (kv(k_cache, s), kv(v_cache, s))
                mask = None if fresh else causal_lower_right(b - a, lens[s])
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=fresh,
                    scale=scale, enable_gqa=True,
                )  # fmt: skip
                out[a:b] = o[0].transpose(0, 1)

    try:
        _, first_ms = first_call(run)  # cuDNN builds its plan for each new shape
        err = rel_error(out, case, scale)
        try:
            ms = graph_ms(run)
        except RuntimeError:
            ms = decode_bench.median_ms(run, rep=50)
        return ms, err, first_ms
    except RuntimeError as e:
        return refused(f"SDPA {backend}", e)


def fa3_ms(case, max_query_len: int, max_seq_len: int, scale: float) -> float:
    """vLLM's FlashAttention 3 (as its FlashAttentionImpl calls it) on the same paged cache;
    NaN when vLLM is not installed."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return float("nan")
    q, k_cache, v_cache, table, cu, lens = case
    out = torch.empty_like(q)
    fn = lambda: flash_attn_varlen_func(
        q, k_cache, v_cache, max_query_len, cu, max_seq_len, seqused_k=lens,
        softmax_scale=scale, causal=True, block_table=table, out=out, fa_version=3,
    )  # fmt: skip
    fn()
    return graph_ms(fn)


def fa4_ms(case, max_query_len: int, max_seq_len: int, scale: float) -> tuple[float, float, float]:
    """(ms, rel err, the first call's wall ms: its JIT compile) of the engine's path where
    FlashAttention 4 takes a step (kernels/flash_attention.py; timed here at any step, head and
    page size, where the engine sends it only the steps `flash_attention.applies` takes): its
    varlen call on the prompt chunks, then our decode kernel on the one-row sequences into the
    same output. NaNs when it is not installed or refuses the call (the reason printed)."""
    q, k_cache, v_cache, table, cu, lens = case
    if not flash_attention.available(q.device):
        return (float("nan"),) * 3

    @torch.inference_mode()
    def run():
        out = flash_attention.prompt_attention(
            q, k_cache, v_cache, table, cu, lens, scale, max_query_len, max_seq_len
        )
        ua.unified_attention(q, k_cache, v_cache, table, cu, lens, scale, out, 1, max_seq_len)
        return out

    try:
        out, first_ms = first_call(run)
        return graph_ms(run), rel_error(out, case, scale), first_ms
    except Exception as e:  # a shape or layout it does not take: report and go on
        return refused("FA4", e)


def repaged(case, page: int):
    """The same step over a cache of `page`-token pages (each sequence's K/V copied into pages
    of its own, the rest zero): FA4 loads whole pages by TMA when a page is one key tile."""
    q, k_cache, v_cache, table, cu, lens = case
    block, n_lens = k_cache.shape[1], lens.tolist()
    width = max(-(-n // page) for n in n_lens)
    shape = (len(n_lens) * width, page, *k_cache.shape[2:])
    k_new, v_new = (torch.zeros(shape, dtype=k_cache.dtype, device=k_cache.device) for _ in "kv")
    new_table = torch.arange(len(n_lens) * width, dtype=torch.int32, device=q.device)
    for s, n in enumerate(n_lens):
        blocks = table[s, : -(-n // block)].long()
        for new, old in ((k_new, k_cache), (v_new, v_cache)):
            new[s * width : (s + 1) * width].flatten(0, 1)[:n] = old[blocks].flatten(0, 1)[:n]
    return q, k_new, v_new, new_table.view(len(n_lens), width), cu, lens


def sweep_ms(case, scale, out, configs, **kw) -> dict:
    """{config: ms and error} of the tiled launch at each config."""
    results = {}
    for cfg in configs:
        try:
            ms = graph_ms(functools.partial(ua.launch, *case, scale, out, *cfg, **kw))
            results[str(cfg)] = dict(ms=ms, err=rel_error(out, case, scale))
        except Exception as e:  # e.g. out of shared memory: report and go on
            results[str(cfg)] = dict(error=f"{type(e).__name__}: {str(e)[:80]}")
    return results


def prefill_row(num_seqs, length, context, shape, gen, sweep, fa3) -> dict:
    q_lens = [length] * num_seqs
    case = make_batch(q_lens, [context] * num_seqs, shape, gen)
    scale = shape[2] ** -0.5
    out = torch.empty_like(case[0])
    fn = lambda: ua.unified_attention(*case, scale, out, length, context + length)
    fn()
    flops = causal_flops(length, context, shape) * num_seqs
    row = dict(seqs=num_seqs, length=length, context=context, err=rel_error(out, case, scale),
               floor_ms=flops / PEAK_FLOPS * 1e3, triton_ms=graph_ms(fn))  # fmt: skip
    row["tflops"] = flops / row["triton_ms"] / 1e9
    row["fa3_ms"] = float("nan")
    for backend in SDPA_BACKENDS:
        ms, err, first = sdpa_ms(case, q_lens, scale, backend)
        row[f"{backend}_ms"], row[f"{backend}_err"], row[f"{backend}_first_ms"] = ms, err, first
    if fa3:
        row["fa3_ms"] = fa3_ms(case, length, context + length, scale)
    row["fa4_ms"], row["fa4_err"], row["fa4_first_ms"] = fa4_ms(case, length, context + length,
                                                                scale)  # fmt: skip
    if not math.isnan(row["fa4_ms"]):  # it ran: also on pages of one 128-key tile
        big = repaged(case, 128)
        row["fa4_page128_ms"] = fa4_ms(big, length, context + length, scale)[0]
        del big
    row["sweep"] = sweep_ms(case, scale, out, sweep)
    return row


def decode_row(batch, context, shape, gen, fa3) -> dict:
    case = make_batch([1] * batch, [context - 1] * batch, shape, gen)
    q, k_cache, v_cache, table, cu, lens = case
    scale = shape[2] ** -0.5
    out = torch.empty_like(q)
    unified = lambda: ua.unified_attention(*case, scale, out, 1, context)
    unified()
    err = rel_error(out, case, scale)
    decode = lambda: pa.paged_attention_decode(q, k_cache, v_cache, table, lens, scale, out,
                                               max_seq_len=context)  # fmt: skip
    row = dict(batch=batch, context=context, unified_ms=graph_ms(unified),
               decode_ms=graph_ms(decode), err=err)  # fmt: skip
    row["ratio"] = row["unified_ms"] / row["decode_ms"]
    row["fa3_ms"] = fa3_ms(case, 1, context, scale) if fa3 else float("nan")
    # the floor: every cached K/V byte read once at the measured copy bandwidth
    kv_bytes = batch * context * shape[1] * shape[2] * 2 * k_cache.element_size()
    row["floor_ms"] = kv_bytes / COPY_BYTES_PER_S * 1e3
    return row


def mixed_row(name, shape, gen, sweep) -> dict:
    q_lens, contexts = MIXED_ROWS[name]
    case = make_batch(q_lens, contexts, shape, gen)
    scale = shape[2] ** -0.5
    out = torch.empty_like(case[0])
    max_len = max(c + n for c, n in zip(contexts, q_lens))
    fn = lambda: ua.unified_attention(*case, scale, out, max(q_lens), max_len)
    fn()
    err = rel_error(out, case, scale)
    tiles = ua.default_tiles(shape[0] // shape[1], shape[2], max(q_lens), sum(q_lens))
    one_launch = lambda: ua.launch(*case, scale, out, *tiles)
    flops = sum(causal_flops(n, c, shape) for c, n in zip(contexts, q_lens))
    kv_bytes = sum(c + n for c, n in zip(contexts, q_lens)) * shape[1] * shape[2] * 2 * 2
    floor = max(flops / PEAK_FLOPS, kv_bytes / COPY_BYTES_PER_S) * 1e3
    fa4, fa4_err, _ = fa4_ms(case, max(q_lens), max_len, scale)
    return dict(name=name, err=err, ms=graph_ms(fn), one_launch_ms=graph_ms(one_launch),
                floor_ms=floor, tiles=tiles, fa4_ms=fa4, fa4_err=fa4_err,
                sweep=sweep_ms(case, scale, out, sweep, skip_decodes=True))  # fmt: skip


def _prompts(row) -> str:
    after = f" after {row['context']}" if row["context"] else ""
    return f"{row['seqs']} x {row['length']}{after}"


def print_prefill(rows, sweep) -> None:
    print("| prompts | Triton ms | TFLOP/s | FLOP floor ms | SDPA cuDNN ms (err; first call) "
          "| SDPA flash ms (err) | FA3 ms | Triton / FA3 | FA4 ms (err; first call) "
          "| FA4, 128-token pages | rel err |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {_prompts(r)} | {r['triton_ms']:.3f} | {r['tflops']:.0f} "
              f"| {r['floor_ms']:.3f} | {r['cudnn_ms']:.3f} ({r['cudnn_err']:.1e}; "
              f"{r['cudnn_first_ms']:.0f}) | {r['flash_ms']:.3f} ({r['flash_err']:.1e}) "
              f"| {r['fa3_ms']:.3f} | {r['triton_ms'] / r['fa3_ms']:.2f} "
              f"| {r['fa4_ms']:.3f} ({r['fa4_err']:.1e}; {r['fa4_first_ms']:.0f}) "
              f"| {r.get('fa4_page128_ms', float('nan')):.3f} | {r['err']:.1e} |")  # fmt: skip
    if sweep:
        print("\n| prompts | BLOCK_M, BLOCK_N, warps, stages | ms | rel err |\n|---|---|---:|---:|")
        for r in rows:
            print_sweep(_prompts(r), r["sweep"])
    print()


def print_sweep(label: str, results: dict) -> None:
    for cfg, res in results.items():
        ms = f"{res['ms']:.3f} | {res['err']:.1e}" if "ms" in res else f"{res['error']} |"
        print(f"| {label} | {cfg} | {ms} |")


def parse_sweep(arg: str | None) -> list[tuple[int, ...]]:
    """--sweep's configs: none, all of SWEEP, or 'BM,BN,warps,stages;...'."""
    if arg is None:
        return []
    if arg == "all":
        return SWEEP
    return [tuple(int(v) for v in cfg.split(",")) for cfg in arg.split(";")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows")
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        default=None,
        help="tile configs: all of SWEEP, or 'BM,BN,warps,stages;...'",
    )
    parser.add_argument("--fa3", action="store_true", help="vLLM's FlashAttention 3 beside")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sweep = parse_sweep(args.sweep)
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {props.name}, "
          f"{props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}\n")  # fmt: skip
    report = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        print(f"### {name}: {shape[0]} q heads, {shape[1]} KV heads, head_dim {shape[2]}\n")
        rep = report[name] = {}
        tiles = ua.default_tiles(shape[0] // shape[1], shape[2], 8000, 8000)
        print(f"Prefill, one layer (default tiles {tiles}):\n")
        rows = PREFILL_ROWS[:2] if args.quick else PREFILL_ROWS
        rep["prefill"] = [prefill_row(*row, shape, gen, sweep, args.fa3) for row in rows]
        print_prefill(rep["prefill"], sweep)
        torch.cuda.empty_cache()
        print("Decode, one layer (graph replay):\n")
        print("| batch | context | unified ms | paged_attention_decode ms | ratio | FA3 ms "
              "| KV floor ms | rel err |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        rep["decode"] = []
        for batch, context in QUICK_DECODE_ROWS if args.quick else DECODE_ROWS:
            r = decode_row(batch, context, shape, gen, args.fa3)
            rep["decode"].append(r)
            print(f"| {batch} | {context} | {r['unified_ms']:.4f} | {r['decode_ms']:.4f} "
                  f"| {r['ratio']:.2f} | {r['fa3_ms']:.4f} | {r['floor_ms']:.4f} "
                  f"| {r['err']:.1e} |", flush=True)  # fmt: skip
        print("\nMixed steps, one layer (graph replay):\n")
        print("| step | unified ms | one tiled launch ms | FA4 chunks + our decodes ms (err) "
              "| floor ms | rel err |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|")
        rep["mixed"] = [mixed_row(m, shape, gen, sweep) for m in MIXED_ROWS]
        for r in rep["mixed"]:
            print(f"| {r['name']} | {r['ms']:.3f} | {r['one_launch_ms']:.3f} "
                  f"| {r['fa4_ms']:.3f} ({r['fa4_err']:.1e}) "
                  f"| {r['floor_ms']:.3f} | {r['err']:.1e} |")  # fmt: skip
        if sweep:
            print("\n| step (its tiled launch alone) | BLOCK_M, BLOCK_N, warps, stages | ms "
                  "| rel err |\n|---|---|---:|---:|")  # fmt: skip
            for r in rep["mixed"]:
                print_sweep(r["name"] + f" (default {r['tiles']})", r["sweep"])
        print(flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
