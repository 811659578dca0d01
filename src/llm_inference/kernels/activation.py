"""SiLU-and-mul in Triton: x [..., 2I] holding gate then up -> silu(gate) * up, [..., I]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of reference.silu_and_mul; computes in float32."""
    if x.dim() < 1 or x.shape[-1] % 2 or not x.is_floating_point():
        raise ValueError(f"x must be floating point [..., 2*I], got {tuple(x.shape)} {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dim")
    inter = x.shape[-1] // 2
    shape = (*x.shape[:-1], inter)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be {shape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    try:
        x2, o2 = x.view(-1, 2 * inter), out.view(-1, inter)
    except RuntimeError as e:
        raise ValueError(f"x and out must be viewable as rows: {e}") from None
    if o2.shape[0] and o2.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dim")
    block = min(BLOCK, triton.next_power_of_2(max(inter, 1)))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    if x2.shape[0]:
        _silu_and_mul_kernel[grid](
            x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block, num_warps=4
        )
    return out
