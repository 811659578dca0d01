"""Tensor-parallel linear layers. Each layer's linear method (layers/quantization) creates its
parameters at shard size and computes its output through the kernel ops; the layer itself only
knows how its weight is split across ranks. Each parameter carries the layer's
`weight_loader(param, loaded_weight[, shard_id])`, which narrows the full checkpoint tensor to
this rank's shard. `loaded_weight` is a tensor or anything with `.narrow(dim, start, length)`
that returns one (models/loader.py passes lazy safetensors slices, so a rank reads only its
own part of each tensor); `copy_` converts the dtype. Only the QKV projection may have a bias
(Qwen2's): a parameter of the output's layout, split across ranks as the weight's rows and
loaded by the same loader, added by the linear method.

Column-parallel layers (qkv_proj, gate_up_proj) keep their output sharded; the row-parallel
ones (o_proj, down_proj) take it sharded and sum the partial outputs with one all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from llm_inference.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from llm_inference.kernels import KernelOps
from llm_inference.layers.quantization import (
    QuantizationConfig,
    get_linear_method,
    register_param,
)


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by tensor_parallel_size {b}")
    return a // b


class LinearBase(nn.Module):
    """y = x @ W^T (+ b) for this rank's shard of W: [sum(output_partition_sizes),
    input_size_per_partition] (and of b), computed by the layer's linear method
    (`quant_method`). Subclasses define `weight_loader`."""

    def __init__(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        ops: KernelOps,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.quant_method = get_linear_method(quant_config, ops)
        self.quant_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, self.weight_loader
        )
        if bias:
            bias_data = torch.empty(sum(output_partition_sizes))
            register_param(self, "bias", bias_data, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def takes_quantized(self, x: torch.Tensor) -> bool:
        """Whether the layer would quantize x per token first (FP8 off the skinny GEMM): the
        kernel producing x may then quantize it instead (layers/fp8.py, Fp8Activation)."""
        return self.quant_method.takes_quantized(self, x)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (dim 0 of the weight)."""

    def __init__(
        self, in_features: int, out_features: int, ops: KernelOps,
        quant_config: QuantizationConfig | None = None,
    ) -> None:  # fmt: skip
        super().__init__(in_features, [_divide(out_features, get_tp_size())], ops, quant_config)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs fused in one weight (gate_proj and up_proj)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], ops: KernelOps,
        quant_config: QuantizationConfig | None = None,
    ) -> None:  # fmt: skip
        tp = get_tp_size()
        self.shard_sizes = [_divide(s, tp) for s in output_sizes]
        super().__init__(in_features, self.shard_sizes, ops, quant_config)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(first output) * second output, for two equal outputs (the MLP's gate and up):
        [T, I], fused with the matmul where the linear method can (FP8's may return it
        quantized, for the down projection: layers/fp8.py)."""
        return self.quant_method.apply_gate_up_silu(self, x)


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused (with their biases if `bias`); heads split across ranks.
    When there are fewer KV heads than ranks, each KV head is replicated on
    tp_size // num_kv_heads ranks."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, ops: KernelOps,
        quant_config: QuantizationConfig | None = None, bias: bool = False,
    ) -> None:  # fmt: skip
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        if tp >= num_kv_heads:
            _divide(tp, num_kv_heads)
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = _divide(num_kv_heads, tp)
        self.total_kv_heads = num_kv_heads
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden, [q, kv, kv], ops, quant_config, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q, self.tp_rank
        else:
            offset = q if shard_id == "k" else q + kv
            size = kv
            # With replication several ranks share one KV head.
            replicas = max(1, self.tp_size // self.total_kv_heads)
            index = self.tp_rank // replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, index * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks (dim 1); partial outputs summed by one all-reduce,
    or, with `reduce_results=False`, left to the caller to sum (the decoder sums them in the
    RMSNorm that follows: parallel_state.all_reduce_add_rms_norm)."""

    def __init__(
        self, in_features: int, out_features: int, ops: KernelOps,
        quant_config: QuantizationConfig | None = None, reduce_results: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(_divide(in_features, get_tp_size()), [out_features], ops, quant_config)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # A parameter with fewer columns than the checkpoint's holds this rank's part of them;
        # one with as many (the weight at TP=1, FP8's per-output-row scales) is whole.
        size = param.shape[1]
        start = self.tp_rank * size if size != loaded.shape[1] else 0
        param.data.copy_(loaded.narrow(1, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return all_reduce(y) if self.reduce_results else y
