"""A low-latency all-reduce for small messages on one host: PyTorch symmetric memory.

For the few-KB all-reduces of a decode step, where NCCL's latency dominates: every rank owns
one persistent buffer (`torch.distributed._symmetric_memory.empty`) mapped into every peer
(`rendezvous`), and a `torch.ops.symm_mem` kernel reads the peers' buffers over NVLink,
peer-to-peer loads only (no multicast, which the target machines disable): one-shot
(`one_shot_all_reduce_copy_out`: copy `x` in, wait for the peers, sum every buffer into `x`)
for small messages, two-shot (each rank sums 1/world of the message, then gathers the rest)
above ONE_SHOT_MAX_BYTES.

Invariants:

- Used only at world size 2, 4 or 8 on CUDA, when `init_distributed` set it up (not with
  `disable_custom_all_reduce`) and its self-check passed: one all-reduce of each dtype at the
  smallest and largest routed sizes, through it and through NCCL, equal on every rank.
  Otherwise rank 0 prints one line saying why and NCCL does every all-reduce of the run.
- Per call, `algorithm(x)` routes: bfloat16 or float32 (the symm_mem kernels have no float16),
  contiguous, at a 16-byte-aligned offset in its storage, a non-zero multiple of 4 bytes and
  at most `max_bytes` (MAX_BYTES, by world size) -> one-shot up to `one_shot_max_bytes`, then
  two-shot; anything else -> NCCL. The route depends only on shape and dtype, so every rank
  takes the same one (ranks must call all-reduce in the same order with the same shapes, as
  with NCCL).
- In place: the sum is written into `x`.
- CUDA graphs: the ranks synchronize inside the kernels, through flags in each other's signal
  pads (device memory); no host step, so a call can be captured, and a replay reuses the same
  buffer addresses. The buffer is shared by every call: all-reduces must not run concurrently
  on different streams (the engine runs one stream).
- The kernels end by waiting for every peer, so when one returns no peer still reads this
  rank's buffer: the next call may overwrite it.

With `fused_norm`, the buffer has a second part for `all_reduce_add_rms_norm`: the all-reduce
of a row-parallel layer's output fused with the residual add and RMSNorm after it, one Triton
kernel (all_reduce_norm.py, which says why it is safe): two halves of FUSED_HALF_BYTES
used by alternate calls (by the parity of the caller's `index`), then the flags, one int32 per
(row, rank), zeroed at allocation. Rows up to FUSED_MAX_ROWS whose bytes fit a half take it;
the self-check also compares it against NCCL followed by the same arithmetic in PyTorch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

KiB, MiB = 1 << 10, 1 << 20
# Largest message through symmetric memory, by world size (also the buffer's size); larger
# ones (prefill chunks) go to NCCL (benchmarks/DECISIONS.md, "Its limits at two ranks").
MAX_BYTES = {2: 8 * MiB, 4: 8 * MiB, 8: 8 * MiB}
# One-shot up to this size, two-shot above (at 2 ranks the measured crossover).
ONE_SHOT_MAX_BYTES = {2: 1 * MiB, 4: 256 * KiB, 8: 128 * KiB}
DTYPES = (torch.bfloat16, torch.float32)
# The fused all-reduce + residual add + RMSNorm: rows per call at most, and bytes per half.
FUSED_MAX_ROWS = 512
FUSED_HALF_BYTES = 4 * MiB  # 512 bfloat16 rows of hidden size up to 4096
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ONE_SHOT, TWO_SHOT, NCCL = "one_shot", "two_shot", "nccl"


def algorithm(x: torch.Tensor, max_bytes: int, one_shot_max_bytes: int) -> str:
    """ONE_SHOT, TWO_SHOT or NCCL for summing `x` (the routing rule of the module docstring)."""
    nbytes = x.numel() * x.element_size()
    if (
        x.dtype not in DTYPES
        or not x.is_contiguous()
        or (x.storage_offset() * x.element_size()) % 16
        or nbytes == 0
        or nbytes % 4
        or nbytes > max_bytes
    ):
        return NCCL
    return ONE_SHOT if nbytes <= one_shot_max_bytes else TWO_SHOT


class CustomAllReduce:
    """Sums over the default process group through a symmetric-memory buffer of `max_bytes`.

    Built in two steps so that every rank can agree between them (see `create`): the
    constructor allocates, `rendezvous()` (collective) maps the peers' buffers."""

    def __init__(
        self,
        device: torch.device,
        max_bytes: int | None = None,
        one_shot_max_bytes: int | None = None,
        fused_norm: bool = False,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.get_world_size()
        if world not in MAX_BYTES:
            raise RuntimeError(f"world size {world} is not supported (2, 4 or 8 only)")
        for name in ("one_shot_all_reduce_out", "two_shot_all_reduce_"):
            if not hasattr(torch.ops.symm_mem, name):
                raise RuntimeError(f"torch {torch.__version__} has no symm_mem.{name}")
        self.max_bytes = MAX_BYTES[world] if max_bytes is None else max_bytes
        self.one_shot_max_bytes = (
            ONE_SHOT_MAX_BYTES[world] if one_shot_max_bytes is None else one_shot_max_bytes
        )
        if self.max_bytes <= 0 or self.max_bytes % 16:
            raise ValueError(f"max_bytes must be a positive multiple of 16, not {self.max_bytes}")
        self.group_name = dist.group.WORLD.group_name
        self.rank = dist.get_rank()
        self.fused_norm = fused_norm
        # [max_bytes: the torch kernels' buffer][two fused halves][fused flags]
        self._flags_at = self.max_bytes + 2 * FUSED_HALF_BYTES
        total = self._flags_at + FUSED_MAX_ROWS * world * 4 if fused_norm else self.max_bytes
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        if fused_norm:
            self.buffer[self._flags_at :].zero_()  # before any peer may signal (see create)
            torch.cuda.synchronize(device)
        self.handle = None
        self._fused_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None
        ops = torch.ops.symm_mem
        # Present in recent torch only; otherwise a copy and the plain variant.
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self._two_shot_out = getattr(ops, "two_shot_all_reduce_out", None)

    def rendezvous(self) -> None:
        """Map every peer's buffer (a collective call: every rank, once)."""
        import torch.distributed._symmetric_memory as symm_mem

        if torch.__version__ < (2, 11):  # later versions resolve the group by name themselves
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if self.fused_norm:
            bases = list(self.handle.buffer_ptrs)
            dev = self.buffer.device
            self._fused_ptrs = (
                torch.tensor([b + self.max_bytes for b in bases], dtype=torch.int64, device=dev),
                torch.tensor([b + self._flags_at for b in bases], dtype=torch.int64, device=dev),
            )

    def algorithm(self, x: torch.Tensor) -> str:
        return algorithm(x, self.max_bytes, self.one_shot_max_bytes)

    def all_reduce(self, x: torch.Tensor, algo: str | None = None) -> torch.Tensor:
        """Sum `x` over the ranks in place by `algo` (default: `algorithm(x)`, which must
        not be NCCL: the caller routes those)."""
        algo = algo or self.algorithm(x)
        flat = x.view(-1)
        buf = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        ops, name = torch.ops.symm_mem, self.group_name
        if algo == ONE_SHOT:
            if self._one_shot_copy is not None:
                self._one_shot_copy(buf, flat, "sum", name, flat)
            else:
                buf.copy_(flat)
                ops.one_shot_all_reduce_out(buf, "sum", name, flat)
        elif algo == TWO_SHOT:
            buf.copy_(flat)
            if self._two_shot_out is not None:
                self._two_shot_out(buf, "sum", name, flat)
            else:
                ops.two_shot_all_reduce_(buf, "sum", name)
                flat.copy_(buf)
        else:
            raise ValueError(f"cannot all-reduce {x.dtype} {tuple(x.shape)} by {algo}")
        return x

    def can_fuse_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether `all_reduce_add_rms_norm` takes these (the same answer on every rank)."""
        return (
            self._fused_ptrs is not None
            and residual is not None
            and x.dim() == 2
            and x.dtype in FUSED_DTYPES
            and 0 < x.shape[0] <= FUSED_MAX_ROWS
            and x.numel() * x.element_size() <= FUSED_HALF_BYTES
            and x.stride(1) == 1
            and residual.stride(1) == 1
        )

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        index: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """rms_norm(sum over ranks of x + residual) and the new residual (written into
        `residual`), in one kernel; `index` (any int, consecutive calls alternating parity)
        picks the buffer half. Only where `can_fuse_norm`."""
        from llm_inference.distributed.all_reduce_norm import all_reduce_add_rms_norm

        if not self.can_fuse_norm(x, residual):  # a call past a half would corrupt the flags
            raise ValueError(f"{tuple(x.shape)} {x.dtype} does not fit the fused all-reduce")
        buf_ptrs, flag_ptrs = self._fused_ptrs
        offset = (index & 1) * (FUSED_HALF_BYTES // x.element_size())
        return all_reduce_add_rms_norm(
            x, residual, weight, eps, buf_ptrs, flag_ptrs, self.rank, offset
        )

    def close(self) -> None:
        self.handle = None
        self.buffer = None
        self._fused_ptrs = None


def _verify(comm, device: torch.device) -> str:
    """Run one all-reduce of each dtype, at the smallest and largest routed sizes, through
    `comm` and through NCCL: '' when they agree, else the first difference. Small integers:
    every sum is exact in every dtype, so the results must be equal. Every rank runs every
    case (the same collectives in the same order) whatever it finds."""
    rank = dist.get_rank()
    problems = []
    for dtype in DTYPES:
        itemsize = torch.empty((), dtype=dtype).element_size()
        for nbytes in sorted({min(64 * KiB, comm.max_bytes), comm.max_bytes}):
            n = nbytes // itemsize
            x = ((torch.arange(n, device=device) * (rank + 1)) % 13 - 6).to(dtype)
            algo = comm.algorithm(x)
            if algo == NCCL:  # the same on every rank
                problems.append(f"{n} x {dtype} would not be routed to it")
                continue
            ref = x.clone()
            dist.all_reduce(ref)
            comm.all_reduce(x)
            if not torch.equal(x, ref):
                bad = int((x != ref).sum())
                problems.append(
                    f"{algo} all-reduce of {n} x {dtype} differs from NCCL at {bad} elements"
                )
    if getattr(comm, "fused_norm", False):
        problems += _verify_fused_norm(comm, device)
    return problems[0] if problems else ""


def _verify_fused_norm(comm, device: torch.device) -> list[str]:
    """The fused all-reduce + add + RMSNorm against NCCL and the same arithmetic in PyTorch,
    both buffer halves, one row and the most rows, every fused dtype, each call's values new
    (stale rows would show): small integers, so the sums and the new residual are exact; the
    normalized output within rounding."""
    rank, problems, calls = dist.get_rank(), [], 0
    for dtype in FUSED_DTYPES:
        hidden = 1024
        rows = min(FUSED_MAX_ROWS, FUSED_HALF_BYTES // (hidden * dtype.itemsize))
        for n in (1, rows):
            grid = torch.arange(n * hidden, device=device).view(n, hidden)
            x = ((grid * (rank + 1) + calls) % 7 - 3).to(dtype)
            residual = ((grid + calls) % 5 - 2).to(dtype)
            weight = torch.ones(hidden, dtype=dtype, device=device)
            if not comm.can_fuse_norm(x, residual):
                problems.append(f"{n} x {hidden} {dtype} would not be fused")
                continue
            summed = x.clone()
            dist.all_reduce(summed)
            ref_res = (summed.float() + residual.float()).to(dtype)
            h = ref_res.float()
            ref = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5)).to(dtype)
            out, res = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-5, calls)
            calls += 1  # consecutive calls alternate halves
            if not (torch.equal(res, ref_res) and torch.allclose(out, ref, rtol=1e-2, atol=1e-2)):
                problems.append(f"fused all-reduce + RMSNorm of {n} x {hidden} {dtype} differs")
    return problems


def _failures(reason: str) -> list[tuple[int, str]]:
    """Every rank's (rank, reason) for those that failed (a collective call)."""
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return [(r, why) for r, why in enumerate(reasons) if why]


def _error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def create(
    device: torch.device, impl=CustomAllReduce, fused_norm: bool = False
) -> CustomAllReduce | None:
    """Set up and check the custom all-reduce on every rank of the default group (a collective
    call, right after the group exists). Returns it, or None on every rank when any rank
    failed, after rank 0 printed one line naming the first failure; with `fused_norm`, a
    failure first retries without it. `impl` is for tests.

    The ranks agree after each step (allocate, rendezvous, check), so that a rank that failed
    one is not waited for by the others in the next step's collectives. (Within the check, a
    custom all-reduce that raised on one rank only would still leave the others waiting; its
    errors come from the arguments, the same on every rank.)"""
    comm = None
    for step in ("allocate", "rendezvous", "check"):
        reason = ""
        try:
            if step == "allocate":
                comm = impl(device, fused_norm=fused_norm) if fused_norm else impl(device)
            elif step == "rendezvous":
                comm.rendezvous()
            else:
                reason = _verify(comm, device)
        except Exception as e:
            reason = f"{step}: {_error(e)}"
        failed = _failures(reason)
        if failed:
            break
    else:
        return comm
    if comm is not None:
        comm.close()
    rank, why = failed[0]
    if fused_norm:  # the plain custom all-reduce may still pass (every rank takes this branch)
        if dist.get_rank() == 0:
            print(f"llm_inference: fused all-reduce + RMSNorm off (rank {rank}: {why})",
                  file=sys.stderr, flush=True)  # fmt: skip
        return create(device, impl)
    if dist.get_rank() == 0:
        print(
            f"llm_inference: custom all-reduce off, NCCL for every all-reduce (rank {rank}: {why})",
            file=sys.stderr,
            flush=True,
        )
    return None
