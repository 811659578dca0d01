from __future__ import annotations

import torch
from torch import nn

from llm_inference.distributed.parallel_state import all_reduce, all_reduce_add_rms_norm
from llm_inference.layers.fp8 import Fp8Activation


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, the fused residual-add form returning (normed, residual).

    With `partial=True`, `x` is a row-parallel layer's per-rank partial output: it is summed
    over the ranks first, in the same kernel where the custom all-reduce allows
    (parallel_state.all_reduce_add_rms_norm). `fuse_index` numbers such norms in a forward
    pass (the model sets it), so that consecutive fused calls alternate buffers.

    With `quantize=True` (where the FP8 layer that takes the output would quantize it: its
    `takes_quantized`), the output is quantized per token in the same kernel
    (`ops.rms_norm_quant`): an fp8.Fp8Activation."""

    def __init__(self, hidden_size: int, eps: float, ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops
        self.fuse_index = 0

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, partial: bool = False,
        quantize: bool = False,
    ):  # fmt: skip
        if quantize:
            if partial:  # summed apart: the fused all-reduce's steps are the skinny GEMM's
                x = all_reduce(x)
            q, scale, residual = self.ops.rms_norm_quant(x, self.weight, self.eps, residual)
            out = Fp8Activation(q, scale, x.dtype)
            return out if residual is None else (out, residual)
        if partial:
            return all_reduce_add_rms_norm(
                x, residual, self.weight, self.eps, self.ops, self.fuse_index
            )
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
