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
    seq_order: the sequences by seq_lens, longest first (the decode kernel's dispatch order)
    logits_indices: the last token of every sequence whose chunk reaches its known tokens.

With async scheduling a sequence may be scheduled one token past what the worker holds: that
token is the sample of the step still in flight, which the model runner copies from the
device into `input_ids` (its "placeholder"); the host value there is stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llm_inference.config import cdiv
from llm_inference.core.outputs import SchedulerOutput
from llm_inference.layers.attention import StepBuffers
from llm_inference.sample.metadata import noise_keys_np, seed_hash
from llm_inference.sampling_params import SamplingParams


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
    # Sampling inputs written into the buffers (`sample_*`) by `prepare`: set when no sample
    # row needs its token lists (penalties, min_tokens) or logprobs, else None.
    sampling: SamplingFlags | None = None
    # prompt_logprobs: per request that asked and runs prompt tokens here, (request id, first
    # prompt position, flat token indices, the prompt tokens that follow them, k)
    prompt_logprobs: list[tuple[str, int, np.ndarray, np.ndarray, int]] | None = None


@dataclass(frozen=True)
class SamplingFlags:
    """What the sampler must know on the host about the sample rows' parameters."""

    all_greedy: bool
    all_random: bool
    any_top_k: bool
    max_top_k: int  # 0 if no row has top-k
    any_top_p: bool
    any_min_p: bool


class InputBuffers:
    """The step's inputs at fixed offsets of one int32 device array, plus a block table of
    fixed width: CUDA graphs replay from these addresses.

    `stage()` hands out host arrays for the next step: on CUDA the next of STAGES persistent
    pinned copies, in turn, each reused only once the copy that last read it has run (an event
    recorded after it; with async scheduling at most one step is in flight, so the wait is
    for a copy two steps old, long done). A step can thus be prepared while the previous one is
    still being copied. `to_device` copies the whole flat array and the used corner of the
    table."""

    STAGES = 3

    SIZES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "seq_order",
             "logits_indices", "placeholder_dst", "placeholder_src",
             # per sample row: the sampler's inputs (the key's 32 bits; greedy 0/1; floats
             # stored as float32 bits)
             "sample_keys", "sample_top_k", "sample_greedy", "sample_temperature",
             "sample_top_p", "sample_min_p")  # fmt: skip
    FLOATS = ("sample_temperature", "sample_top_p", "sample_min_p")

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device) -> None:
        self.device = torch.device(device)
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        per_token = {"input_ids", "positions", "slot_mapping"}
        self.sizes = {
            name: max_tokens if name in per_token else max_seqs + (name == "query_start_loc")
            for name in self.SIZES
        }
        total = sum(self.sizes.values())
        self.on_host = self.device.type == "cpu"
        self.dev = torch.zeros(total, dtype=torch.int32, device=device)
        self.dev_table = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.views = self._cut(self.dev)
        for name in self.FLOATS:
            self.views[name] = self.views[name].view(torch.float32)
        self.attention = StepBuffers(
            slot_mapping=self.views["slot_mapping"],
            query_start_loc=self.views["query_start_loc"],
            seq_lens=self.views["seq_lens"],
            block_table=self.dev_table,
            seq_order=self.views["seq_order"],
        )
        # (host flat array, host table, their numpy views, the event after their last copy)
        stages = [(self.dev, self.dev_table)] if self.on_host else [
            (torch.empty(self.dev.shape, dtype=torch.int32, pin_memory=True),
             torch.empty(max_seqs, max_blocks, dtype=torch.int32, pin_memory=True))
            for _ in range(self.STAGES)
        ]  # fmt: skip
        self._stages = [(flat, table, self._numpy(flat), table.numpy(), None)
                        for flat, table in stages]  # fmt: skip
        self._next = 0
        self.stage()

    def _cut(self, flat):
        out, offset = {}, 0
        for name, size in self.sizes.items():
            out[name] = flat[offset : offset + size]
            offset += size
        return out

    def _numpy(self, flat: torch.Tensor) -> dict[str, np.ndarray]:
        views = {k: v.numpy() for k, v in self._cut(flat).items()}
        for name in self.FLOATS:
            views[name] = views[name].view(np.float32)
        return views

    def stage(self) -> None:
        """Host arrays (`np`, `np_table`) for the next step's inputs, free to overwrite."""
        self._current = self._next
        self.host, self.host_table, self.np, self.np_table, copied = self._stages[self._next]
        self._next = (self._next + 1) % len(self._stages)
        if copied is not None:
            copied.synchronize()  # the copy that last read these arrays has run

    def pad_decode(self, num_seqs: int, padded: int) -> None:
        """Fill rows [num_seqs, padded) of a one-token-per-sequence step as harmless padding:
        no KV write (slot -1), one query token attending to one cached token."""
        b = self.np
        b["input_ids"][num_seqs:padded] = 0
        b["positions"][num_seqs:padded] = 0
        b["slot_mapping"][num_seqs:padded] = -1
        b["query_start_loc"][num_seqs : padded + 1] = np.arange(num_seqs, padded + 1)
        b["seq_lens"][num_seqs:padded] = 1
        b["seq_order"][num_seqs:padded] = np.arange(num_seqs, padded)  # after every real one

    def pad_mixed(self, num_tokens: int, num_seqs: int, padded_tokens: int) -> None:
        """Pad a step of T = `num_tokens` tokens and S = `num_seqs` sequences to a captured
        mixed step of `padded_tokens` tokens and `max_seqs` sequences: tokens [T, padded) are
        token 0 at position 0 and write no KV (slot -1); sequences [S, max_seqs) own no query
        rows (query_start_loc = T from S on) and have seq_lens 0. Attention never reads a
        zero-length sequence's block table or seq_len, nor any row past query_start_loc[S]."""
        b = self.np
        b["input_ids"][num_tokens:padded_tokens] = 0
        b["positions"][num_tokens:padded_tokens] = 0
        b["slot_mapping"][num_tokens:padded_tokens] = -1
        b["query_start_loc"][num_seqs : self.max_seqs + 1] = num_tokens
        b["seq_lens"][num_seqs : self.max_seqs] = 0

    def to_device(self, num_seqs: int, block_width: int) -> None:
        if self.on_host:
            return
        self.dev.copy_(self.host, non_blocking=True)
        self.dev_table[:num_seqs, :block_width].copy_(
            self.host_table[:num_seqs, :block_width], non_blocking=True
        )
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
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        max_blocks = cdiv(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_known = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs held
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Sampling inputs per row. Arrays for every request (greedy rows hold neutral values;
        # top_k is vocab_size where off); Python lists for the rows that need token lists
        # (penalties, min_tokens), logprobs or logits processing (bias, allowed tokens, bad
        # words, choices) (`needs_lists`): the sampler's slow path.
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.prompt_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.output_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.greedy = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seed_hash = np.zeros(max_num_reqs, dtype=np.uint64)
        self.needs_lists = np.zeros(max_num_reqs, dtype=bool)
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
                raise RuntimeError(f"more than {len(self.params)} requests in the input batch")
            row = self.free_rows.pop()
            self.rows[new.request_id] = row
            self._set_sampling(row, new.sampling_params, len(new.prompt_token_ids))
            self.prompt_ids[row] = list(new.prompt_token_ids)
            self.output_ids[row] = []
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
        for row, ids, block_ids in zip(rows, cached.new_token_ids, cached.new_block_ids):
            if len(ids) == 1:
                one_rows.append(row)
                one_tokens.append(ids[0])
                self.output_ids[row].append(ids[0])
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

    def _set_sampling(self, row: int, p: SamplingParams, prompt_len: int) -> None:
        V = self.vocab_size
        greedy = p.greedy
        self.params[row] = p
        self.prompt_len[row] = prompt_len
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_k[row] = V if greedy or not 0 < p.top_k < V else p.top_k
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.seed_hash[row] = seed_hash(p.seed or 0)
        self.needs_lists[row] = (
            p.logprobs is not None or p.min_tokens > 0 or p.has_penalties or p.has_logit_bias
        )
        self.prompt_lp[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.prev_sample[row] = -1

    def set_sampled(self, sample_batch_rows: np.ndarray) -> None:
        """The step just launched sampled these rows, in order: their tokens are on the device
        at those indices, and no other row's token is."""
        self.prev_sample.fill(-1)
        self.prev_sample[sample_batch_rows] = np.arange(len(sample_batch_rows))

    def _remove(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.params[row] = None
            self.prev_sample[row] = -1
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
        b["input_ids"][:total] = self.token_ids[token_rows, positions]  # placeholders: stale
        b["positions"][:total] = positions
        b["slot_mapping"][:total] = (
            self.block_table[token_rows, positions // bs] * bs + positions % bs
        )
        b["query_start_loc"][: num_seqs + 1] = cu
        b["seq_lens"][:num_seqs] = seq_lens
        b["seq_order"][:num_seqs] = np.argsort(-seq_lens, kind="stable")  # longest first
        b["logits_indices"][: len(sample)] = logits_indices
        buffers.np_table[:num_seqs, :width] = self.block_table[rows, :width]
        ph_dst = cu[1:][ph_seqs] - 1
        b["placeholder_dst"][: len(ph_dst)] = ph_dst
        b["placeholder_src"][: len(ph_dst)] = ph_src
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
            sampling=self._stage_sampling(sample_rows, num_outputs, b),
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

    def _stage_sampling(self, rows: np.ndarray, num_outputs: np.ndarray, b) -> SamplingFlags | None:
        """The sampler's per-row inputs for `rows` into the host buffers `b` (noise keys from
        each row's seed and output count); None when a row needs the slow path."""
        n = len(rows)
        if not n or self.needs_lists[rows].any():
            return None
        greedy, top_k = self.greedy[rows], self.top_k[rows]
        b["sample_keys"][:n] = noise_keys_np(self.seed_hash[rows], num_outputs).view(np.int32)
        b["sample_greedy"][:n] = greedy
        b["sample_top_k"][:n] = top_k
        b["sample_temperature"][:n] = self.temperature[rows]
        top_p = b["sample_top_p"][:n]
        top_p[:] = self.top_p[rows]
        min_p = b["sample_min_p"][:n]
        min_p[:] = self.min_p[rows]
        num_greedy = int(greedy.sum())
        on_k = top_k < self.vocab_size
        return SamplingFlags(
            all_greedy=num_greedy == n,
            all_random=num_greedy == 0,
            any_top_k=bool(on_k.any()),
            max_top_k=int(top_k[on_k].max()) if on_k.any() else 0,
            any_top_p=bool((top_p < 1.0).any()),
            any_min_p=bool((min_p > 0.0).any()),
        )
