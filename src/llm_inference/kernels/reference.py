"""Pure-PyTorch reference implementations of every kernel.

These run on any device, define the semantics the Triton kernels must match, and are what the
engine uses on CPU. Shapes:
  q:            [num_seqs, num_heads, head_dim]
  k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables: [num_seqs, max_blocks_per_seq] int32 (entries past a sequence's length unused)
  seq_lens:     [num_seqs] int32, tokens in the cache for each sequence (>= 1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
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
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
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


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v [num_tokens, num_kv_heads, head_dim] at flat cache slots; slot -1 is skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = k[valid].to(k_cache.dtype)
    v_flat[slots] = v[valid].to(v_cache.dtype)


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
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] holding gate then up: silu(gate) * up -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)
