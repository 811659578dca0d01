"""Unified paged attention in Triton: prefill chunks and decodes of a flat batch in one launch.

Shapes (as in reference.unified_attention):
  q            [T, Hq, D]         rows of the step, sequences back to back; last dim contiguous
  k/v cache    [N, BS, Hkv, D]    the step's new K/V already written; BS a power of two
  block_table  [S, max_blocks]    int32 or int64; entries past a sequence's length never read
  cu_seqlens_q [S + 1]            int32 or int64; sequence s owns q rows cu[s]:cu[s + 1] (L_s)
  seq_lens     [S]                int32 or int64; cached tokens of s, its L_s new ones included
Query row i of sequence s is at position c_s + i (c_s = seq_lens[s] - L_s) and attends to cache
positions [0, c_s + i].

Dispatch (host side, from Python ints only): the sequences of one query row (decodes) take
paged_attention's split-K decode kernel with its cu_seqlens row mapping, which reads their
context at the memory's pace and spreads a long one over splits; when `max_query_len > 1` the
tiled kernel below (FlashAttention-2 style, no split-K) takes the other sequences in a second
launch. (In the tiled kernel a decode would fill G of the tile's BLOCK_M rows: its tensor work
is BLOCK_M / G times the useful, which makes a mixed step's decodes compute-bound.)

Work split of the tiled kernel: one program per (q tile, KV head). A q tile is BLOCK_Q
consecutive query rows of one sequence times the G = Hq / Hkv heads of the KV head, folded into
the M dimension of a [BLOCK_M, D] tile (row m: query row m // G, head m % G; BLOCK_Q =
BLOCK_M // G, rows m >= BLOCK_Q * G idle), so K/V tiles of BLOCK_N tokens are loaded once per
group and scores are one tl.dot. Keys visible to the tile's first row run unmasked; the
remaining up to its last row get the causal mask; later keys are never loaded.
Sequence s owns q tiles cu[s] // BLOCK_Q + s ... (at least ceil(L_s / BLOCK_Q) of them), so
T // BLOCK_Q + S programs per KV head cover every sequence; a program finds its sequence by
binary search over cu and exits when its tile is past the sequence's rows. The grid depends on
T, S and max_query_len (Python ints), never on tensor contents: no host sync, and a launch can
be captured in a CUDA graph and replayed with other cu_seqlens_q / seq_lens / block tables.
Rows past cu[S] (padding) and sequences with L_s = 0 are never read or written; with
SKIP_DECODES neither are sequences with L_s = 1 (the decode kernel's).
An FP8 cache (FP8_KV, a constexpr) is read as in paged_attention: tiles converted to q's dtype,
k_scale folded into the softmax scale, v_scale applied to the normalized output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels.device import num_sms
from llm_inference.kernels.reference import FP8

# From this many sequences, decode steps given a `seq_order` dispatch their programs in it
# (longest context first): with mixed lengths the launch then ends on short programs, not on a
# long one alone. Below it the extra dependent load per program costs more than it balances,
# and the order is ignored.
ORDER_MIN_SEQS = 32


@triton.jit
def _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first q tile, cu[s] // BLOCK_Q + s, is <= pid."""
    lo = pid * 0
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid)
    return lo


