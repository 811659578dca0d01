"""Attention over a flat batch of tokens from several sequences, with a paged KV cache.

One `AttentionBackend` object (built from the kernel ops, shared by every layer) owns both
halves of attention: turning a step's host-side inputs into an `AttentionMetadata` over
persistent device buffers (the same buffers CUDA graphs replay), and running attention.

A step's tokens are grouped by sequence, back to back: sequence s owns query rows
`query_start_loc[s]:query_start_loc[s + 1]` (L_s rows) and has `seq_lens[s]` tokens in the
cache once this step's K/V are written, so its row i sits at position `seq_lens[s] - L_s + i`
and attends causally to cache positions `[0, seq_lens[s] - L_s + i]`. A decode is simply
L_s = 1, a prompt chunk L_s > 1: there is no separate prefill and decode metadata.
Each layer first writes the new tokens' K/V at `slot_mapping`, then attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs; built once per step by `AttentionBackend`.

    `slot_mapping is None` means no KV cache (a dense forward: each sequence is a whole
    prompt attending causally to itself; used by model tests).
    """

    slot_mapping: torch.Tensor | None  # [T] int32, -1: do not write (padding)
    query_start_loc: torch.Tensor | None  # [S + 1] int32
    seq_lens: torch.Tensor | None  # [S] int32
    block_table: torch.Tensor | None  # [S, W] int32 (row stride may exceed W)
    max_query_len: int  # upper bounds, Python ints: kernel grids need no host sync
    max_seq_len: int
    dense_starts: tuple[int, ...] = ()  # a dense forward's sequence offsets, on the host
    # [S] int32, the sequences longest context first: the decode kernel's dispatch order,
    # which the kernels follow from some batch size on (None: in batch order).
    seq_order: torch.Tensor | None = None

    @classmethod
    def dense(cls, seq_lens: list[int]) -> AttentionMetadata:
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        return cls(None, None, None, None, max(seq_lens), max(seq_lens), tuple(starts))


@dataclass
class StepBuffers:
    """Persistent device buffers the backend builds metadata in (and graphs replay from)."""

    slot_mapping: torch.Tensor  # [max_tokens] int32
    query_start_loc: torch.Tensor  # [max_seqs + 1] int32
    seq_lens: torch.Tensor  # [max_seqs] int32
    block_table: torch.Tensor  # [max_seqs, max_blocks_per_seq] int32
    seq_order: torch.Tensor | None = None  # [max_seqs] int32, a permutation (see metadata)


def _order(buffers: StepBuffers, num_seqs: int) -> torch.Tensor | None:
    return None if buffers.seq_order is None else buffers.seq_order[:num_seqs]


class AttentionBackend:
    """Builds step metadata and runs prefill chunks and decodes through the kernel ops."""

    def __init__(self, ops) -> None:
        self.ops = ops

    # ---- metadata ------------------------------------------------------------------------

    def metadata(
        self,
        buffers: StepBuffers,
        num_tokens: int,
        num_seqs: int,
        max_query_len: int,
        max_seq_len: int,
        block_width: int,
    ) -> AttentionMetadata:
        """Views of `buffers` for a step whose host inputs were already copied into them
        (`seq_order`, when the buffers have one, holds a permutation of the step's sequences,
        longest first)."""
        return AttentionMetadata(
            slot_mapping=buffers.slot_mapping[:num_tokens],
            query_start_loc=buffers.query_start_loc[: num_seqs + 1],
            seq_lens=buffers.seq_lens[:num_seqs],
            block_table=buffers.block_table[:num_seqs, :block_width],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            seq_order=_order(buffers, num_seqs),
        )

    def graph_metadata(
        self,
        buffers: StepBuffers,
        num_seqs: int,
        max_model_len: int,
        num_tokens: int | None = None,
    ) -> AttentionMetadata:
        """Static metadata for a captured step over the whole block-table width.

        Decode (`num_tokens` None): `num_seqs` rows, one token each (the split-K decode
        kernel). Mixed: `num_tokens` rows in up to `num_seqs` sequences, max_query_len
        `num_tokens` (> 1: the tiled kernel, whose grid, num_tokens // BLOCK_Q + num_seqs
        programs, covers any step of at most that many tokens and sequences; padding
        sequences own no rows). Grids depend only on these sizes and `max_model_len`; the
        values in the buffers change from replay to replay."""
        width = buffers.block_table.shape[1]
        decode = num_tokens is None
        num_tokens = num_seqs if decode else num_tokens
        return AttentionMetadata(
            slot_mapping=buffers.slot_mapping[:num_tokens],
            query_start_loc=buffers.query_start_loc[: num_seqs + 1],
            seq_lens=buffers.seq_lens[:num_seqs],
            block_table=buffers.block_table[:num_seqs, :width],
            max_query_len=1 if decode else num_tokens,
            max_seq_len=max_model_len,
            seq_order=_order(buffers, num_seqs) if decode else None,
        )

    # ---- attention -----------------------------------------------------------------------

    def forward(
        self, layer: Attention, q, k, v, md: AttentionMetadata, positions=None, cos_sin_cache=None
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then one attention call over the cache for
        every sequence of the step, prompt chunks and decodes alike. With `cos_sin_cache`, q
        and k are rotated first (RoPE at `positions`), in the same kernel as the store."""
        if md.slot_mapping is None:
            if cos_sin_cache is not None:
                self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
            return self._dense(layer, q, k, v, md)
        caches, scales = (layer.k_cache, layer.v_cache), (layer.k_scale, layer.v_scale)
        if cos_sin_cache is not None:
            self.ops.rotary_store_kv(
                positions, q, k, v, cos_sin_cache, *caches, md.slot_mapping, *scales
            )
        else:
            self.ops.store_kv_cache(k, v, *caches, md.slot_mapping, *scales)
        return self.ops.unified_attention(
            q, *caches, md.block_table, md.query_start_loc, md.seq_lens, layer.scale,
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, seq_order=md.seq_order,
            k_scale=layer.k_scale, v_scale=layer.v_scale,
        )  # fmt: skip

    def _dense(self, layer: Attention, q, k, v, md: AttentionMetadata) -> torch.Tensor:
        """No cache (model tests): each sequence attends causally to itself."""
        out = torch.empty_like(q)
        starts = md.dense_starts
        for a, b in zip(starts[:-1], starts[1:]):
            out[a:b] = _causal(q[a:b], k[a:b], v[a:b], layer)
        return out


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention):
    """Plain causal attention of one whole sequence: q [L, Hq, D], k/v [L, Hkv, D]."""
    group = layer.num_heads // layer.num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=layer.scale
    )
    return out.transpose(0, 1)


class Attention(nn.Module):
    """Grouped-query attention core: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D], set by runner
        self.v_cache: torch.Tensor | None = None
        # An FP8 cache's scales (the model dtype's caches ignore them): the checkpoint's
        # (models/loader.py), else 1.0, as vLLM's default for checkpoints without KV scales.
        self.k_scale = self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        positions: torch.Tensor | None = None,
        cos_sin_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q and k already rotated, or rotated here at `positions` with `cos_sin_cache`."""
        return self.backend.forward(self, q, k, v, md, positions, cos_sin_cache)
