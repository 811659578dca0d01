"""Rotary position embedding (rotate-half form), with Llama 3 or YaRN frequency scaling.

The cos/sin table is computed once, in float32, exactly as transformers does
(`inv_freq` then `positions * inv_freq`), so logits match at long positions too. YaRN's
attention factor scales the table itself: the kernels read it as any other."""

from __future__ import annotations

import math

import torch
from torch import nn

from llm_inference.config import RopeScaling, YarnScaling


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


def yarn_inv_freq(pos_freqs: torch.Tensor, theta: float, s: YarnScaling) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: frequencies that turn more than `beta_fast`
    times over the original context are kept, those under `beta_slow` divided by the factor,
    a linear ramp between."""
    dim = 2 * len(pos_freqs)

    def correction_dim(rotations: float) -> float:
        ratio = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return 1.0 / (s.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | YarnScaling | None
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half of the columns, sin in the last."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos_freqs = theta**exponents
    inv_freq = 1.0 / pos_freqs
    if isinstance(scaling, RopeScaling):
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif isinstance(scaling, YarnScaling):
        inv_freq = yarn_inv_freq(pos_freqs, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table * scaling.cos_sin_scale if isinstance(scaling, YarnScaling) else table


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | YarnScaling | None,
        ops,
    ) -> None:
        super().__init__()
        self.ops = ops
        cache = cos_sin_cache(head_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], rotated in place."""
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
