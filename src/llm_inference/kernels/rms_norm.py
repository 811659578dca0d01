"""Fused residual add + RMSNorm in Triton: one program per row, the row held in registers.

x [..., H] (last dim contiguous, leading dims flattenable to rows), weight [H]. With `residual`
(same shape and dtype as x), the kernel computes r = x + residual in float32, rounds it to the
dtype (as reference.py does), writes it back into `residual` and normalizes it: one read of x,
residual and weight, one write of out and residual.

`rms_norm_quant` writes the normalized rows quantized to FP8 per token instead (the next FP8
layer's input, layers/fp8.py), from the float32 row as fp8_quant.py quantizes: scale =
max(amax, MIN_AMAX) / 448 per row, q = x / scale saturated, both divisions rounded to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_inference.kernels.pdl import launch_kwargs, wait_then_release
from llm_inference.kernels.reference import FP8, FP8_MAX, MIN_AMAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # kernels read globals only as constexpr
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        wait_then_release()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + row * stride_r + cols
        summed = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(
            res_ptr.dtype.element_ty
        )
        tl.store(r_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    if QUANT:  # per token, from the float32 row
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), _MIN_AMAX), _FP8_MAX)
        tl.store(scale_ptr + row, scale)
        y = tl.clamp(tl.div_rn(y, scale), -_FP8_MAX, _FP8_MAX)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name} {tuple(t.shape)} cannot be viewed as rows: {e}") from None


def _launch(x, weight, eps, residual, out, scale, pdl) -> None:
    """Normalize x's rows into `out` (x's dtype, or FP8 with `scale` [rows, 1] float32)."""
    hidden = x.shape[-1]
    if x.dim() < 1 or weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    if not x.is_floating_point() or weight.device != x.device:
        raise ValueError(f"x must be floating point and on weight's device, got {x.dtype}")
    x2 = _rows(x, "x")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}")
        r2 = _rows(residual, "residual")
    else:
        r2 = x2  # unused
    o2 = _rows(out, "out")
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, o2 if scale is None else scale,
        x2.stride(0), r2.stride(0), o2.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, QUANT=scale is not None, BLOCK=block, PDL=pdl,
        num_warps=min(16, max(1, block // 512)), **launch_kwargs(pdl),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.rms_norm; the new residual is written into `residual`.
    `pdl`: launch with programmatic dependent launch (kernels/pdl.py)."""
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must match x {tuple(x.shape)} {x.dtype}")
    _launch(x, weight, eps, residual, out, None, pdl)
    return out if residual is None else (out, residual)


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of reference.rms_norm_quant: x [T, H] -> (FP8 [T, H], float32 scales
    [T, 1], the new residual or None); the new residual is written into `residual`."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _launch(x, weight, eps, residual, q, scale, pdl)
    return q, scale, residual
