"""The worker's persistent per-request state, kept in step with SchedulerOutput diffs, and the
step inputs built from it.

`InputBatch` gives each request a row for as long as the worker holds it: its token ids
(prompt then outputs) in `token_ids[row]`, its block table in `block_table[row]`, and its
sampling inputs. `apply(scheduler_output)` drops finished and preempted rows, adds new
requests and appends the tokens and blocks sent since (see core/outputs.py).

`prepare(scheduler_output, buffers)` then writes the step's flat inputs with a few vectorized
numpy operations into `buffers`' host arrays (pinned on CUDA), so that one copy per array
group moves them to the device:

    T tokens, S sequences in batch order, token t of sequence s at position p:
    input_ids[t] = token_ids[row_s, p]; positions[t] = p;
    slot_mapping[t] = block_table[row_s, p // block_size] * block_size + p % block_size
    query_start_loc[s] = first token of s; seq_lens[s] = computed + scheduled tokens of s
    logits_indices: the last token of every sequence whose chunk reaches its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llm_inference.config import cdiv
from llm_inference.core.outputs import SchedulerOutput
from llm_inference.layers.attention import StepBuffers
from llm_inference.sampling_params import SamplingParams


@dataclass
class StepInputs:
    """Sizes and host-side values of one prepared step (the arrays live in the buffers)."""

    request_ids: list[str]  # batch order
    num_tokens: int  # T
    query_start_loc: list[int]  # [S + 1]
    seq_lens: list[int]  # [S]
    block_width: int  # columns of the block table the step needs
    sample_rows: list[int]  # batch positions of the sequences that need a sample
    logits_indices: list[int]  # their last token in the flat batch


class InputBuffers:
    """One host int32 array (pinned on CUDA) and its device twin, cut into the step's inputs
    at fixed offsets, plus a block table of fixed width; `to_device` copies them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        sizes = {
            "input_ids": max_tokens,
            "positions": max_tokens,
            "slot_mapping": max_tokens,
            "query_start_loc": max_seqs + 1,
            "seq_lens": max_seqs,
            "logits_indices": max_seqs,
        }
        total = sum(sizes.values())
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.host_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, pin_memory=pin)
        on_host = self.device.type == "cpu"
        self.dev = self.host if on_host else torch.zeros(total, dtype=torch.int32, device=device)
        self.dev_table = (
            self.host_table if on_host else torch.zeros_like(self.host_table, device=device)
        )
        self.np: dict[str, np.ndarray] = {}
        self.views: dict[str, torch.Tensor] = {}
        offset = 0
        host_np = self.host.numpy()
        for name, size in sizes.items():
            self.np[name] = host_np[offset : offset + size]
            self.views[name] = self.dev[offset : offset + size]
            offset += size
        self.np_table = self.host_table.numpy()
        self.attention = StepBuffers(
            slot_mapping=self.views["slot_mapping"],
            query_start_loc=self.views["query_start_loc"],
            seq_lens=self.views["seq_lens"],
            block_table=self.dev_table,
        )

    def pad_decode(self, num_seqs: int, padded: int) -> None:
        """Fill rows [num_seqs, padded) of a one-token-per-sequence step as harmless padding:
        no KV write (slot -1), one query token attending to one cached token."""
        b = self.np
        b["input_ids"][num_seqs:padded] = 0
        b["positions"][num_seqs:padded] = 0
        b["slot_mapping"][num_seqs:padded] = -1
        b["query_start_loc"][num_seqs : padded + 1] = np.arange(num_seqs, padded + 1)
        b["seq_lens"][num_seqs:padded] = 1

    def to_device(self, num_seqs: int, block_width: int) -> None:
        """Copy the step's inputs (the whole flat array, and the used corner of the table)."""
        if self.dev is self.host:
            return
        self.dev.copy_(self.host, non_blocking=True)
        self.dev_table[:num_seqs, :block_width].copy_(
            self.host_table[:num_seqs, :block_width], non_blocking=True
        )


class InputBatch:
    """Per-request worker state, one row each; see the module docstring."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = cdiv(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_known = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs held
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Sampling inputs per row (Python lists: the sampler builds its metadata from them).
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.prompt_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.output_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids + so.preempted_request_ids:
            self._remove(rid)
        for new in so.new_requests:
            if new.request_id in self.rows:
                raise ValueError(f"request {new.request_id!r} sent as new twice")
            if not self.free_rows:
                raise RuntimeError(f"more than {len(self.params)} requests in the input batch")
            row = self.free_rows.pop()
            self.rows[new.request_id] = row
            self.params[row] = new.sampling_params
            self.prompt_ids[row] = list(new.prompt_token_ids)
            self.output_ids[row] = []
            self.num_known[row] = self.num_blocks[row] = 0
            self._append_tokens(row, new.prompt_token_ids)
            self._append_tokens(row, new.output_token_ids, outputs=True)
            self._append_blocks(row, new.block_ids)
            self.num_computed[row] = new.num_computed_tokens
        for cached in so.cached_requests:
            row = self.rows[cached.request_id]
            self._append_tokens(row, cached.new_token_ids, outputs=True)
            self._append_blocks(row, cached.new_block_ids)
            self.num_computed[row] = cached.num_computed_tokens

    def _remove(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.params[row] = None
            self.prompt_ids[row] = self.output_ids[row] = []
            self.free_rows.append(row)

    def _append_tokens(self, row: int, ids: list[int], outputs: bool = False) -> None:
        if not ids:
            return
        start = int(self.num_known[row])
        if start + len(ids) > self.max_model_len:
            raise ValueError(f"a request grew past max_model_len={self.max_model_len}")
        self.token_ids[row, start : start + len(ids)] = ids
        self.num_known[row] = start + len(ids)
        if outputs:
            self.output_ids[row].extend(ids)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def prepare(self, so: SchedulerOutput, buffers: InputBuffers) -> StepInputs:
        """Write the step's flat inputs into `buffers`' host arrays; see the module docstring."""
        request_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((self.rows[r] for r in request_ids), np.int64, len(request_ids))
        counts = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(request_ids))
        num_seqs, bs = len(rows), self.block_size
        starts = self.num_computed[rows]
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), counts)
        positions = starts[seq_of_token] + np.arange(total) - cu[:-1][seq_of_token]
        token_rows = rows[seq_of_token]
        seq_lens = starts + counts
        if np.any(seq_lens > self.num_known[rows]):
            raise ValueError("a step schedules tokens the worker does not hold")
        sample = np.flatnonzero(seq_lens == self.num_known[rows])
        logits_indices = cu[1:][sample] - 1
        width = cdiv(int(seq_lens.max()), bs)

        b = buffers.np
        b["input_ids"][:total] = self.token_ids[token_rows, positions]
        b["positions"][:total] = positions
        b["slot_mapping"][:total] = (
            self.block_table[token_rows, positions // bs] * bs + positions % bs
        )
        b["query_start_loc"][: num_seqs + 1] = cu
        b["seq_lens"][:num_seqs] = seq_lens
        b["logits_indices"][: len(sample)] = logits_indices
        buffers.np_table[:num_seqs, :width] = self.block_table[rows, :width]
        return StepInputs(
            request_ids=request_ids,
            num_tokens=total,
            query_start_loc=cu.tolist(),
            seq_lens=seq_lens.tolist(),
            block_width=width,
            sample_rows=sample.tolist(),
            logits_indices=logits_indices.tolist(),
        )
