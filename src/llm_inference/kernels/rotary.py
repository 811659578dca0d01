"""Rotary embedding (neox / rotate-half) in Triton, applied in place to q and k.

q [T, Hq, D] and k [T, Hkv, D] are usually strided views into one fused qkv tensor: last dim
contiguous, any head and token strides. cos_sin_cache [max_positions, D] float32 holds cos in the
first D/2 columns and sin in the last D/2 (llama3 frequency scaling is applied when the cache is
built, once). One program per token rotates all of its q and k heads.

`rotary_store_kv` also writes the token's rotated k and its v into the paged KV cache (the
store of kernels/kv_cache.py, FP8 caches included), in the same program: one launch per layer
instead of two, and k is not read back from memory to be stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_inference.kernels.kv_cache import _store_one, check_store_args, to_cache
from llm_inference.kernels.pdl import launch_kwargs, wait_then_release
from llm_inference.kernels.reference import FP8


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin rows ([1, BLOCK_HALF] float32) from the cache."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + offs, mask=offs < HALF, other=0.0)[None, :]
    sin = tl.load(cs_row + HALF + offs, mask=offs < HALF, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _rotate_heads(base, stride_h, cos, sin, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate one token's heads in place; returns the two rotated halves [BLOCK_H, BLOCK_HALF]
    as stored (in base's dtype), for a caller that writes them elsewhere too."""
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs[None, :] < HALF)
    ptrs = base + offs_h[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(base.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(base.dtype.element_ty)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, NUM_Q, BLOCK_Q, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, NUM_K, BLOCK_K, HALF, BLOCK_HALF)


@triton.jit
def _rotary_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, k_inv, v_inv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcn, stride_kcs, stride_kch, stride_vcn, stride_vcs, stride_vch,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8_KV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, NUM_Q, BLOCK_Q, HALF, BLOCK_HALF)
    # k is rotated in place and, unless the slot is -1, its rotated halves go to the cache.
    y1, y2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, NUM_K, BLOCK_K, HALF,
                           BLOCK_HALF)  # fmt: skip
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_K)
        offs = tl.arange(0, BLOCK_HALF)
        mask = (offs_h[:, None] < NUM_K) & (offs[None, :] < HALF)
        kc = kc_ptr + blk * stride_kcn + row * stride_kcs + offs_h[:, None] * stride_kch
        kc = kc + offs[None, :]
        tl.store(kc, to_cache(y1, k_inv, kc_ptr, FP8_KV), mask=mask)
        tl.store(kc + HALF, to_cache(y2, k_inv, kc_ptr, FP8_KV), mask=mask)
        v_dst = vc_ptr + blk * stride_vcn + row * stride_vcs
        _store_one(v_ptr + t * stride_vt, v_dst, stride_vh, stride_vch, v_inv,
                   NUM_K, HEAD_DIM, BLOCK_K, BLOCK_D, FP8_KV)  # fmt: skip


def _check_rotary_args(positions, q, k, cos_sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, Hq, D] and k [T, Hkv, D] expected, got {q.shape}, {k.shape}")
    num_tokens, _, head_dim = q.shape
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{num_tokens}], got {positions.shape}")
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}], got {cos_sin_cache.shape}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be float32 with contiguous rows")
    if q.dtype != k.dtype or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must share a dtype and be contiguous in their last dim")
    for name, t in (("positions", positions), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if positions.stride(0) != 1 and num_tokens > 1:
        raise ValueError("positions must be contiguous")


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.rotary_embedding: rotates q and k in place, returns them."""
    _check_rotary_args(positions, q, k, cos_sin_cache)
    num_tokens, _, head_dim = q.shape
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            NUM_Q=q.shape[1], NUM_K=k.shape[1],
            BLOCK_Q=triton.next_power_of_2(q.shape[1]), BLOCK_K=triton.next_power_of_2(k.shape[1]),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    return q, k


def rotary_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton version of reference.rotary_store_kv (one launch): q and k rotated in place, the
    rotated k and v written at their cache slots (slot -1 skipped); returns q. `pdl`: launch
    with programmatic dependent launch (kernels/pdl.py)."""
    _check_rotary_args(positions, q, k, cos_sin_cache)
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, _, head_dim = q.shape
    if num_tokens == 0:
        return q
    half = head_dim // 2
    _rotary_store_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q=q.shape[1], NUM_K=k.shape[1],
        BLOCK_Q=triton.next_power_of_2(q.shape[1]), BLOCK_K=triton.next_power_of_2(k.shape[1]),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_KV=k_cache.dtype == FP8, PDL=pdl,
        num_warps=4, **launch_kwargs(pdl),
    )  # fmt: skip
    return q
