"""FlashAttention 4 for a step's prompt chunks, where the flash-attn-4 package is installed.

Its CuTe DSL kernels (Hopper and Blackwell) have the structure our tiled Triton kernel cannot
express in Triton 3.6 (producer warps, TMA, two consumer warpgroups in ping-pong), and prompt
attention is where our kernel trails FlashAttention (benchmarks/DECISIONS.md). So on those GPUs
a step with prompt chunks sends them to FlashAttention's varlen call on the same paged cache,
and everything else stays ours: the decodes of every step (our decode kernel is at or under
FA3's time), FP8 caches, other GPUs, the CPU's interpreter and the reference path.

It takes head size 128 only (`HEAD_SIZES`: at 64 it trails our kernel, benchmarks/DECISIONS.md)
and the page sizes checked against the reference on a GPU, 16 and 32 (`BLOCK_SIZES`); other
head and page sizes keep the Triton kernel (`applies`).

In a mixed step FlashAttention computes only the chunks' rows: sequences of one query row get
`seqused_q` 0, and the decode kernel then writes their rows of the same output
(TritonOps.unified_attention). That is two launches where our tiled kernel makes one, which
pays only where the chunks hold enough work: steps of fewer than MIN_TOKENS tokens (a CUDA
graph's: its bucket's) keep our one launch (benchmarks/DECISIONS.md).
"""

from __future__ import annotations

import functools
import warnings

import torch

CACHE_DTYPES = (torch.float16, torch.bfloat16)
MIN_TOKENS = 2048  # steps of fewer tokens keep the tiled kernel (the module docstring)
HEAD_SIZES = (128,)  # at 64 it trails our tiled kernel (benchmarks/DECISIONS.md)
BLOCK_SIZES = (16, 32)  # the page sizes checked against the reference on a GPU (`applies`)


@functools.cache
def _varlen_func():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:  # not installed, or its CuTe DSL does not load here
        return None
    return flash_attn_varlen_func


def available(device: torch.device) -> bool:
    """Whether `device` runs FlashAttention 4 (CUDA, compute capability 9.x or 10.x, the
    package importable)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return False
    return _varlen_func() is not None


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether it takes this step: at least MIN_TOKENS tokens, the cache in the query's dtype
    (not FP8), a head size in HEAD_SIZES, a page size in BLOCK_SIZES, and a first small call of
    that layout ran here (`_runs`). BLOCK_SIZES are the page sizes whose output was checked
    against the reference on a GPU (at 128 it was NaN where unused cache rows hold NaN); other
    sizes keep the Triton kernel until checked."""
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    if q.shape[0] < MIN_TOKENS or head_dim not in HEAD_SIZES or block_size not in BLOCK_SIZES:
        return False
    if not (k_cache.dtype == q.dtype and q.dtype in CACHE_DTYPES):
        return False
    return _runs(q.device, q.dtype, head_dim, q.shape[1] // k_cache.shape[2], block_size)


@functools.cache
def _runs(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int, block_size: int
) -> bool:
    """Whether a 16-token prompt of this layout compiles and runs (the CuTe DSL compiles at the
    first call: the engine's memory profile makes it, before any graph capture; its paths
    differ by block size). Where it fails, a warning, and the prompt chunks keep the Triton
    kernel."""
    blocks = -(-16 // block_size)
    q = torch.zeros(16, group, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(blocks, block_size, 1, head_dim, dtype=dtype, device=device)
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    try:
        prompt_attention(q, cache, cache, table, cu, cu[1:], 1.0, 16, 16)
        torch.cuda.synchronize(device)
    except Exception as e:  # its compiler or runtime missing a piece here
        warnings.warn(f"FlashAttention 4 does not run here ({type(e).__name__}: {e}): prompt "
                      f"chunks take the Triton kernel", stacklevel=2)  # fmt: skip
        return False
    return True


def prompt_rows(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[S] int32: each sequence's query rows for FlashAttention, 0 for a decode's one row (and
    for padding sequences, which own none)."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    return torch.where(q_lens > 1, q_lens, 0)


def prompt_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Causal attention of the prompt chunks' rows of `q` [T, Hq, D] over the paged cache
    (`k_cache` [num_blocks, block_size, Hkv, D], the layout FlashAttention pages), as
    reference.unified_attention computes them; the other rows of the result are left for the
    decode kernel to write. `max_query_len` and `max_seq_len` bound the step (Python ints: a
    CUDA graph's replays must stay within them)."""
    out, _ = _varlen_func()(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_q=prompt_rows(cu_seqlens_q),
        max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len, seqused_k=seq_lens,
        page_table=block_table, softmax_scale=scale, causal=True,
    )  # fmt: skip
    return out
