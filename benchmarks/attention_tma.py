"""What TMA loads (and Triton's warp specialization) would give the prompt attention on K/V
that is contiguous, not paged: an upper bound before building that path into the engine.

The shipped tiled kernel (`kernels/unified_attention.py`) gathers every K/V tile through the
block table with pointer loads, and Triton 3.6's warp specialization does not apply to such a
loop on Hopper (`prefill_attention_loop_variants_2026-12-03_h200.md`). A chunk's own keys are
contiguous in the step's k and v (rotated in place by the rotary kernel before the cache
store), so a kernel could read those through TMA descriptors and only the cached context
through the table. This script measures the contiguous half alone: the same tile structure
(G query heads of a KV head folded into BLOCK_M rows, unmasked key tiles then causal ones), q
by pointers once per program, K and V tiles by `TensorDescriptor` loads, the key loop with or
without `warp_specialize`, for sequences of equal length with no cached context, against the
shipped kernel on a paged cache of the same K/V and vLLM's FA3 where vLLM is installed.
Llama-3.1-8B heads, bf16, one layer, GPU ms from CUDA-graph replay with L2 flushed.

    PYTHONPATH=src python3 benchmarks/attention_tma.py [--json PATH]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/attention_tma.py --check   # the tests'
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
import unified_attention as bench  # benchmarks/unified_attention.py: batches, timing, FA3
from triton.tools.tensor_descriptor import TensorDescriptor

from llm_inference.kernels import reference
from llm_inference.kernels import unified_attention as ua

ROWS = [(1, 8000), (4, 2000), (16, 512)]  # (sequences, tokens each)
TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 64, 4, 3)]


@triton.jit
def _tma_range(q, m_i, l_i, acc, k_desc, v_desc, tok0, col, q_pos, start, end, scale_log2,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([tok0 + n0, col])
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where((n0 + offs_n)[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([tok0 + n0, col])
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tma_kernel(q_ptr, k_desc, v_desc, out_ptr, scale_log2, seq_len, stride_qt, stride_qh,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV: tl.constexpr,
                WS: tl.constexpr):  # fmt: skip
    """One program per (q tile, sequence x KV head); sequences of `seq_len` tokens back to
    back, no cached context. K/V descriptors over [T, NUM_KV * HEAD_DIM]."""
    q0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q  # longest tiles first
    seq, kvh = tl.program_id(1) // NUM_KV, tl.program_id(1) % NUM_KV
    tok0 = seq * seq_len
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = q0 + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = q_row < seq_len
    tok = (tok0 + q_row).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (q0 + 1) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(q0 + BLOCK_Q, seq_len)
    col = kvh * HEAD_DIM
    m_i, l_i, acc = _tma_range(q, m_i, l_i, acc, k_desc, v_desc, tok0, col, q_row, 0,
                               full_end, scale_log2, BLOCK_N, False, WS)  # fmt: skip
    m_i, l_i, acc = _tma_range(q, m_i, l_i, acc, k_desc, v_desc, tok0, col, q_row, full_end,
                               causal_end, scale_log2, BLOCK_N, True, WS)  # fmt: skip
    result = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def tma_attention(q, k, v, num_seqs, scale, out, block_m, block_n, num_warps, num_stages,
                  ws=False):  # fmt: skip
    """Causal attention of `num_seqs` equal sequences back to back: q [T, Hq, D], k/v
    [T, Hkv, D] contiguous. Keys past a sequence's end are never read: its last key tile is
    padded by the descriptor (zeros) only when T is not a multiple of BLOCK_N."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    block_q = block_m // group
    seq_len = num_tokens // num_seqs
    k_desc = TensorDescriptor.from_tensor(
        k.view(num_tokens, num_kv * head_dim), [block_n, head_dim]
    )
    v_desc = TensorDescriptor.from_tensor(
        v.view(num_tokens, num_kv * head_dim), [block_n, head_dim]
    )
    grid = (triton.cdiv(seq_len, block_q), num_seqs * num_kv)
    _tma_kernel[grid](
        q, k_desc, v_desc, out, scale * 1.4426950408889634, seq_len, q.stride(0), q.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_N=block_n,
        NUM_KV=num_kv, WS=ws, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def paged(k, v, num_seqs, seq_len, gen, block_size=bench.BLOCK_SIZE):
    """The same K/V in a paged cache with a random block table (the shipped kernel's input)."""
    per = (seq_len + block_size - 1) // block_size
    perm = torch.randperm(num_seqs * per, generator=gen).to(k.device)
    table = perm.view(num_seqs, per).to(torch.int32)
    shape = (num_seqs * per, block_size, *k.shape[1:])
    k_cache, v_cache = k.new_zeros(shape), v.new_zeros(shape)
    pos = torch.arange(seq_len, device=k.device)
    for s in range(num_seqs):
        blocks, offs = table[s, pos // block_size].long(), pos % block_size
        k_cache[blocks, offs] = k[s * seq_len : (s + 1) * seq_len]
        v_cache[blocks, offs] = v[s * seq_len : (s + 1) * seq_len]
    cu = torch.arange(0, num_seqs + 1, device=k.device, dtype=torch.int32) * seq_len
    lens = torch.full((num_seqs,), seq_len, device=k.device, dtype=torch.int32)
    return k_cache, v_cache, table, cu, lens


def check() -> None:
    """The TMA kernel against the reference on tiny shapes (CPU, TRITON_INTERPRET=1), printing
    `RESULT <case> ok|FAIL` (tests/kernels/test_attention_benchmarks.py)."""
    gen = torch.Generator().manual_seed(0)
    for num_seqs, seq_len, block_n in [(1, 40, 16), (3, 32, 16), (2, 48, 32)]:
        q = torch.randn(num_seqs * seq_len, 4, 16, generator=gen)
        k, v = (torch.randn(num_seqs * seq_len, 2, 16, generator=gen) for _ in range(2))
        out = tma_attention(q, k, v, num_seqs, 0.25, torch.empty_like(q), 16, block_n, 4, 2)
        case = (q, *paged(k, v, num_seqs, seq_len, gen))
        err = (out - reference.unified_attention(*case, 0.25)).abs().max()
        ok = "ok" if err < 1e-4 else "FAIL"
        print(f"RESULT tma_{num_seqs}x{seq_len}_bn{block_n} {ok}", flush=True)


def time_row(num_seqs: int, seq_len: int, gen) -> list[dict]:
    """Every kernel and tile on one prompt row: FA3, the shipped kernel on the paged copy, the
    TMA kernel without and with warp specialization."""
    shape = bench.SHAPES["Llama-3.1-8B"]
    num_heads, num_kv, head_dim = shape
    scale, t = head_dim**-0.5, num_seqs * seq_len
    q = torch.randn(t, num_heads, head_dim, generator=gen).to("cuda", bench.DTYPE)
    k = torch.randn(t, num_kv, head_dim, generator=gen).to("cuda", bench.DTYPE)
    v = torch.randn(t, num_kv, head_dim, generator=gen).to("cuda", bench.DTYPE)
    case = (q, *paged(k, v, num_seqs, seq_len, gen))
    out = torch.empty_like(q)
    runs = {"FA3": None}
    for tile in TILES:
        runs[f"shipped {tile}"] = functools.partial(ua.launch, *case, scale, out, *tile)
        for ws in (False, True):
            name = f"TMA{' + warp_specialize' if ws else ''} {tile}"
            runs[name] = functools.partial(tma_attention, q, k, v, num_seqs, scale, out, *tile, ws)
    flops = bench.causal_flops(seq_len, 0, shape) * num_seqs
    rows = []
    for name, fn in runs.items():
        row = dict(prompts=f"{num_seqs} x {seq_len}", kernel=name)
        try:
            if fn is None:
                row.update(ms=bench.fa3_ms(case, seq_len, seq_len, scale), err=float("nan"))
            else:
                fn()
                row.update(ms=bench.graph_ms(fn), err=bench.rel_error(out, case, scale))
            print(f"| {row['prompts']} | {name} | {row['ms']:.3f} | {flops / row['ms'] / 1e9:.0f} "
                  f"| {row['err']:.1e} |", flush=True)  # fmt: skip
        except Exception as e:  # a variant Triton refuses: say so and go on
            row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
            print(f"| {row['prompts']} | {name} | error: {row['error'][-120:]} | | |", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="tiny shapes against the reference")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.check:
        return check()
    gen = torch.Generator().manual_seed(0)
    print("| prompts | kernel (BLOCK_M, BLOCK_N, warps, stages) | ms | TFLOP/s | rel err |")
    print("|---|---|---:|---:|---:|")
    report = []
    for num_seqs, seq_len in ROWS:
        report += time_row(num_seqs, seq_len, gen)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
