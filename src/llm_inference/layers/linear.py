"""Tensor-parallel linear layers. Parameters are created at shard size; each carries a
`weight_loader(param, loaded_weight[, shard_id])` that narrows the full checkpoint tensor to
this rank's shard. `loaded_weight` is a tensor or anything with `.narrow(dim, start, length)`
that returns one (models/loader.py passes lazy safetensors slices, so a rank reads only its
own part of each tensor); `copy_` converts the dtype. No bias: Llama checkpoints we support
are bias-free.

Column-parallel layers (qkv_proj, gate_up_proj) keep their output sharded; the row-parallel
ones (o_proj, down_proj) take it sharded and sum the partial outputs with one all-reduce.

`skinny_gemm=True` (the engine option of that name) sends the matmuls of at most SKINNY_MAX_ROWS
rows on CUDA in half precision to the Triton skinny GEMM (kernels/skinny_gemm.py), decode
batches, whose time is the weight bytes; everything else stays F.linear. Inside a CUDA graph the
row count is the graph's batch size, so the choice is made once per graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm_inference.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size

SKINNY_MAX_ROWS = 16


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny GEMM computes x @ weight^T: 2-D x of 1 to SKINNY_MAX_ROWS rows on
    CUDA, float16 or bfloat16 like the weight, both contiguous in their last dim."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, skinny_gemm: bool = False) -> torch.Tensor:
    """x @ weight^T: the Triton skinny GEMM when `skinny_gemm` and it applies, else F.linear."""
    if skinny_gemm and skinny_applies(x, weight):
        from llm_inference.kernels import skinny_gemm as kernels

        return kernels.skinny_gemm(x, weight)
    return F.linear(x, weight)


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by tensor_parallel_size {b}")
    return a // b


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, skinny_gemm: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.skinny_gemm = skinny_gemm

    def uses_skinny_gemm(self, x: torch.Tensor) -> bool:
        return self.skinny_gemm and skinny_applies(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.skinny_gemm)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (dim 0 of the weight)."""

    def __init__(self, in_features: int, out_features: int, skinny_gemm: bool = False) -> None:
        super().__init__(in_features, _divide(out_features, get_tp_size()), skinny_gemm)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs fused in one weight (gate_proj and up_proj)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], skinny_gemm: bool = False
    ) -> None:
        tp = get_tp_size()
        self.shard_sizes = [_divide(s, tp) for s in output_sizes]
        super().__init__(in_features, sum(self.shard_sizes), skinny_gemm)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused; heads split across ranks. When there are fewer KV heads
    than ranks, each KV head is replicated on tp_size // num_kv_heads ranks."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
        skinny_gemm: bool = False,
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
        super().__init__(hidden, q + 2 * kv, skinny_gemm)

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
        self, in_features: int, out_features: int, skinny_gemm: bool = False,
        reduce_results: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(_divide(in_features, get_tp_size()), out_features, skinny_gemm)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.skinny_gemm)
        return all_reduce(y) if self.reduce_results else y
