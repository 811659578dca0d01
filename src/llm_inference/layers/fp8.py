"""FP8 linear layers (vLLM's Fp8LinearMethod and compressed-tensors' FP8 W8A8, reduced):
float8_e4m3fn weights with one float32 scale per output row, multiplied with FP8 activations:
decode steps quantize them per tile inside the skinny GEMM, larger steps per token (or with
the checkpoint's static scale). Decode reads half the bytes of bf16.

Every checkpoint form (config.Fp8Format) ends in that one layout after loading
(`process_weights_after_loading`):
- online (an unquantized checkpoint, `quantization="fp8"`): the weight loads in the model
  dtype, then each row is scaled so that its largest magnitude is FP8's largest, 448;
- per-tensor scales (one per checkpoint weight: qkv_proj holds three, gate_up_proj two) are
  repeated over their rows; per-channel scales are the layout already;
- block scales (`weight_block_size`) are dequantized and the weight requantized per row: one
  layout to run, for a second rounding (at most half an e4m3 step, 2^-4 relative).

`apply` computes x @ W^T one of two ways:
- where the kernel ops take a skinny GEMM (`ops.skinny_applies`: steps of at most 32 rows on
  the Triton ops, compute capability 8.9+), the Triton skinny GEMM reads the FP8 weight and
  its row scales for an FP8 x FP8 dot: such a step's time is the weight bytes. x comes
  quantized per token from the RMSNorm before qkv_proj and gate_up_proj (below), its tiles
  going to the dot as loaded; o_proj's and down_proj's x, in the model dtype, the kernel
  quantizes per tile itself (a scale per row and 128 columns), with no kernel before it. The
  MLP's gate_up is fused with SiLU-and-mul there, as unquantized layers' is; a static input
  scale goes unused;
- else x is quantized (`ops.quantize_rows`: one Triton kernel on the Triton ops) and
  multiplied with W: on CUDA with compute capability 8.9 or more
  through `torch._scaled_mm` with row-wise scales (per-token x per-channel); elsewhere the
  reference dequantizes both and multiplies in the activation dtype, the same product up to
  rounding. The MLP's gate_up there hands down_proj its SiLU-and-mul already quantized per
  token (`ops.silu_and_mul_quant`, one kernel for the activation and the quantization: an
  `Fp8Activation`), unless the checkpoint's static input scales ask for another quantization.
  The RMSNorms before qkv_proj and gate_up_proj hand them their input quantized so too, in
  steps of any size (`takes_quantized`, `ops.rms_norm_quant`).

Under tensor parallelism a scale follows its weight rows: sharded with a column-parallel
layer's outputs, whole on every rank of a row-parallel one (its output is whole); a shard of
a block-scaled weight must hold whole blocks (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llm_inference.config import Fp8Format, cdiv
from llm_inference.kernels import KernelOps
from llm_inference.kernels.reference import FP8, quantize_rows
from llm_inference.layers.quantization import LinearMethodBase, register_param


@dataclass(frozen=True)
class Fp8Activation:
    """An activation already quantized per token, for an FP8 layer to take in place of x:
    `q` FP8 [T, K], `scale` float32 [T, 1] (x ~ q * scale), `dtype` the model's."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    scaled_mm: bool,
    quantize: Callable = quantize_rows,
) -> torch.Tensor:
    """x [T, K] @ (weight [N, K] FP8 * weight_scale [N])^T, x quantized per token (or with the
    static `input_scale`) by `quantize` (the ops' quantize_rows: on the Triton ops one kernel),
    or given quantized; `scaled_mm`: through torch._scaled_mm, else the reference."""
    if isinstance(x, Fp8Activation):
        q, x_scale, dtype = x.q, x.scale, x.dtype
    else:
        (q, x_scale), dtype = quantize(x, input_scale), x.dtype
    if scaled_mm:  # row-wise scaling takes bf16 output only
        y = torch._scaled_mm(
            q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )  # fmt: skip
        return y.to(dtype)
    w = (weight.float() * weight_scale[:, None]).to(dtype)
    return F.linear((q.float() * x_scale).to(dtype), w)


def _operand(x: torch.Tensor | Fp8Activation) -> torch.Tensor:
    """The tensor a skinny GEMM reads: x, or a quantized x's FP8 values."""
    return x.q if isinstance(x, Fp8Activation) else x


def _scale(x: torch.Tensor | Fp8Activation) -> tuple:
    """The skinny GEMM's (x_scale, out_dtype) for a quantized x: its scales [T] and dtype."""
    return (x.scale.view(-1), x.dtype) if isinstance(x, Fp8Activation) else ()


def scaled_mm_supported(weight: torch.Tensor) -> bool:
    """torch._scaled_mm's FP8 needs compute capability 8.9 (Ada, Hopper and later) and both
    matrix dimensions of W multiples of 16."""
    return (
        weight.is_cuda
        and torch.cuda.get_device_capability(weight.device) >= (8, 9)
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
    )


def _shard_index(shard_id: int | str) -> int:
    """The slot of a fused layer's part: q, k, v or gate (0), up (1)."""
    return "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id


