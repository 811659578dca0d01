"""KV-cache store in Triton: write each token's k/v [Hkv, D] at its flat slot; slot -1 skipped.

k, v [T, Hkv, D] (often strided views into the fused qkv tensor); caches [N, BS, Hkv, D].
Slot s is cache block s // BS, row s % BS. One program per token. An FP8 cache (FP8_KV, a
constexpr: other caches compile as before) stores x * (1 / scale) saturated to +-448, as
reference.to_cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_inference.kernels.reference import FP8, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # kernels read globals only as constexpr


@triton.jit
def to_cache(x, inv_scale, cache_ptr, FP8_KV: tl.constexpr):
    """x as the cache at `cache_ptr` holds it (reference.to_cache)."""
    if FP8_KV:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -_FP8_MAX, _FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_one(src, dst, stride_sh, stride_dh, inv_scale, NUM_KV: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               FP8_KV: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV) & (offs_d < HEAD_DIM)
    x = tl.load(src + offs_h * stride_sh + offs_d, mask=mask)
    tl.store(dst + offs_h * stride_dh + offs_d, to_cache(x, inv_scale, dst, FP8_KV), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_inv, v_inv,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcn, stride_kcs, stride_kch, stride_vcn, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        k_dst = kc_ptr + blk * stride_kcn + row * stride_kcs
        v_dst = vc_ptr + blk * stride_vcn + row * stride_vcs
        _store_one(k_ptr + t * stride_kt, k_dst, stride_kh, stride_kch, k_inv,
                   NUM_KV, HEAD_DIM, BLOCK_H, BLOCK_D, FP8_KV)  # fmt: skip
        _store_one(v_ptr + t * stride_vt, v_dst, stride_vh, stride_vch, v_inv,
                   NUM_KV, HEAD_DIM, BLOCK_H, BLOCK_D, FP8_KV)  # fmt: skip


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of reference.store_kv_cache."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV=num_kv, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_KV=k_cache.dtype == FP8, num_warps=4,
    )  # fmt: skip


def check_store_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The checks of store_kv_cache's arguments (shared with rotary_store_kv)."""
    if k.dim() != 3 or v.shape != k.shape or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        shapes = [tuple(t.shape) for t in (k, v, k_cache, v_cache)]
        raise ValueError(f"k/v [T, Hkv, D] and caches [N, BS, Hkv, D] expected, got {shapes}")
    num_tokens, num_kv, head_dim = k.shape
    if tuple(k_cache.shape[2:]) != (num_kv, head_dim):
        raise ValueError(f"cache heads {tuple(k_cache.shape[2:])} != k heads {(num_kv, head_dim)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        got = f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        raise ValueError(f"slot_mapping must be int32/int64 [{num_tokens}], got {got}")
    if k_cache.dtype != v_cache.dtype or v.dtype != k.dtype:
        got = f"k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
        raise ValueError(f"k and v, and the two caches, must share a dtype: {got}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
        if t.device != slot_mapping.device:
            raise ValueError(f"{name} is on {t.device}, slot_mapping on {slot_mapping.device}")
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")
