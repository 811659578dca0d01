"""Paged decode attention in Triton: one query token per sequence, K/V read through block tables.

Shapes (as in reference.py):
  q            [B, Hq, D]           any batch/head strides, last dim contiguous
  k/v cache    [N, BS, Hkv, D]      last dim contiguous; BS (block size) a power of two
  block_tables [B, max_blocks]      int32 or int64; entries past a sequence's length never read
  seq_lens     [B]                  int32 or int64, 1 <= seq_lens[i] <= max_blocks * BS

Work split: one program per (sequence, KV head, context split), on a grid of (KV head x split,
sequence): the programs of one sequence are dispatched together. With `seq_order` (a
permutation of the sequences, longest context first, which the engine builds on the host with
the step's other inputs) the grid's sequence axis goes through that order, so the longest
contexts start first and the short ones fill the SMs at the end of the launch (longest
processing time first): with contexts of mixed lengths the last programs of a launch are
short ones, not a long one running alone.
- Grouped-query: the G = Hq / Hkv query heads sharing a KV head form a [G, D] tile (padded to 16
  rows for the tensor cores), so each K/V tile is loaded once for the whole group and the scores
  are one small matrix product.
- Split-K: each sequence's context is cut into `num_splits` chunks of whole tiles, as even as
  its own length allows (ceil(tiles / num_splits) tiles each; trailing splits may get none), so
  a short context in a launch sized for long ones still spreads over the splits. Each
  program writes its normalized partial output and its log-sum-exp (base 2) to fp32 scratch,
  and the small `_merge_kernel` combines them with log-sum-exp weights. With
  FUSED_MERGE the last split of each (sequence, KV head) to finish, which it learns from an
  atomic counter, merges in the same launch instead (off: slower on the GPU). With one split
  the program writes the output itself.
- `num_splits` depends only on the batch size, the largest possible context (`max_seq_len`, a
  Python int that defaults to the block-table capacity), the number of SMs and the head shape,
  never on the values in `seq_lens`: no host synchronization, and a fixed grid for CUDA graphs.
  Splits that start past a sequence's length write log-sum-exp -inf and exit.
- Compiles: `num_splits` is not specialized (`do_not_specialize`), so what a launch compiles
  follows from whether it splits, the merge's tile (BLOCK_S, the split count rounded up to a
  power of two; the decode kernel's own only with the fused merge) and the order; see
  unified_attention.compile_keys, which an eager engine's start-up warm-up enumerates.
- With `cu_seqlens` (HAS_CU; unified_attention's decodes) sequence b reads q row cu[b] and
  writes that out row when it has exactly one query row (cu[b + 1] == cu[b] + 1), and does
  nothing otherwise (no rows, or a prompt chunk that the tiled kernel takes); without it row
  b, and the compiled kernel is the one above.
- An FP8 cache (reference.FP8; FP8_KV, a constexpr: other caches compile as before): K/V tiles
  are converted to q's dtype (exact: e4m3 fits in 16 bits) as they are loaded; k_scale is
  folded into the softmax scale and v_scale multiplies the normalized output, the same
  products as scaling every element (`kernel_scales`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llm_inference.kernels.device import num_sms
from llm_inference.kernels.pdl import launch_kwargs, wait_then_release
from llm_inference.kernels.reference import FP8

_LOG2E = 1.4426950408889634
WAVES = 4  # split until about this many programs per SM (4 fit at once: registers)
# With the programs dispatched longest context first (seq_order), splitting further pays: the
# short sequences' splits fill the launch's tail (benchmarks/DECISIONS.md).
ORDERED_WAVES = 8
MIN_CHUNK = 256  # fewest tokens worth a split of their own
MAX_SPLITS = 128
FUSED_MERGE = False  # True: merge in the last split's program instead of a second kernel


@triton.jit
def _merge_row(part_ptr, lse_ptr, row, num_splits, o_ptrs,
               BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """o = sum_s w_s * part[row, s] / sum_s w_s with w_s = 2^(lse_s - max lse).

    Splits with lse -inf saw no token and never wrote their partial (split 0 always sees one):
    both loads are issued at once and such rows are dropped with a select, not a mask, so no
    load waits for another. Loads bypass L1 (.cg): in the fused merge other programs of this
    launch wrote the partials.
    """
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"),
                  cache_modifier=".cg")  # fmt: skip
    p_ptrs = part_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    part = tl.load(p_ptrs, mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
    live = lse > float("-inf")
    w = tl.where(live, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part = tl.where(live[:, None], part, 0.0)
    result = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptrs + offs_d, result.to(o_ptrs.dtype.element_ty))


@triton.jit
def _attend(q, k_head, v_head, bt_row, start, end, scale_log2,
            stride_n, stride_t,
            BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Online softmax of q [BLOCK_G, D] over tokens [start, end): (max, sum, unnormalized acc),
    all float32 and log2-scaled. Token t lives in cache block bt_row[t // BLOCK_SIZE]."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < end
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        within = tok % BLOCK_SIZE
        rows = blk * stride_n + within * stride_t  # the same offsets in K and V
        k = tl.load(k_head + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, count_ptr, cu_ptr, order_ptr,
    scale_log2, v_scale,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,  # also V's: the launcher checks they are equal
    stride_btb,
    stride_ob, stride_oh,
    num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_CU: tl.constexpr, HAS_ORDER: tl.constexpr, FP8_KV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        wait_then_release()
    kvh = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    b = tl.program_id(1)
    if HAS_ORDER:
        b = tl.load(order_ptr + b).to(tl.int32)
    num_seqs = tl.num_programs(1)
    num_kv_heads = tl.num_programs(0) // num_splits
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    row = b  # the q/out row of sequence b
    if HAS_CU:  # unified_attention's decodes: row cu[b] of a sequence of one query row
        row = tl.load(cu_ptr + b).to(tl.int32)
        if tl.load(cu_ptr + b + 1) != row + 1:
            return
    # This sequence's own chunk: its tiles spread evenly over the splits.
    chunk = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    q_ptrs = q_ptr + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)

    m_i, l_i, acc = _attend(
        q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_kh, bt_ptr + b * stride_btb,
        start, end, scale_log2, stride_kn, stride_kt,
        BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip
    nonempty = l_i > 0.0
    result = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if FP8_KV:
        result = result * v_scale
    if not SPLIT:
        o_ptrs = out_ptr + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        o_ptrs += offs_d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # fp32 scratch: part [B, Hq, num_splits, D], then lse [B, Hq, num_splits].
        num_heads = num_kv_heads * GROUP
        rows = (b * num_heads + heads) * num_splits + split
        lse_ptr = part_ptr + num_seqs * num_heads * num_splits * HEAD_DIM
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + rows, lse, mask=g_mask)
        tl.store(
            part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], result, mask=g_mask[:, None]
        )
        if FUSED_MERGE:
            # The last split to finish for this (sequence, KV head) merges. The barrier orders
            # every thread's stores before the release; the acquire orders the merge's loads.
            tl.debug_barrier()
            counter = count_ptr + b * num_kv_heads + kvh
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                tl.debug_barrier()
                for g in tl.static_range(GROUP):
                    h = kvh * GROUP + g
                    o_ptrs = out_ptr + b * stride_ob + h * stride_oh
                    _merge_row(part_ptr, lse_ptr, b * num_heads + h, num_splits, o_ptrs,
                               BLOCK_S, HEAD_DIM)  # fmt: skip
                tl.store(counter, 0)  # ready for the next launch (and graph replay)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_ptr, out_ptr, cu_ptr, stride_ob, stride_oh, num_splits,
                  BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HAS_CU: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    if PDL:
        wait_then_release()
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b
    if HAS_CU:
        row = tl.load(cu_ptr + b).to(tl.int32)
        if tl.load(cu_ptr + b + 1) != row + 1:
            return
    lse_ptr = part_ptr + tl.num_programs(0) * tl.num_programs(1) * num_splits * HEAD_DIM
    o_ptrs = out_ptr + row.to(tl.int64) * stride_ob + h * stride_oh
    _merge_row(part_ptr, lse_ptr, b * tl.num_programs(1) + h, num_splits, o_ptrs,
               BLOCK_S, HEAD_DIM)  # fmt: skip


def default_block_n(head_dim: int, block_size: int) -> int:
    """Tokens per K/V tile: 16 KB of K per tile in 16-bit types, and whole cache blocks."""
    return max(8192 // head_dim, block_size, 16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1024)
def choose_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int,
    waves: int = 0, min_chunk: int = 0,
) -> int:  # fmt: skip
    """The number of splits, from sizes only: enough programs to fill every SM.

    Splits stop below `waves` (default WAVES) programs per SM, at `min_chunk` (default
    MIN_CHUNK) tokens per split of a `max_seq_len` context and at MAX_SPLITS; splits that would
    be empty for `max_seq_len` are dropped. (A shorter sequence spreads its own tiles over
    them: see the kernel.)
    """
    tiles = _cdiv(max(max_seq_len, 1), block_n)
    want = (waves or WAVES) * num_sms // (batch * num_kv_heads)  # 0 or 1: no split
    by_chunk = _cdiv(tiles * block_n, min_chunk or MIN_CHUNK)
    splits = max(1, min(want, by_chunk, MAX_SPLITS, tiles))
    return _cdiv(tiles, _cdiv(tiles, splits))


def kernel_scales(k_cache, scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The kernels' (scale_log2, v_scale): log2(e) * the softmax scale, times k_scale for an
    FP8 cache (q . (k * k_scale) = (q . k) * k_scale); v_scale, which only an FP8 cache reads."""
    return scale * _LOG2E * (k_scale if k_cache.dtype == FP8 else 1.0), v_scale


