"""Pure-PyTorch reference implementations of every kernel, and `ReferenceOps`, the ops object
over them.

These run on any device, define the semantics the Triton kernels must match, and are what the
engine uses on CPU. Shapes:
  q:            [num_seqs, num_heads, head_dim]
  k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables: [num_seqs, max_blocks_per_seq] int32 (entries past a sequence's length unused)
  seq_lens:     [num_seqs] int32, tokens in the cache for each sequence (>= 1)
unified_attention takes q [num_tokens, num_heads, head_dim] for a mixed batch and cu_seqlens_q.

A cache is in the model's dtype, or FP8 (float8_e4m3fn, kv_cache_dtype="fp8") with one scale
per layer for K and one for V (`k_scale`, `v_scale`; ignored by other caches): the cache holds
x / scale saturated to e4m3 (`to_cache`) and is read as its value times the scale
(`from_cache`), as vLLM's FP8 KV cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn  # the FP8 KV cache's dtype
FP8_MAX = torch.finfo(FP8).max  # 448: larger magnitudes saturate to it
# Smallest row maximum scaled: an all-zero row gets a tiny scale, not a division by zero.
MIN_AMAX = 1e-12


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it: FP8 holds x / scale (computed in float32 as
    x * (1 / scale), as the Triton store) clamped to +-448, then rounded to nearest even;
    any other cache x itself."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows as float32: an FP8 cache's values times its scale."""
    return x.float() * scale if x.dtype == FP8 else x.float()


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
) -> torch.Tensor:
    """One query token per sequence attending to all `seq_lens[i]` cached tokens.

    `max_seq_len` is a hint (an upper bound of `seq_lens`) that the Triton kernel uses to size
    its split-K grid without a host sync; the reference ignores it."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max().item())
    max_blocks = (max_len + block_size - 1) // block_size
    # Gather every sequence's K/V through its block table: [B, max_len, Hkv, D].
    blocks = block_tables[:, :max_blocks].long()
    k = k_cache[blocks].flatten(1, 2)[:, :max_len]
    v = v_cache[blocks].flatten(1, 2)[:, :max_len]
    k = from_cache(k, k_scale).repeat_interleave(group, dim=2)
    v = from_cache(v, v_scale).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    pos = torch.arange(max_len, device=q.device)
    mask = pos[None, :] >= seq_lens[:, None].to(q.device)
    scores.masked_fill_(mask[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    result = torch.einsum("bht,bthd->bhd", probs, v).to(q.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


SCORE_BUDGET = 1 << 24  # float32 scores per chunk of query rows in unified_attention (64 MB)


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
) -> torch.Tensor:
    """Causal attention for a flat batch of prefill chunks and decodes over the paged cache.

    q [T, Hq, D] holds the sequences' query rows back to back: sequence s owns rows
    cu_seqlens_q[s]:cu_seqlens_q[s + 1] (L of them, possibly none) and has seq_lens[s] tokens in
    the cache, its L new ones included, so row i sits at position c + i with
    c = seq_lens[s] - L and attends to cache positions [0, c + i]. Rows past cu_seqlens_q[-1]
    are padding: left as they are in `out` (zeros in a new result). `max_query_len` and
    `max_seq_len` (bounds) and `seq_order` (the order of the decode programs) are hints for
    the Triton kernel; ignored here.

    One sequence at a time (no padding to the longest), K/V gathered once through its block
    table, float32, query rows in chunks so that even materialized scores stay near
    SCORE_BUDGET floats, each chunk reading only the keys its last row can see. Sequences of
    at least FUSED_MIN_ROWS query rows go through PyTorch's fused attention, the others
    (decodes) through a grouped einsum that copies no K/V.
    """
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    result = torch.zeros_like(q) if out is None else out
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, n in enumerate(lens):
        begin, end = cu[s], cu[s + 1]
        if end == begin:
            continue
        blocks = block_table[s, : (n + block_size - 1) // block_size].long()
        k = from_cache(k_cache[blocks].flatten(0, 1)[:n], k_scale)  # [n, Hkv, D]
        v = from_cache(v_cache[blocks].flatten(0, 1)[:n], v_scale)
        context = n - (end - begin)
        fused = end - begin >= FUSED_MIN_ROWS
        if fused:
            attend, k, v = (
                _attend_fused,
                _per_query_head(k, num_heads),
                _per_query_head(v, num_heads),
            )
        else:
            attend = _attend_grouped
        # Chunks of rows keep scores (or a mask) near SCORE_BUDGET; a whole prompt through the
        # fused kernel needs neither.
        step = end - begin if fused and context == 0 else max(1, SCORE_BUDGET // (num_heads * n))
        for r0 in range(begin, end, step):
            r1 = min(r0 + step, end)
            rows = attend(q[r0:r1].float(), k, v, context + r0 - begin, scale)
            result[r0:r1] = rows.to(result.dtype)
    return result


FUSED_MIN_ROWS = 64  # query rows from which a sequence goes through PyTorch's fused attention


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float):
    """Rows q [l, Hq, D] at positions start.. over k/v [>= start + l, Hkv, D]: the G query
    heads of a KV head as one reshaped group, no copy of K/V (decodes, short chunks)."""
    num_rows, num_heads, head_dim = q.shape
    seen, num_kv_heads = start + num_rows, k.shape[1]
    qs = q.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim) * scale
    scores = torch.einsum("lhgd,nhd->hgln", qs, k[:seen])
    own = torch.arange(num_rows, device=q.device)  # only the rows' own keys hide from some
    scores[..., start:].masked_fill_(own[None, :] > own[:, None], -math.inf)
    rows = torch.einsum("hgln,nhd->lhgd", scores.softmax(dim=-1), v[:seen])
    return rows.reshape(num_rows, num_heads, head_dim)


def _per_query_head(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[n, Hkv, D] -> [1, Hq, n, D], each KV head repeated for its query heads."""
    return x.transpose(0, 1).repeat_interleave(num_heads // x.shape[1], 0)[None]


def _attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float):
    """The same through F.scaled_dot_product_attention, k/v [1, Hq, n, D] from
    `_per_query_head`: on 4-D inputs with K/V per query head PyTorch's fused CPU kernel runs
    (faster than the einsum path on long prompts: benchmarks/DECISIONS.md); grouped or 3-D
    inputs fall back to its slow math path."""
    num_rows = q.shape[0]
    seen = start + num_rows
    qs, ks, vs = q.transpose(0, 1)[None], k[:, :, :seen], v[:, :, :seen]
    if start == 0:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    else:
        positions = start + torch.arange(num_rows, device=q.device)
        visible = torch.arange(seen, device=q.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v [num_tokens, num_kv_heads, head_dim] at flat cache slots (`to_cache`); slot -1
    is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = to_cache(k[valid], k_cache.dtype, k_scale)
    v_flat[slots] = to_cache(v[valid], v_cache.dtype, v_scale)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, computed in float32.

    With `residual`, first `residual = x + residual`, then normalize it; returns
    (normed, new_residual), as the fused residual-add kernel does.
    """
    normed, residual = _rms_norm_float(x, weight, eps, residual)
    out = normed.to(x.dtype)
    return out if residual is None else (out, residual)


def _rms_norm_float(x, weight, eps, residual):
    """rms_norm's normalized rows in float32, and the new residual (None without one)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float(), residual


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE applied in place to q [T, Hq, D] and k [T, Hkv, D].

    `cos_sin_cache` is [max_positions, D] float32: cos in the first D/2 columns, sin in the last.
    """
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for t in (q, k):
        x1, x2 = t.float().chunk(2, dim=-1)
        t.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(t.dtype))
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
) -> torch.Tensor:
    """`rotary_embedding` of q and k (in place), then `store_kv_cache` of the rotated k and v;
    returns q. (The Triton version does both in one launch.)"""
    rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] holding gate then up: silu(gate) * up -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def quantize_rows(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] as FP8 and its float32 scales [R, 1] (x ~ q * scale): each row's largest
    magnitude maps to FP8_MAX, or `scale` (a static scalar) is used and what exceeds the range
    saturates. Computed in float32, as vLLM's quantization kernels (layers/fp8.py's
    activations, and its weights at load)."""
    x = x.float()
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
        # Divided by a tensor: a Python number would make CUDA multiply by its reciprocal.
        scale = amax / torch.full_like(amax, FP8_MAX)
    else:
        scale = scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul` then `quantize_rows` per token in one op, the product kept in float32
    between (not rounded to x's dtype): x [T, 2*I] -> (FP8 [T, I], float32 scales [T, 1]),
    the next FP8 layer's input (layers/fp8.py)."""
    gate, up = x.chunk(2, dim=-1)
    return quantize_rows(F.silu(gate.float()) * up.float())


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_norm` then `quantize_rows` per token in one op, the normalized rows kept in
    float32 between: x [T, H] -> (FP8 [T, H], float32 scales [T, 1], the new residual or None),
    the next FP8 layer's input (layers/fp8.py)."""
    normed, residual = _rms_norm_float(x, weight, eps, residual)
    return *quantize_rows(normed), residual


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] (nn.Linear's layout, no bias)."""
    return F.linear(x, weight)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(linear(x, weight))`, weight [2I, K] holding gate then up -> [T, I]."""
    return silu_and_mul(F.linear(x, weight))


class ReferenceOps:
    """The KernelOps of this module (kernels/__init__.py): no fused sampler, nothing to warm
    up, no other choice to make."""

    fused_sampler = False
    store_kv_cache = staticmethod(store_kv_cache)
    rms_norm = staticmethod(rms_norm)
    rotary_embedding = staticmethod(rotary_embedding)
    silu_and_mul = staticmethod(silu_and_mul)
    quantize_rows = staticmethod(quantize_rows)
    silu_and_mul_quant = staticmethod(silu_and_mul_quant)
    rms_norm_quant = staticmethod(rms_norm_quant)
    rotary_store_kv = staticmethod(rotary_store_kv)
    linear = staticmethod(linear)
    gate_up_silu = staticmethod(gate_up_silu)
    unified_attention = staticmethod(unified_attention)

    def skinny_applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """False: no skinny GEMM here."""
        return False

    def warm_up_shapes(
        self, num_kv_heads: int, group: int, head_dim: int, block_size: int,
        max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
    ) -> list:  # fmt: skip
        """None: these kernels compile nothing."""
        return []
