"""Unquantized weights: W in the model dtype, y = x @ W^T by the kernel ops."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llm_inference.layers.quantization.base_config import LinearMethodBase


class UnquantizedLinearMethod(LinearMethodBase):
    """One parameter `weight` [sum(output_partition_sizes), input_size_per_partition] (nn.Linear's
    layout, no bias); `apply` is `ops.linear`, `apply_gate_up_silu` `ops.gate_up_silu` (the
    Triton ops choose the skinny GEMM where it applies)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        weight_loader: Callable,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition),
            requires_grad=False,
        )
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, layer.weight)

    def apply_gate_up_silu(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gate_up_silu(x, layer.weight)
