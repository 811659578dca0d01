"""The linear-method interface (vLLM's LinearMethodBase) and the quantization config that
picks a method (vLLM's QuantizationConfig)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from llm_inference.kernels import KernelOps


class LinearMethodBase(ABC):
    """How one linear layer stores its weights and computes y = x @ W^T through `ops`.

    Contract: `create_weights` registers the layer's parameters at shard size on the current
    default device and dtype (models/loader.py builds the model under both), each with
    `weight_loader`, which models/loader.py calls as `weight_loader(param, tensor[,
    shard_id])`; after every tensor is loaded, `process_weights_after_loading` runs once; then
    `apply` computes the layer's output for x [T, input_size_per_partition]."""

    def __init__(self, ops: KernelOps) -> None:
        self.ops = ops

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        weight_loader: Callable,
    ) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Convert the loaded weights to the form `apply` reads (nothing by default)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def apply_gate_up_silu(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the layer's two equal outputs [gate, up]: [T, I]. By default
        `apply`, then the ops' silu_and_mul; a method may fuse them."""
        return self.ops.silu_and_mul(self.apply(layer, x))


class QuantizationConfig(Protocol):
    """A checkpoint's quantization: picks each linear layer's method."""

    def get_linear_method(self, ops: KernelOps) -> LinearMethodBase: ...
