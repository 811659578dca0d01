"""Rotary position embedding (rotate-half form), with Llama 3 frequency scaling.

The cos/sin table is computed once, in float32, exactly as transformers does
(`inv_freq` then `positions * inv_freq`), so logits match at long positions too."""

from __future__ import annotations

import math

import torch
from torch import nn

from llm_inference.config import RopeScaling


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of the columns, sin in the last."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        ops,
    ) -> None:
        super().__init__()
        self.ops = ops
        cache = cos_sin_cache(head_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], rotated in place."""
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