@triton.jit
def _attend_range(q, m_i, l_i, acc, k_head, v_head, bt_row, q_pos, start, end, scale_log2,
                  stride_n, stride_t, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Online softmax (log2-scaled, float32) of q [BLOCK_M, D] over keys [start, end), updating
    (m_i, l_i, acc). MASKED: keys past `end` and past each row's q_pos are hidden; otherwise
    every key in the range is valid and visible to every row. Key t lives in cache block
    bt_row[t // BLOCK_SIZE]."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        key = n0 + offs_n
        if MASKED:
            valid = key < end
            blk = tl.load(bt_row + key // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + key // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_n + (key % BLOCK_SIZE) * stride_t  # the same offsets in K and V
        if MASKED:
            k = tl.load(k_head + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_head + rows[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if MASKED:
            s = tl.where(key[None, :] <= q_pos[:, None], s, float("-inf"))
        # The scale goes in after the max (it is positive) and with the subtraction, one FMA.
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_head + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        else:
            v = tl.load(v_head + rows[:, None] + offs_d[None, :])
        # The dot accumulates into the rescaled acc itself (no separate add of a tile).
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


# num_seqs changes from step to step: specialized (== 1, divisible by 16), an eager step's
# count would compile a variant the captured graphs never needed, in the middle of a run.
@triton.jit(do_not_specialize=["num_seqs"])
def _unified_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr,
    scale_log2, v_scale, num_seqs,
    stride_qt, stride_qh,
    stride_kn, stride_kt, stride_kh,  # also V's: the launcher checks they are equal
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8_KV: tl.constexpr, SKIP_DECODES: tl.constexpr,
):  # fmt: skip
    # Reversed: a sequence's last tiles, with the most keys, start first (shorter tail).
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_ptr + seq + 1).to(tl.int32) - q_begin
    q0 = (pid - q_begin // BLOCK_Q - seq) * BLOCK_Q  # first query row of this tile
    if q0 >= q_len or (SKIP_DECODES and q_len == 1):
        return
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = q0 + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_row < q_len)
    tok = (q_begin + q_row).to(tl.int64)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    q_pos = context + q_row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_head, v_head = k_ptr + kvh * stride_kh, v_ptr + kvh * stride_kh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    # Keys [0, context + q0] are visible to every row of the tile: whole tiles of them unmasked.
    full_end = (context + q0 + 1) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(context + q0 + BLOCK_Q, seq_len)
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, k_head, v_head, bt_row, q_pos, 0, full_end, scale_log2,
        stride_kn, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
    )  # fmt: skip
    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, k_head, v_head, bt_row, q_pos, full_end, causal_end, scale_log2,
        stride_kn, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
    )  # fmt: skip
    result = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    if FP8_KV:
        result = result * v_scale
    o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


LONG_QUERY = 4096  # from this max_query_len on, the long-prefill tile (above the fine graph ladder)
# head_dim 128: from this many tokens in a step on, its prompt rows fill the SMs with 256-row
# tiles (Llama-3.1-8B's heads: 256 programs), and the long tile is the faster one.
LONG_TILE_TOKENS = 2048


def default_tiles(
    group: int, head_dim: int, max_query_len: int, num_tokens: int
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the tiled kernel for a step of
    `num_tokens` tokens whose longest query is `max_query_len`.

    128 rows x 64 keys for prefill (8 warps at head_dim 64, else 4); for short queries (mixed
    steps of small chunks) M shrinks to the rows a sequence can fill, max_query_len x G, at
    least 16 (tensor cores). The long-prefill tiles: 128 rows x 128 keys, 4 warps at head_dim
    64, from a query of LONG_QUERY tokens; 256 rows x 64 keys, 8 warps at head_dim 128, from
    LONG_TILE_TOKENS tokens in the step where a sequence fills 256 rows (in fewer tokens its
    fewer programs leave SMs idle). Measured with a mixed step's decodes in the decode kernel
    (benchmarks/DECISIONS.md, "Attention tiles by the step's size")."""
    if max_query_len >= LONG_QUERY and head_dim == 64:
        return 128, 128, 4, 3
    if head_dim == 128 and num_tokens >= LONG_TILE_TOKENS and max_query_len * group >= 256:
        return 256, 64, 8, 3
    block_m = 128 if head_dim <= 128 else 64
    block_m = max(min(block_m, _pow2_at_least(max_query_len * group)), 16, _pow2_at_least(group))
    num_warps = 8 if block_m >= 128 and head_dim == 64 else 4
    return block_m, 64, num_warps, 3 if head_dim <= 128 else 2


def _check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out) -> None:
    pa.check_cache(q, k_cache, v_cache)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [S, max_blocks], got {tuple(block_table.shape)}")
    num_seqs = block_table.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or seq_lens.shape != (num_seqs,):
        got = f"{tuple(cu_seqlens_q.shape)} and {tuple(seq_lens.shape)}"
        raise ValueError(f"cu_seqlens_q must be [{num_seqs + 1}] and seq_lens [{num_seqs}]: {got}")
    pa.check_operands(
        q, k_cache, v_cache, out,
        block_table=block_table, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
    )  # fmt: skip


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    seq_order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton version of reference.unified_attention: the decode kernel for the sequences of
    one query row (and its merge when it splits), then the tiled kernel for the others when
    `max_query_len` > 1.

    `max_query_len` bounds the query lengths (default T); exactly 1 launches the decode kernel
    only. `max_seq_len` bounds seq_lens (default: the block-table capacity) and only sets the
    decode split count. Any bounds that hold are correct; tight ones are faster. `seq_order`
    (a permutation of the sequences, longest context first) orders the decode kernel's
    programs in decode-only steps of ORDER_MIN_SEQS sequences or more; it changes no result.
    `k_scale`, `v_scale`: an FP8 cache's scales. `pdl`: the decode kernels launch with
    programmatic dependent launch (kernels/pdl.py).
    """
    _check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out)
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_seqs = q.shape[0], block_table.shape[0]
    max_query_len = num_tokens if max_query_len is None else min(max_query_len, num_tokens)
    if num_seqs == 0 or max_query_len < 1:
        return out
    head_dim, block_size, num_kv_heads = q.shape[2], k_cache.shape[1], k_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * block_size
    if not ordered(num_seqs, max_query_len):
        seq_order = None
    launches = plan(
        num_seqs, num_kv_heads, q.shape[1] // num_kv_heads, head_dim, block_size,
        max_query_len, max_seq_len, num_sms(q.device), seq_order is not None, num_tokens,
    )  # fmt: skip
    _, splits, block_n = launches[0]
    pa.launch(
        q, k_cache, v_cache, block_table, seq_lens, scale, out, splits, block_n,
        fused_merge=False, cu_seqlens=cu_seqlens_q, seq_order=seq_order,
        k_scale=k_scale, v_scale=v_scale, pdl=pdl,
    )  # fmt: skip
    if max_query_len > 1:  # the prompt chunks
        _, *tiles = launches[1]
        launch(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out, *tiles,
            k_scale=k_scale, v_scale=v_scale, skip_decodes=True,
        )  # fmt: skip
    return out


def ordered(num_seqs: int, max_query_len: int) -> bool:
    """Whether a step of these sizes dispatches its decode programs in a given `seq_order`."""
    return max_query_len == 1 and num_seqs >= ORDER_MIN_SEQS


def plan(
    num_seqs: int, num_kv_heads: int, group: int, head_dim: int, block_size: int,
    max_query_len: int, max_seq_len: int, num_sms: int, ordered: bool, num_tokens: int,
) -> tuple:  # fmt: skip
    """The launches `unified_attention` makes for a step of `num_tokens` tokens, from sizes
    only: ("decode", splits, BLOCK_N) (`ordered`: with a dispatch order), then for
    max_query_len > 1 ("tiled", *default_tiles)."""
    block_n = pa.default_block_n(head_dim, block_size)
    waves = pa.ORDERED_WAVES if ordered else 0  # 0: the default
    splits = pa.choose_splits(num_seqs, num_kv_heads, max_seq_len, block_n, num_sms, waves)
    decode = ("decode", splits, block_n)
    if max_query_len == 1:
        return (decode,)
    return decode, ("tiled", *default_tiles(group, head_dim, max_query_len, num_tokens))


def compile_keys(launch_plan: tuple, ordered: bool) -> tuple:
    """What of a `plan` selects the compiled kernels (besides the model's fixed shapes, dtypes
    and strides), one key per launch: launches with equal keys run kernels compiled once. The
    decode kernels' split count is not specialized; whether they split, the merge's tile and
    the order are."""
    keys = []
    for kind, *config in launch_plan:
        if kind == "decode":
            splits = config[0]
            keys.append((kind, splits > 1, 1 << (splits - 1).bit_length(), ordered))
        else:
            keys.append((kind, *config))
    return tuple(keys)


def launch(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, out,
    block_m: int, block_n: int, num_warps: int = 4, num_stages: int = 3,
    k_scale: float = 1.0, v_scale: float = 1.0, skip_decodes: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The tiled kernel with an explicit tile configuration (tests and the benchmark sweep it);
    any query lengths. BLOCK_M >= G and both tiles powers of two >= 16. `k_scale`, `v_scale`:
    an FP8 cache's scales. `skip_decodes`: sequences of one query row are left to the decode
    kernel."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = block_table.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if (
        block_m < max(16, group)
        or block_m & (block_m - 1)
        or block_n < 16
        or block_n & (block_n - 1)
    ):
        raise ValueError(f"need power-of-two tiles >= 16 and BLOCK_M >= G: {block_m}, {block_n}")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_kernel[grid](
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out,
        *pa.kernel_scales(k_cache, scale, k_scale, v_scale), num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, FP8_KV=k_cache.dtype == FP8,
        SKIP_DECODES=skip_decodes, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
