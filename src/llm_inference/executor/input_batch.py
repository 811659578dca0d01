"""The worker's persistent per-request state, kept in step with SchedulerOutput diffs, and the
step inputs built from it.

`InputBatch` gives each request a row for as long as the worker holds it: its token ids
(prompt then outputs) in `token_ids[row]`, its block table in `block_table[row]`, and its
sampling inputs. `apply(scheduler_output)` drops finished and preempted rows, adds new
requests and appends the tokens and blocks sent since (see core/outputs.py).

`prepare(scheduler_output, buffers)` then writes the step's flat inputs with a few vectorized
numpy operations into `buffers`' host arrays (pinned on CUDA), so that one copy per array
group moves them to the device (the sampler's, `StepArrays.sampling`, by sample/staging.py):

    T tokens, S sequences in batch order, token t of sequence s at position p:
    input_ids[t] = token_ids[row_s, p]; positions[t] = p;
    slot_mapping[t] = block_table[row_s, p // block_size] * block_size + p % block_size
    query_start_loc[s] = first token of s; seq_lens[s] = computed + scheduled tokens of s
    seq_order: the sequences by seq_lens, longest first (the decode kernel's dispatch order)
    logits_indices: the last token of every sequence whose chunk reaches its known tokens.

With async scheduling a sequence may be scheduled one token past what the worker holds: that
token is the sample of the step still in flight, which the model runner copies from the
device into `input_ids` (its "placeholder"); the host value there is stale.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from llm_inference.config import cdiv
from llm_inference.core.outputs import SchedulerOutput
from llm_inference.layers.attention import StepBuffers
from llm_inference.sample.staging import SamplingArrays, SamplingFlags, SamplingRows

T = TypeVar("T", torch.Tensor, np.ndarray)


@dataclass
class StepInputs:
    """Sizes and host-side values of one prepared step (the arrays live in the buffers)."""

    request_ids: list[str]  # batch order
    num_tokens: int  # T
    num_seqs: int  # S
    max_query_len: int  # the longest sequence's scheduled tokens
    max_seq_len: int  # the longest sequence's tokens once this step ran
    block_width: int  # columns of the block table the step needs
    sample_rows: list[int]  # batch positions of the sequences that need a sample
    num_outputs: list[int]  # per sample row: output tokens before this sample
    # Async scheduling: tokens whose id is a sample still on the device (the last token of
    # their sequence): their flat indices (sources: the buffers' `placeholder_src`).
    placeholder_tokens: list[int]
    sample_batch_rows: np.ndarray | None = None  # input-batch rows of the sample rows
    # Placeholder i is flat token i and the last step's sample i (a decode step of the same
    # sequences in the same order, the steady state): one copy fills them all.
    placeholders_in_place: bool = False
    # Set when `prepare` staged the sampling inputs into the buffers (`StepArrays.sampling`):
    # every sample row on SamplingPath.STAGED; else None.
    sampling: SamplingFlags | None = None
    # prompt_logprobs: per request that asked and runs prompt tokens here, (request id, first
    # prompt position, flat token indices, the prompt tokens that follow them, k)
    prompt_logprobs: list[tuple[str, int, np.ndarray, np.ndarray, int]] | None = None


@dataclass
class StepArrays(Generic[T]):
    """A step's flat inputs (see the module docstring), each at a fixed offset of the input
    buffers' one int32 array: device tensors, or the numpy views of a host copy. Per token
    (`max_tokens` entries): input_ids, positions, slot_mapping; per sequence (`max_seqs`):
    the rest, query_start_loc one more."""

    input_ids: T
    positions: T
    slot_mapping: T  # -1: write no KV (padding)
    query_start_loc: T
    seq_lens: T
    seq_order: T  # the sequences by seq_lens, longest first
    logits_indices: T  # per sample row: its flat token index
    placeholder_dst: T  # per placeholder: its flat token index,
    placeholder_src: T  # and its row in the last step's sampled tokens
    sampling: SamplingArrays[T]  # per sample row: the sampler's staged inputs


class InputBuffers:
    """The step's inputs (`StepArrays`) at fixed offsets of one int32 device array, plus a
    block table of fixed width: CUDA graphs replay from these addresses. `dev` holds the
    device views, `np` the numpy views of the host arrays `prepare` fills.

    `stage()` hands out host arrays for the next step: on CUDA the next of STAGES persistent
    pinned copies, in turn, each reused only once the copy that last read it has run (an event
    recorded after it). A step can thus be prepared while the previous one is still being
    copied. `to_device` copies the whole flat array and the step's corner of the table
    (`table_rows`: packed in the host stage, then spread into the table by the device: a
    strided corner copied from the host would pass through unpinned memory)."""

    STAGES = 3
    PER_TOKEN = ("input_ids", "positions", "slot_mapping")

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device) -> None:
        self.device = torch.device(device)
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        names = [f.name for f in fields(StepArrays) if f.name != "sampling"]
        names += [f.name for f in fields(SamplingArrays)]
        self.sizes = {
            name: max_tokens if name in self.PER_TOKEN else max_seqs + (name == "query_start_loc")
            for name in names
        }
        total = sum(self.sizes.values())
        self.on_host = self.device.type == "cpu"
        self.dev_flat = torch.zeros(total, dtype=torch.int32, device=device)
        self.dev_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        # the step's corner of the table, packed as the host stage holds it
        self.dev_packed = None if self.on_host else torch.empty_like(self.dev_table).view(-1)
        self.dev: StepArrays[torch.Tensor] = self._cut(self.dev_flat, torch.float32)
        self.attention = StepBuffers(
            slot_mapping=self.dev.slot_mapping,
            query_start_loc=self.dev.query_start_loc,
            seq_lens=self.dev.seq_lens,
            block_table=self.dev_table,
            seq_order=self.dev.seq_order,
        )
        # (host flat array, host table, their numpy views, the event after their last copy);
        # on CUDA a stage's table is flat: `table_rows` packs the step's corner in it
        stages = [(self.dev_flat, self.dev_table)] if self.on_host else [
            (torch.empty(total, dtype=torch.int32, pin_memory=True),
             torch.empty(max_seqs * max_blocks, dtype=torch.int32, pin_memory=True))
            for _ in range(self.STAGES)
        ]  # fmt: skip
        self._stages = [(flat, table, self._cut(flat.numpy(), np.float32), table.numpy(), None)
                        for flat, table in stages]  # fmt: skip
        self._next = 0
        self.stage()

    def _cut(self, flat, float32):
        """`StepArrays` of consecutive slices of `flat` (float fields viewed as `float32`)."""
        parts, offset = {}, 0
        for name, size in self.sizes.items():
            part = flat[offset : offset + size]
            parts[name] = part.view(float32) if name in SamplingArrays.FLOATS else part
            offset += size
        sampling = SamplingArrays(**{f.name: parts.pop(f.name) for f in fields(SamplingArrays)})
        return StepArrays(**parts, sampling=sampling)

    def stage(self) -> None:
        """Host arrays (`np`, `np_table`) for the next step's inputs, free to overwrite."""
        self._current = self._next
        self.host_flat, self.host_table, self.np, self.np_table, copied = self._stages[self._next]
        self._next = (self._next + 1) % len(self._stages)
        if copied is not None:
            copied.synchronize()  # the copy that last read these arrays has run

    def table_rows(self, num_seqs: int, width: int) -> np.ndarray:
        """[num_seqs, width]: where the step's block table is written: on CUDA packed at the
        start of the host stage's table (one contiguous copy), on the CPU the table's corner."""
        if self.on_host:
            return self.np_table[:num_seqs, :width]
        return self.np_table[: num_seqs * width].reshape(num_seqs, width)

    def pad_decode(self, num_seqs: int, padded: int) -> None:
        """Fill rows [num_seqs, padded) of a one-token-per-sequence step as harmless padding:
        no KV write (slot -1), one query token attending to one cached token."""
        b = self.np
        b.input_ids[num_seqs:padded] = 0
        b.positions[num_seqs:padded] = 0
        b.slot_mapping[num_seqs:padded] = -1
        b.query_start_loc[num_seqs : padded + 1] = np.arange(num_seqs, padded + 1)
        b.seq_lens[num_seqs:padded] = 1
        b.seq_order[num_seqs:padded] = np.arange(num_seqs, padded)  # after every real one

    def pad_mixed(self, num_tokens: int, num_seqs: int, padded_tokens: int) -> None:
        """Pad a step of T = `num_tokens` tokens and S = `num_seqs` sequences to a captured
        mixed step of `padded_tokens` tokens and `max_seqs` sequences: tokens [T, padded) are
        token 0 at position 0 and write no KV (slot -1); sequences [S, max_seqs) own no query
        rows (query_start_loc = T from S on) and have seq_lens 0. Attention never reads a
        zero-length sequence's block table or seq_len, nor any row past query_start_loc[S]."""
        b = self.np
        b.input_ids[num_tokens:padded_tokens] = 0
        b.positions[num_tokens:padded_tokens] = 0
        b.slot_mapping[num_tokens:padded_tokens] = -1
        b.query_start_loc[num_seqs : self.max_seqs + 1] = num_tokens
        b.seq_lens[num_seqs : self.max_seqs] = 0

    def to_device(self, num_seqs: int, block_width: int) -> None:
        if self.on_host:
            return
        self.dev_flat.copy_(self.host_flat, non_blocking=True)
        n = num_seqs * block_width
        packed = self.dev_packed[:n]
        packed.copy_(self.host_table[:n], non_blocking=True)
        self.dev_table[:num_seqs, :block_width].copy_(packed.view(num_seqs, block_width))
        flat, table, views, table_view, copied = self._stages[self._current]
        copied = copied or torch.cuda.Event()
        copied.record()
        self._stages[self._current] = (flat, table, views, table_view, copied)


