from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """[T, 2*I] (gate then up) -> silu(gate) * up, [T, I]."""

    def __init__(self, ops) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
