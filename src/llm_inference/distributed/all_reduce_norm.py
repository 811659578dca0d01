"""All-reduce fused with the residual add and RMSNorm that follow it (tensor parallelism).

A row-parallel layer (o_proj, down_proj) leaves each rank a partial sum `x`; the decoder then
needs `r = sum_ranks(x) + residual` and `rmsnorm(r) * weight`. Unfused that is an all-reduce
kernel (copy into a symmetric buffer, barrier, read the peers, barrier) and an RMSNorm kernel.
Here one kernel does it all, one program per row:

1. store this rank's row of `x` into this rank's symmetric buffer (at `buf_offset`);
2. tell each peer that the row is there: set the flag `[row, rank]` in the peer's flag area
   (an atomic compare-and-swap 0 -> 1 at system scope with release semantics, retried until
   the peer has consumed the previous signal in that slot);
3. wait for each peer's flag `[row, peer]` in this rank's flag area (compare-and-swap 1 -> 0,
   acquire), which consumes it;
4. read the row from every rank's buffer in rank order (this rank's from registers), sum in
   float32, round to the dtype: exactly what a two-rank all-reduce gives;
5. add the residual in float32, round, write the new residual in place, normalize, write out
   (the arithmetic of kernels/rms_norm.py).

Correctness rests on stream order, not on a trailing barrier:
- A program of the peer's kernel only runs once the peer's previous kernel (the matmul that
  wrote its `x`, or its previous call of this kernel) has completed: this kernel is never
  launched with programmatic dependent launch.
- Calls alternate between two halves of the buffer (`buf_offset`, from the call's parity). A
  rank writes a half again two calls later; by then its program of the call in between has
  seen the peer's flag of that call, so the peer's previous kernel, the one that read this
  half, has completed.
- Each flag slot is used by one program per call and left 0 by its consumer; the CAS loops
  make a fast rank wait for the slow one instead of overwriting a signal not yet consumed.
- Programs wait only on the same program index of the peers, which the GPUs dispatch in
  order: any grid size is free of deadlock.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _signal(flag_ptr):
    """Set a peer's flag 0 -> 1 once the peer has consumed the previous signal there."""
    while tl.atomic_cas(flag_ptr, 0, 1, sem="release", scope="sys") != 0:
        pass


@triton.jit
def _wait(flag_ptr):
    """Wait for this rank's flag to be 1, and consume it (1 -> 0)."""
    while tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, buf_ptrs, flag_ptrs,
    stride_x, stride_r, stride_o, n_cols, buf_offset, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    slot = buf_offset + row.to(tl.int64) * n_cols + cols
    own = tl.load(buf_ptrs + RANK).to(tl.pointer_type(dtype))
    tl.store(own + slot, x, mask=mask)
    tl.debug_barrier()  # every thread's store before the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            _signal(flags + row * WORLD + RANK)
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait(own_flags + row * WORLD + peer)
    tl.debug_barrier()  # the acquire above before every thread's loads below
    acc = tl.zeros([BLOCK], tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += x.to(tl.float32)
        else:
            buf = tl.load(buf_ptrs + src).to(tl.pointer_type(dtype))
            acc += tl.load(buf + slot, mask=mask, other=0.0, volatile=True).to(tl.float32)
    reduced = acc.to(dtype).to(tl.float32)
    r_ptrs = res_ptr + row.to(tl.int64) * stride_r + cols
    summed = (reduced + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(r_ptrs, summed, mask=mask)
    h = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, (h * rstd * w).to(dtype), mask=mask)


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buf_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    rank: int,
    buf_offset: int,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum_ranks(x) + residual) * weight, the new residual written into `residual`).

    x, residual [T, H] of one dtype, rows contiguous; weight [H]. `buf_ptrs` and `flag_ptrs`
    ([world] int64 on x's device) hold every rank's buffer (room for `buf_offset` + T * H
    elements of x's dtype) and flag area (T * world int32, zero when unused) addresses, the
    same on every rank; every rank calls with the same shapes and `buf_offset`."""
    num_rows, hidden = x.shape
    world = buf_ptrs.numel()
    if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != (hidden,):
        raise ValueError(f"residual {tuple(residual.shape)} and weight must fit x {x.shape}")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("x and residual must be contiguous in their last dim")
    if flag_ptrs.shape != (world,) or not 0 <= rank < world:
        raise ValueError(f"need one buffer and one flag address per rank, and rank {rank} of them")
    if out is None:
        out = torch.empty_like(x)
    if num_rows == 0:
        return out, residual
    block = triton.next_power_of_2(hidden)
    _all_reduce_add_rms_norm_kernel[(num_rows,)](
        x, residual, weight, out, buf_ptrs, flag_ptrs,
        x.stride(0), residual.stride(0), out.stride(0), hidden, buf_offset, eps,
        RANK=rank, WORLD=world, BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out, residual