class InputBatch:
    """Per-request worker state, one row each; see the module docstring."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int = 1 << 30
    ) -> None:
        self.block_size = block_size
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        max_blocks = cdiv(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_known = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs held
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.sampling = SamplingRows(max_num_reqs, vocab_size)  # the sampler's inputs per row
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.prompt_lp = np.full(max_num_reqs, -1, dtype=np.int64)  # prompt_logprobs, -1: off
        # Row of each request's token in the last sampled tokens (on the device), -1 if none.
        self.prev_sample = np.full(max_num_reqs, -1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids + so.preempted_request_ids:
            self._remove(rid)
        for new in so.new_requests:
            if new.request_id in self.rows:
                raise ValueError(f"request {new.request_id!r} sent as new twice")
            if not self.free_rows:
                raise RuntimeError(f"more than {self.max_num_reqs} requests in the input batch")
            row = self.free_rows.pop()
            self.rows[new.request_id] = row
            params = new.sampling_params
            self.sampling.add(row, params, new.prompt_token_ids)
            self.prompt_len[row] = len(new.prompt_token_ids)
            self.prompt_lp[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
            self.prev_sample[row] = -1
            self.num_known[row] = self.num_blocks[row] = 0
            self._append_tokens(row, new.prompt_token_ids)
            self._append_tokens(row, new.output_token_ids, outputs=True)
            self._append_blocks(row, new.block_ids)
            self.num_computed[row] = new.num_computed_tokens
        # The cached requests (each at most once a step): one new token each, the common case
        # of a decode step, is written for all of them at once.
        cached = so.cached_requests
        rows = [self.rows[rid] for rid in cached.request_ids]
        one_rows, one_tokens = [], []
        output_ids = self.sampling.output_ids
        for row, ids, block_ids in zip(rows, cached.new_token_ids, cached.new_block_ids):
            if len(ids) == 1:
                one_rows.append(row)
                one_tokens.append(ids[0])
                output_ids[row].append(ids[0])
            elif ids:
                self._append_tokens(row, ids, outputs=True)
            if block_ids:
                self._append_blocks(row, block_ids)
        if one_rows:
            at = np.array(one_rows)
            start = self.num_known[at]
            if start.max() >= self.max_model_len:
                raise ValueError(f"a request grew past max_model_len={self.max_model_len}")
            self.token_ids[at, start] = one_tokens
            self.num_known[at] = start + 1
        if rows:
            self.num_computed[rows] = cached.num_computed_tokens

    def set_sampled(self, sample_batch_rows: np.ndarray) -> None:
        """The step just launched sampled these rows, in order: their tokens are on the device
        at those indices, and no other row's token is."""
        self.prev_sample.fill(-1)
        self.prev_sample[sample_batch_rows] = np.arange(len(sample_batch_rows))

    def _remove(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.sampling.remove(row)
            self.prev_sample[row] = -1
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
            self.sampling.output_ids[row].extend(ids)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def prepare(self, so: SchedulerOutput, buffers: InputBuffers) -> StepInputs:
        """Write the step's flat inputs into `buffers`' host arrays; see the module docstring."""
        buffers.stage()
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
        known = self.num_known[rows]
        if np.any(seq_lens > known + 1):
            raise ValueError("a step schedules tokens the worker does not hold")
        # A sequence scheduled one token past what it holds takes its last sampled token,
        # still on the device, as that token (async scheduling).
        ph_seqs = np.flatnonzero(seq_lens == known + 1)
        ph_src = self.prev_sample[rows[ph_seqs]]
        if len(ph_src) and ph_src.min() < 0:
            missing = [request_ids[i] for i in ph_seqs[ph_src < 0]]
            raise RuntimeError(f"no sampled token of requests {missing} is on the device")
        sample = np.flatnonzero(seq_lens >= known)
        logits_indices = cu[1:][sample] - 1
        width = cdiv(int(seq_lens.max()), bs)

        b = buffers.np
        b.input_ids[:total] = self.token_ids[token_rows, positions]  # placeholders: stale
        b.positions[:total] = positions
        b.slot_mapping[:total] = self.block_table[token_rows, positions // bs] * bs + positions % bs
        b.query_start_loc[: num_seqs + 1] = cu
        b.seq_lens[:num_seqs] = seq_lens
        b.seq_order[:num_seqs] = np.argsort(-seq_lens, kind="stable")  # longest first
        b.logits_indices[: len(sample)] = logits_indices
        buffers.table_rows(num_seqs, width)[:] = self.block_table[rows, :width]
        ph_dst = cu[1:][ph_seqs] - 1
        b.placeholder_dst[: len(ph_dst)] = ph_dst
        b.placeholder_src[: len(ph_dst)] = ph_src
        sample_rows = rows[sample]
        num_outputs = seq_lens[sample] - self.prompt_len[sample_rows]
        prompt_lps = None
        if (self.prompt_lp[rows] >= 0).any():
            prompt_lps = self._prompt_logprob_rows(request_ids, rows, starts, counts, cu)
        return StepInputs(
            request_ids=request_ids,
            num_tokens=total,
            num_seqs=num_seqs,
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            block_width=width,
            sample_rows=sample.tolist(),
            num_outputs=num_outputs.tolist(),
            placeholder_tokens=ph_dst.tolist(),
            # (ph_dst rises strictly, so ending at m - 1 means it is 0..m-1)
            placeholders_in_place=bool(len(ph_dst))
            and ph_dst[-1] == len(ph_dst) - 1
            and np.array_equal(ph_src, np.arange(len(ph_src))),
            sample_batch_rows=sample_rows,
            sampling=self.sampling.stage(sample_rows, num_outputs, b.sampling),
            prompt_logprobs=prompt_lps,
        )

    def _prompt_logprob_rows(self, request_ids, rows, starts, counts, cu) -> list | None:
        """StepInputs.prompt_logprobs: the step's prompt positions p < prompt_len - 1 (each
        predicts prompt token p + 1) of the requests that asked for prompt_logprobs."""
        found = []
        for i in np.flatnonzero(self.prompt_lp[rows] >= 0):
            row, start = rows[i], int(starts[i])
            end = min(start + int(counts[i]), int(self.prompt_len[row]) - 1)
            if end > start:
                flat = cu[i] + np.arange(end - start)
                targets = self.token_ids[row, start + 1 : end + 1].astype(np.int64)
                found.append((request_ids[i], start, flat, targets, int(self.prompt_lp[row])))
        return found or None
