"""Attention over a flat batch of tokens from several sequences, with a paged KV cache.

`AttentionMetadata` describes one step and is built once by the model runner (or by
`AttentionMetadata.dense` when there is no cache yet). Tokens of a sequence are contiguous in
the flat batch. A sequence is either
  - a decode: one new token at position `seq_len - 1`, attending to all `seq_len` cached
    tokens through paged decode attention; or
  - a prefill chunk: `query_len` new tokens at positions `[start, start + query_len)`,
    attending causally to every earlier token (the cached `start` tokens and each other)
    with SDPA.
Each layer first writes the new tokens' K/V into its cache at `slot_mapping`, then attends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSeq:
    token_start: int  # index of the first token of this sequence in the flat batch
    query_len: int
    start_position: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None  # [num_blocks] int32; None when there is no cache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [T] int64, -1 for padding; None: no cache
    prefills: list[PrefillSeq] = field(default_factory=list)
    # Decode sequences: their token indices in the flat batch, block tables, lengths.
    decode_indices: torch.Tensor | None = None  # [Bd] int64; None when no decodes
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32
    decode_max_seq_len: int = 0
    all_decode: bool = False  # every token is a decode, in order: no gather/scatter needed

    @classmethod
    def dense(cls, seq_lens: list[int]) -> AttentionMetadata:
        """No KV cache: each sequence is a whole prompt attending causally to itself."""
        prefills, start = [], 0
        for n in seq_lens:
            prefills.append(PrefillSeq(start, n, 0, None))
            start += n
        return cls(slot_mapping=None, prefills=prefills)


class Attention(nn.Module):
    """Grouped-query attention core: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops: ModuleType
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D], set by runner
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        if md.slot_mapping is not None:
            self.ops.store_kv_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        if md.all_decode:
            return self._decode(q, md)
        out = torch.empty_like(q)
        for p in md.prefills:
            sl = slice(p.token_start, p.token_start + p.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], p)
        if md.decode_indices is not None:
            out[md.decode_indices] = self._decode(q[md.decode_indices], md)
        return out

    def _decode(self, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_attention_decode(
            q,
            self.k_cache,
            self.v_cache,
            md.decode_block_tables,
            md.decode_seq_lens,
            self.scale,
            max_seq_len=md.decode_max_seq_len or None,
        )

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillSeq
    ) -> torch.Tensor:
        mask = None
        if p.start_position > 0:
            # Earlier tokens come from the cache: read positions [0, start + query_len).
            total = p.start_position + p.query_len
            k, v = self._gather_cache(p.block_table, total)
            qpos = torch.arange(p.start_position, total, device=q.device)
            mask = qpos[:, None] >= torch.arange(total, device=q.device)[None, :]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        # SDPA wants [heads, tokens, head_dim].
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return out.transpose(0, 1)

    def _gather_cache(self, block_table: torch.Tensor, total: int):
        block_size = self.k_cache.shape[1]
        blocks = block_table[: -(-total // block_size)].long()
        k = self.k_cache[blocks].flatten(0, 1)[:total]
        v = self.v_cache[blocks].flatten(0, 1)[:total]
        return k, v
