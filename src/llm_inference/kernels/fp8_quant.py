"""FP8 activation quantization in Triton: x [R, C] -> float8_e4m3fn [R, C] and float32 scales
[R, 1], as reference.quantize_rows (x ~ q * scale), in one launch instead of PyTorch's
float32 copy, abs, amax, divide, clamp and cast.

One program per row. Per token: a first pass takes the row's largest magnitude in float32,
scale = max(amax, MIN_AMAX) / 448; a second pass stores x / scale saturated to +-448. With a
static scale (a one-element float32 tensor) one pass divides by it and every row's scale is
that one. Both divisions round to nearest (`div_rn`, as PyTorch's), so on compute capability
8.9+ (whose cast to e4m3 rounds to nearest even) the bytes equal the reference's.
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
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, stride_x, stride_q, n_cols,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


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
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    out_scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    static = None if scale is None else scale.reshape(1).float()
    if rows:
        _quantize_rows_kernel[(rows,)](
            x, q, out_scale, out_scale if static is None else static, x.stride(0), q.stride(0),
            cols, STATIC=static is not None, BLOCK=min(BLOCK, triton.next_power_of_2(cols)),
            num_warps=4,
        )  # fmt: skip
    return q, out_scale
