"""Fused residual add + RMSNorm in Triton: one program per row, the row held in registers.

x [..., H] (last dim contiguous, leading dims flattenable to rows), weight [H]. With `residual`
(same shape and dtype as x), the kernel computes r = x + residual in float32, rounds it to the
dtype (as reference.py does), writes it back into `residual` and normalizes it: one read of x,
residual and weight, one write of out and residual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_inference.kernels.pdl import launch_kwargs, wait_then_release


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
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
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name} {tuple(t.shape)} cannot be viewed as rows: {e}") from None


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
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must match x {tuple(x.shape)} {x.dtype}")
    o2 = _rows(out, "out")
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, x2.stride(0), r2.stride(0), o2.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl,
        num_warps=min(16, max(1, block // 512)), **launch_kwargs(pdl),
    )  # fmt: skip
    return out if residual is None else (out, residual)
