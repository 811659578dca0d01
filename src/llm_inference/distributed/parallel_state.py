"""Tensor-parallel process group state: rank, world size and collectives.

One process per rank. `init_distributed(rank, world_size, port, device)` joins the default
process group (NCCL on CUDA, gloo on CPU) through a TCP rendezvous on 127.0.0.1 at `port`,
which the parent picked with `free_port()`; the layers, built after it, read the rank and size
at construction. In a single rank (world size 1, no process group) every helper is a no-op.

The collectives are plain `torch.distributed` calls on the default group: with NCCL they are
capturable in CUDA graphs once the communicator exists (the first, eager forward creates it).
Except `all_reduce` on CUDA: `init_distributed` also sets up the custom all-reduce
(custom_all_reduce.py: symmetric memory, peer-to-peer over NVLink, checked once at set-up,
unless `use_custom_all_reduce=False`), which sums the small messages (bfloat16 or float32, up
to a few MB) and leaves the others to NCCL; capturable as well. On the CPU (gloo), or when its
set-up fails, every all-reduce is NCCL's or gloo's.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

from llm_inference import envs
from llm_inference.distributed import custom_all_reduce

_TP_RANK = 0
_TP_SIZE = 1
_CUSTOM_ALL_REDUCE: custom_all_reduce.CustomAllReduce | None = None
# The fused all-reduce + RMSNorm runs one program per row, each signalling its peers: it beats
# the all-reduce followed by the RMSNorm kernel for few rows only (benchmarks/all_reduce.py
# --norm; benchmarks/DECISIONS.md).
FUSED_NORM_MAX_ROWS = 16


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_custom_all_reduce() -> custom_all_reduce.CustomAllReduce | None:
    """The custom all-reduce in use, or None (one rank, CPU, disabled or failed set-up)."""
    return _CUSTOM_ALL_REDUCE


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it; never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int,
    world_size: int,
    port: int,
    device: torch.device | str = "cpu",
    timeout_s: float = 600.0,
    use_custom_all_reduce: bool = True,
    kernel_backend: str = "reference",
    host: str = "127.0.0.1",
) -> None:
    """Join the tensor-parallel group as `rank` of `world_size` (rendezvous at host:port; the
    Ray executor gives rank 0's node IP, reachable from every node).
    On CUDA, then set up the custom all-reduce (every rank; NCCL alone if it fails) unless
    `use_custom_all_reduce` is False. With the Triton kernels (`kernel_backend`, resolved) it
    also fuses the residual add and RMSNorm (`all_reduce_add_rms_norm`, a Triton kernel) unless
    envs.LLM_INFERENCE_FUSED_ALL_REDUCE_NORM turns that off.

    World size 1 sets the globals and creates no group."""
    global _TP_RANK, _TP_SIZE, _CUSTOM_ALL_REDUCE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    device = torch.device(device)
    if world_size > 1:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process")
        if device.type == "cuda":
            backend, kw = "nccl", {"device_id": device}
        else:
            backend, kw = "gloo", {}
            if sys.platform.startswith("linux") and host == "127.0.0.1":
                # One host: keep gloo on the loopback whatever the hostname resolves to.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kw,
        )
        if device.type == "cuda" and use_custom_all_reduce:
            fused_norm = kernel_backend == "triton" and envs.LLM_INFERENCE_FUSED_ALL_REDUCE_NORM
            with torch.cuda.device(device):
                _CUSTOM_ALL_REDUCE = custom_all_reduce.create(device, fused_norm=fused_norm)
    _TP_RANK, _TP_SIZE = rank, world_size


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE, _CUSTOM_ALL_REDUCE
    if _CUSTOM_ALL_REDUCE is not None:
        _CUSTOM_ALL_REDUCE.close()  # before the group its buffer was mapped over
        _CUSTOM_ALL_REDUCE = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the sum. Small messages on CUDA go
    through the custom all-reduce (custom_all_reduce.algorithm decides), the rest to NCCL."""
    if _TP_SIZE > 1:
        custom = _CUSTOM_ALL_REDUCE
        algo = custom_all_reduce.NCCL if custom is None else custom.algorithm(x)
        if algo == custom_all_reduce.NCCL:
            dist.all_reduce(x)
        else:
            custom.all_reduce(x, algo)
    return x


def all_reduce_add_rms_norm(x, residual, weight, eps: float, ops, index: int = 0):
    """`ops.rms_norm(all_reduce(x), weight, eps, residual)`: the sum over the ranks of a
    row-parallel layer's partial output, plus the residual, normalized; returns (normed, new
    residual). Where the custom all-reduce was set up with `fused_norm` and takes `x`, one
    fused kernel (up to FUSED_NORM_MAX_ROWS rows); `index` numbers the calls of a forward pass
    (consecutive calls must alternate parity, see custom_all_reduce). One rank: the RMSNorm
    alone."""
    custom = _CUSTOM_ALL_REDUCE
    if (
        _TP_SIZE > 1
        and custom is not None
        and x.shape[0] <= FUSED_NORM_MAX_ROWS
        and custom.can_fuse_norm(x, residual)
    ):
        return custom.all_reduce_add_rms_norm(x, residual, weight, eps, index)
    return ops.rms_norm(all_reduce(x), weight, eps, residual)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` (same shape and dtype on every rank) with rank `src`'s, in place. With
    NCCL it is queued on the current stream: no host synchronization."""
    if _TP_SIZE > 1:
        dist.broadcast(x, src)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Stack every rank's `x` (same shape on all ranks): [world_size, *x.shape] on every rank."""
    if _TP_SIZE == 1:
        return x[None]
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (every rank gets the whole)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's shard along the last dim on rank 0; None on the other ranks."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)] if _TP_RANK == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None