def check_cache(q, k_cache, v_cache) -> None:
    """The checks every paged-attention launcher shares: q [*, Hq, D] against the caches
    [N, BS, Hkv, D] (shapes, strides, GQA ratio, power-of-two sizes, dtypes: the caches q's
    or FP8)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        shapes = f"{tuple(q.shape)}, {tuple(k_cache.shape)}"
        raise ValueError(f"q must be [T, Hq, D] and caches [N, BS, Hkv, D]; got {shapes}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(f"cache shapes {k_cache.shape}/{v_cache.shape} do not fit q {q.shape}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k/v cache strides differ: {k_cache.stride()}, {v_cache.stride()}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two, got {block_size}")
    if k_cache.dtype not in (q.dtype, FP8) or v_cache.dtype != k_cache.dtype:
        got = f"{k_cache.dtype}/{v_cache.dtype}"
        raise ValueError(f"cache dtypes {got} must both be q's ({q.dtype}) or float8_e4m3fn")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")


def check_operands(q, k_cache, v_cache, out, **indices: torch.Tensor) -> None:
    """The index tensors int32 or int64; `out` None or q's shape and dtype; every operand on
    q's device and contiguous in its last dim."""
    for name, t in indices.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {out.shape} {out.dtype}")
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out, **indices)
    for name, t in named.items():
        if t is not None and (t.stride(-1) != 1 or t.device != q.device):
            raise ValueError(f"{name} must be on {q.device} and contiguous in its last dim")


