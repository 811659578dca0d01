"""FP8 activation quantization in Triton: x [R, C] -> float8_e4m3fn [R, C] and float32 scales
[R, 1], as reference.quantize_rows (x ~ q * scale), in one launch instead of PyTorch's
float32 copy, abs, amax, divide, clamp and cast; and `silu_and_mul_quant`, the MLP's
SiLU-and-mul quantized so in the same launch (reference.silu_and_mul_quant: the product stays
in float32, never written in x's dtype).

One program per row. Per token: a first pass takes the row's largest magnitude in float32,
scale = max(amax, MIN_AMAX) / 448; a second pass stores x / scale saturated to +-448 (with
SILU, x is silu(gate) * up, computed in each pass from the row's two halves). With a
static scale (a one-element float32 tensor) one pass divides by it and every row's scale is
that one. Both divisions round to nearest (`div_rn`, as PyTorch's), so on compute capability
8.9+ (whose cast to e4m3 rounds to nearest even) quantize_rows' bytes equal the reference's;
SiLU's exponential is Triton's, not PyTorch's, so that one agrees to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_inference.kernels.reference import FP8, FP8_MAX, MIN_AMAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # kernels read globals only as constexpr
_MIN_AMAX = tl.constexpr(MIN_AMAX)
BLOCK = 1024  # columns per step of a row's loops


@triton.jit
def _row_values(x_row, cols, mask, n_cols, SILU: tl.constexpr):
    """A block of the row in float32: x, or with SILU silu(gate) * up, up n_cols further."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, stride_x, stride_q, n_cols,
    STATIC: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = _row_values(x_row, cols, cols < n_cols, n_cols, SILU)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _row_values(x_row, cols, mask, n_cols, SILU)
        q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cols: int, static: torch.Tensor | None, silu: bool):
    """(q [R, cols] FP8, scales [R, 1]) of x's rows (with `silu`, of silu(gate) * up)."""
    rows = x.shape[0]
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    out_scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](
            x, q, out_scale, out_scale if static is None else static, x.stride(0), q.stride(0),
            cols, STATIC=static is not None, SILU=silu,
            BLOCK=min(BLOCK, triton.next_power_of_2(max(cols, 1))), num_warps=4,
        )  # fmt: skip
    return q, out_scale


def quantize_rows(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.quantize_rows: x [R, C] floating point, contiguous in its
    last dim; `scale` None (per row) or a one-element tensor on x's device."""
    if x.dim() != 2 or not x.is_floating_point() or x.stride(-1) != 1:
        raise ValueError(
            f"x must be floating point [R, C], contiguous in its last dim; got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    if scale is not None and (scale.numel() != 1 or scale.device != x.device):
        raise ValueError(
            f"scale must be one element on {x.device}; got {tuple(scale.shape)} on {scale.device}"
        )
    static = None if scale is None else scale.reshape(1).float()
    return _launch(x, x.shape[1], static, silu=False)


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.silu_and_mul_quant: x [T, 2*I] floating point (gate then
    up), contiguous in its last dim -> (FP8 [T, I], float32 scales [T, 1])."""
    if x.dim() != 2 or x.shape[1] % 2 or not x.is_floating_point() or x.stride(-1) != 1:
        raise ValueError(
            f"x must be floating point [T, 2*I], contiguous in its last dim; got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    return _launch(x, x.shape[1] // 2, None, silu=True)
