"""Linear methods: how a linear layer stores its weights and computes x @ W^T (vLLM's
quantization interface, reduced to what the engine uses).

A linear layer (layers/linear.py, and the LM head) owns no matmul: at construction it asks
`get_linear_method(quant_config, ops)` for its method. A quantization config picks the method
for a layer: None gives unquantized weights in the model dtype (`UnquantizedLinearMethod`);
layers/fp8.py's `Fp8Config` gives FP8 weights (`Fp8LinearMethod`), built by models/loader.py
from the model config's FP8 format. The LM head and the embeddings are never quantized.
"""

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
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def takes_quantized(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply` would quantize x per token first: then the kernel producing x may
        hand it on quantized instead (FP8's: an fp8.Fp8Activation; the RMSNorm does). No by
        default."""
        return False

    def apply_gate_up_silu(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the layer's two equal outputs [gate, up]: [T, I]. By default
        `apply`, then the ops' silu_and_mul; a method may fuse them, or hand it on in the form
        its own method's `apply` takes next (FP8's: quantized, an fp8.Fp8Activation)."""
        return self.ops.silu_and_mul(self.apply(layer, x))


def register_param(layer: nn.Module, name: str, data: torch.Tensor, loader: Callable) -> None:
    """`data` as the frozen parameter `name` of `layer`, loaded from the checkpoint by `loader`
    (`loader(param, loaded, *shard_id)`, the layer's or the method's)."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    layer.register_parameter(name, param)


class QuantizationConfig(Protocol):
    """A checkpoint's quantization: picks each linear layer's method."""

    def get_linear_method(self, ops: KernelOps) -> LinearMethodBase: ...


class UnquantizedLinearMethod(LinearMethodBase):
    """One parameter `weight` [sum(output_partition_sizes), input_size_per_partition] (nn.Linear's
    layout); `apply` is `ops.linear` (plus the bias), `apply_gate_up_silu` `ops.gate_up_silu`
    (the Triton ops choose the skinny GEMM where it applies)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        weight_loader: Callable,
    ) -> None:
        data = torch.empty(sum(output_partition_sizes), input_size_per_partition)
        register_param(layer, "weight", data, weight_loader)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = self.ops.linear(x, layer.weight)
        return y if bias is None else y.add_(bias)

    def apply_gate_up_silu(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gate_up_silu(x, layer.weight)


def get_linear_method(quant_config: QuantizationConfig | None, ops: KernelOps) -> LinearMethodBase:
    """The linear method of a layer under `quant_config` (None: unquantized)."""
    if quant_config is None:
        return UnquantizedLinearMethod(ops)
    return quant_config.get_linear_method(ops)