def _per_shard_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str = 0) -> None:
    """A checkpoint's scalar (a per-tensor weight or input scale) into its part's slot; the
    same on every rank."""
    param.data[_shard_index(shard_id)] = loaded.reshape(())


@dataclass(frozen=True)
class Fp8Config:
    """The QuantizationConfig of FP8 models: every linear layer gets an Fp8LinearMethod."""

    format: Fp8Format

    def get_linear_method(self, ops: KernelOps) -> LinearMethodBase:
        return Fp8LinearMethod(ops, self.format)


class Fp8LinearMethod(LinearMethodBase):
    """Creates `weight` (FP8, or the model dtype for online quantization) and the checkpoint's
    scales; after loading, the layer holds `weight` [N, K] FP8, `weight_scale` [N] float32 and
    `input_scale` (a float32 scalar, or None: per token)."""

    def __init__(self, ops: KernelOps, fmt: Fp8Format) -> None:
        super().__init__(ops)
        self.fmt = fmt
        self.scaled_mm = False  # decided from the loaded weight's device

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        weight_loader: Callable,
    ) -> None:
        fmt, rows, cols = self.fmt, sum(output_partition_sizes), input_size_per_partition
        layer.output_partition_sizes = output_partition_sizes
        dtype = None if fmt.weight_scale == "online" else FP8  # None: the model dtype
        register_param(layer, "weight", torch.empty(rows, cols, dtype=dtype), weight_loader)
        parts = len(output_partition_sizes)
        if fmt.weight_scale == "tensor":
            register_param(
                layer, "weight_scale", torch.zeros(parts, dtype=torch.float32), _per_shard_loader
            )
        elif fmt.weight_scale == "channel":
            register_param(
                layer, "weight_scale", torch.empty(rows, 1, dtype=torch.float32), weight_loader
            )
        elif fmt.weight_scale == "block":
            bn, bk = fmt.weight_block_size
            if any(size % bn for size in output_partition_sizes) or (
                layer.tp_size > 1 and cols % bk
            ):
                raise ValueError(
                    f"a shard of {output_partition_sizes} output rows and {cols} input features "
                    f"does not hold whole blocks of weight_block_size {list(fmt.weight_block_size)}"
                    f" (tensor_parallel_size {layer.tp_size})"
                )

            def block_loader(param, loaded, *shard_id):
                # [out / bn, in / bk] blocks -> one row per output row, sharded as the weight
                whole = loaded.narrow(0, 0, loaded.shape[0]).float()
                weight_loader(param, whole.repeat_interleave(bn, dim=0), *shard_id)

            scale = torch.empty(rows, cdiv(cols, bk), dtype=torch.float32)
            register_param(layer, "weight_scale_inv", scale, block_loader)
        if fmt.static_input_scale:
            register_param(
                layer, "input_scale", torch.zeros(parts, dtype=torch.float32), _per_shard_loader
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        fmt, weight = self.fmt, layer.weight.data
        if fmt.weight_scale == "online":
            weight, scale = quantize_rows(weight)
        elif fmt.weight_scale == "block":
            bk = fmt.weight_block_size[1]
            per_column = layer.weight_scale_inv.repeat_interleave(bk, dim=1)[:, : weight.shape[1]]
            weight, scale = quantize_rows(weight.float() * per_column)
            del layer.weight_scale_inv
        elif fmt.weight_scale == "tensor":
            sizes = torch.tensor(layer.output_partition_sizes, device=weight.device)
            scale = layer.weight_scale.repeat_interleave(sizes)
        else:
            scale = layer.weight_scale
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.reshape(-1).float(), requires_grad=False)
        if fmt.static_input_scale:  # one scale for the fused parts' common input: the largest
            layer.input_scale = nn.Parameter(layer.input_scale.max(), requires_grad=False)
        else:
            layer.input_scale = None
        self.scaled_mm = scaled_mm_supported(weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.ops.skinny_applies(_operand(x), layer.weight):
            # a decode step: the skinny GEMM, on x quantized per token or quantizing it per tile
            y = self.ops.linear(_operand(x), layer.weight, layer.weight_scale, *_scale(x))
        else:
            y = fp8_linear(
                x, layer.weight, layer.weight_scale, layer.input_scale, self.scaled_mm,
                quantize=self.ops.quantize_rows,
            )  # fmt: skip
        return y if bias is None else y.add_(bias)

    def takes_quantized(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return not self.fmt.static_input_scale

    def apply_gate_up_silu(
        self, layer: nn.Module, x: torch.Tensor | Fp8Activation
    ) -> torch.Tensor | Fp8Activation:
        """silu(gate) * up for down_proj: where the skinny GEMM applies, fused with it as the
        unquantized layers' is; else quantized per token with the activation, for down_proj
        (also FP8: every decoder linear layer is) to take as it is, unless the checkpoint's
        static input scales ask for its own quantization."""
        if self.ops.skinny_applies(_operand(x), layer.weight):
            return self.ops.gate_up_silu(_operand(x), layer.weight, layer.weight_scale, *_scale(x))
        if self.fmt.static_input_scale:
            return super().apply_gate_up_silu(layer, x)
        y = self.apply(layer, x)
        return Fp8Activation(*self.ops.silu_and_mul_quant(y), y.dtype)
