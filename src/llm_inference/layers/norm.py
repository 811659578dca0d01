from __future__ import annotations

import torch
from torch import nn

from llm_inference.distributed.parallel_state import all_reduce_add_rms_norm


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, the fused residual-add form returning (normed, residual).

    With `partial=True`, `x` is a row-parallel layer's per-rank partial output: it is summed
    over the ranks first, in the same kernel where the custom all-reduce allows
    (parallel_state.all_reduce_add_rms_norm). `fuse_index` numbers such norms in a forward
    pass (the model sets it), so that consecutive fused calls alternate buffers."""

    def __init__(self, hidden_size: int, eps: float, ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops
        self.fuse_index = 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, partial: bool = False):
        if partial:
            return all_reduce_add_rms_norm(
                x, residual, self.weight, self.eps, self.ops, self.fuse_index
            )
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