def _check(q, k_cache, v_cache, block_tables, seq_lens, out) -> None:
    check_cache(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    check_operands(q, k_cache, v_cache, out, block_tables=block_tables, seq_lens=seq_lens)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton version of reference.paged_attention_decode.

    `max_seq_len` bounds seq_lens (default: the block-table capacity); it only sets the split
    count, so any bound that holds is correct, a tight one is faster. `pdl`: launch with
    programmatic dependent launch (kernels/pdl.py).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, out)
    block_size = k_cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    block_n = default_block_n(q.shape[2], block_size)
    splits = choose_splits(
        q.shape[0], k_cache.shape[2], max_seq_len, block_n, num_sms(q.device)
    )  # cached: the host cost of a call matters when decode runs eagerly
    return launch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, splits, block_n,
        k_scale=k_scale, v_scale=v_scale, pdl=pdl,
    )  # fmt: skip


def launch(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, block_n,
    num_warps: int = 4, num_stages: int = 3, fused_merge: bool | None = None,
    cu_seqlens: torch.Tensor | None = None, seq_order: torch.Tensor | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Run with an explicit split and tile configuration (tests and the benchmark sweep it).

    Any num_splits >= 1 is exact (each sequence divides its own tiles over them). With
    `cu_seqlens` ([B + 1], unified_attention's decodes) sequence b reads and writes row
    cu_seqlens[b] of q/out when it has exactly one query row, else nothing; q/out may then
    have any number of rows. Not with the fused merge. `seq_order` ([B] int32 or int64,
    a permutation of 0..B-1) is the order in which the sequences' programs are dispatched;
    any permutation gives the same result. `k_scale`, `v_scale`: an FP8 cache's scales.
    `pdl`: both kernels launch with programmatic dependent launch (kernels/pdl.py).
    """
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"need splits >= 1 and a power-of-two tile >= 16: {num_splits}, {block_n}")
    fused_merge = FUSED_MERGE if fused_merge is None else fused_merge
    if cu_seqlens is not None and fused_merge:
        raise ValueError("cu_seqlens does not work with the fused merge")
    if out is None:
        out = torch.empty_like(q)
    part = counts = out  # placeholders when unused
    if num_splits > 1:
        # One fp32 scratch: partial outputs [B, Hq, S, D], then log-sum-exps [B, Hq, S].
        rows = num_seqs * num_heads * num_splits
        part = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
        if fused_merge:
            counts = _counters(q.device, num_seqs * num_kv_heads)
    block_s = 1 << (num_splits - 1).bit_length()
    if seq_order is not None and (
        seq_order.shape != (num_seqs,) or seq_order.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"seq_order must be [{num_seqs}] int32 or int64, got {seq_order.shape}")
    _paged_decode_kernel[(num_kv_heads * num_splits, num_seqs)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part, counts,
        seq_lens if cu_seqlens is None else cu_seqlens,
        seq_lens if seq_order is None else seq_order,
        *kernel_scales(k_cache, scale, k_scale, v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits,
        GROUP=group, BLOCK_G=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=num_splits > 1, FUSED_MERGE=fused_merge, BLOCK_S=block_s if fused_merge else 1,
        HAS_CU=cu_seqlens is not None, HAS_ORDER=seq_order is not None,
        FP8_KV=k_cache.dtype == FP8, PDL=pdl, num_warps=num_warps,
        num_stages=num_stages, **launch_kwargs(pdl),
    )  # fmt: skip
    if num_splits > 1 and not fused_merge:
        _merge_kernel[(num_seqs, num_heads)](
            part, out, seq_lens if cu_seqlens is None else cu_seqlens,
            out.stride(0), out.stride(1), num_splits,
            BLOCK_S=block_s, HEAD_DIM=head_dim, HAS_CU=cu_seqlens is not None,
            PDL=pdl, num_warps=4 if head_dim >= 128 else 2, **launch_kwargs(pdl),
        )  # fmt: skip
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 split counters for the fused merge, one per (sequence, KV head).

    Each launch leaves them zero again. One buffer per device: launches on concurrent streams
    of one device must not use the fused merge. It is allocated (and grown) by an eager call:
    a graph capture must follow a warm-up call of the largest batch.
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run paged_attention_decode once before capturing a CUDA graph")
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
