"""Structured outputs on the device: a step's token bitmask, as the sampler applies it.

The engine core fills the bitmask (structured_output/manager.py) for the step's constrained
requests that sample, in batch order, and sends it to every rank with the SchedulerOutput (or
with the step's `sample_tokens` call, under async scheduling: executor/model_runner.py):
int32 words, bit v % 32 of word v // 32 allowing token v (xgrammar's layout). `GrammarMask`
is that bitmask on the device with the sample rows it constrains. Tokens outside the grammar
take -inf before anything else reads the logits (logprobs included, as vLLM masks the logits
before its sampler): the fused sampler does it as it reads them (kernels/sampling.py, a row
without a mask pays nothing), the PyTorch path with `apply_grammar` on its float32 copy, and
under tensor parallelism each rank on its vocabulary slice (sample/tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class GrammarMask:
    bitmask: torch.Tensor  # [M, ceil(V / 32)] int32: one row per constrained sample row
    rows: torch.Tensor  # [M] int32: those sample rows, rising
    row_index: torch.Tensor  # [R] int32: per sample row its bitmask row, -1 without one


class MaskStaging:
    """How the model runner builds a step's GrammarMask (`build`): `bitmask` row i constrains
    sample row `rows[i]` of a step of `num_rows`. The bitmask, row index and rows (int32) are
    packed into one host buffer, pinned on CUDA and reused from step to step, so that they go
    to the device in one copy without pinning new memory each step (the bitmask is 16 KB a row
    at a 128k vocabulary). The engine core's grammar manager may fill the bitmask in that
    buffer in the first place (`bitmask_buffer`, where the worker is in its process): then
    nothing is packed but the row index. Handing the buffer out or packing first waits for the
    last copy from it (it has run long before: a step's mask is built after the step before's
    tokens). On the CPU the buffer is plain memory and the copy a copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: torch.Tensor | None = None
        # one event, recorded after each copy (a new one per step cost as much as the copy)
        self.copied = torch.cuda.Event() if self.cuda else None

    @staticmethod
    def _layout(m: int, words: int, num_rows: int) -> tuple[int, int]:
        """(where the row index starts, the buffer's size) for m bitmask rows of `words` and a
        step of `num_rows` sample rows. The row index is 16-byte aligned, as a tensor of its own
        would be: Triton specializes a kernel on its pointers' alignment, so another would
        compile mid-run."""
        start = -(-m * words // 4) * 4
        return start, start + num_rows + m

    def _ready(self, size: int) -> np.ndarray:
        """The host buffer, at least `size` int32 long (grown with what it held), once the last
        copy from it is done."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.host is None or self.host.numel() < size:
            old, self.host = self.host, torch.empty(size, dtype=torch.int32, pin_memory=self.cuda)
            if old is not None:
                self.host[: old.numel()] = old
        return self.host.numpy()

    def bitmask_buffer(self, m: int, words: int, max_rows: int) -> np.ndarray:
        """[m, words] int32 in the host buffer, for a bitmask that `build` then sends without
        packing it (a step of at most `max_rows` sample rows)."""
        return self._ready(self._layout(m, words, max_rows)[1])[: m * words].reshape(m, words)

    def build(self, bitmask: np.ndarray, rows: list[int], num_rows: int) -> GrammarMask:
        if len(rows) != len(bitmask):
            raise ValueError(f"{len(bitmask)} bitmask rows for {len(rows)} constrained rows")
        m, words = bitmask.shape
        start, size = self._layout(m, words, num_rows)
        in_place = self.host is not None and bitmask.ctypes.data == self.host.data_ptr()
        # in place: `bitmask_buffer` readied the buffer already (for at most `max_rows`)
        ready = in_place and self.host.numel() >= size
        flat = self.host.numpy() if ready else self._ready(size)
        if not in_place:
            flat[: m * words] = bitmask.reshape(-1)
        index, sample_rows = flat[start : start + num_rows], flat[start + num_rows : size]
        sample_rows[:] = rows
        index.fill(-1)
        index[sample_rows] = np.arange(m, dtype=np.int32)
        dev = self.host[:size].to(self.device, non_blocking=True, copy=True)
        if self.cuda:
            self.copied.record()
        return GrammarMask(
            bitmask=dev[: m * words].view(m, words),
            rows=dev[start + num_rows :],
            row_index=dev[start : start + num_rows],
        )


def allowed_tokens(bitmask: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """[M, width] bool: whether token start + j is allowed by each bitmask row (tokens past the
    bitmask's are not). Unpacked byte by byte: one byte per token, not an int per token."""
    M, W = bitmask.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    # little-endian: byte b of word w holds tokens 32 w + 8 b ... 32 w + 8 b + 7, lowest bit first
    bits = (bitmask.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1
    bits = bits.view(M, 32 * W).view(torch.bool)[:, start : start + width]
    if bits.shape[1] < width:
        bits = torch.cat([bits, bits.new_zeros(M, width - bits.shape[1])], dim=1)
    return bits


def apply_grammar(logits: torch.Tensor, mask: GrammarMask, vocab_start: int = 0) -> torch.Tensor:
    """Set to -inf, in place, the logits of the tokens each constrained row's grammar does not
    allow; `logits` [R, width] column j is token vocab_start + j (a rank's vocabulary slice
    under tensor parallelism). Returns `logits`."""
    index = mask.rows.long()  # index_copy_ takes int64 only
    rows = logits.index_select(0, index)
    keep = allowed_tokens(mask.bitmask, vocab_start, logits.shape[1])
    logits.index_copy_(0, index, rows.masked_fill_(~keep, float("-inf")))
    return logits
