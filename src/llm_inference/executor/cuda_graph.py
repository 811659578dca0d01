"""CUDA graphs for decode steps and for mixed steps (steps with prompt tokens).

The model's forward is captured once per bucket, reading the model runner's persistent input
buffers through the attention backend's static metadata (`AttentionBackend.graph_metadata`); a
step writes its inputs into those buffers, pads them to the smallest bucket that fits, and
replays that bucket's graph. Logits are then taken at `logits_indices` of the graph's hidden
output, outside the graph, as for an eager step.

Decode steps (one token per sequence, max_query_len 1) use batch-size buckets (1, 2, 4, 8, 16,
32, 48, ... up to `max_num_seqs`) and the split-K decode kernel. Padding rows write no KV
(slot -1) and attend to one cached token: their outputs are ignored.

Mixed steps (max_query_len > 1) use token-count buckets T_b, each captured with num_seqs =
`max_num_seqs` and max_query_len = T_b: the decode kernel over `max_num_seqs` sequences (it
takes the one-row ones) and the tiled kernel, whose grid, T_b // BLOCK_Q + max_num_seqs
programs, covers any step of at most T_b tokens, with the tile
`default_tiles` gives for T_b (any tile is exact). Padding changes no real row
(`InputBuffers.pad_mixed` says why).

Default token buckets (`mixed_buckets`): 128, then multiples of 256 up to 2,048, then
`max_num_batched_tokens` itself (benchmarks/DECISIONS.md, "Mixed-step graph ladder"). Steps
longer than 2,048 tokens run eagerly unless a bucket holds them with at most 256 tokens of
padding (`select`; any bucket list, the override included).
envs.LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES overrides the ladder (`mixed_graph_sizes`).

Capture (`CudaGraphs.capture`) goes largest graph first, mixed then decode, through one memory
pool shared by all graphs: smaller graphs reuse the largest one's activations. That pool
outlives the memory profile, which reserves room for it (ModelRunner._profile_free_memory).
Under tensor parallelism each rank captures the same graphs in the same order, their
all-reduces inside.
"""

from __future__ import annotations

import torch

from llm_inference import envs
from llm_inference.executor.input_batch import InputBuffers, StepInputs

DECODE, MIXED = "decode", "mixed"
# The default mixed ladder: MIXED_SMALLEST, multiples of MIXED_STRIDE up to MIXED_FINE_MAX,
# then the token budget.
MIXED_SMALLEST, MIXED_STRIDE, MIXED_FINE_MAX = 128, 256, 2048


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


def mixed_buckets(max_num_batched_tokens: int) -> list[int]:
    """The default token buckets of mixed steps (see the module docstring)."""
    ladder = [MIXED_SMALLEST, *range(MIXED_STRIDE, MIXED_FINE_MAX + 1, MIXED_STRIDE)]
    sizes = {n for n in ladder if n <= max_num_batched_tokens}
    if max_num_batched_tokens >= 2:
        sizes.add(max_num_batched_tokens)
    return sorted(sizes)


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """The token buckets of mixed-step graphs: envs.LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES where
    set (each at most `max_num_batched_tokens`, else ValueError), else `mixed_buckets`."""
    sizes = envs.LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES
    if sizes is None:
        return mixed_buckets(max_num_batched_tokens)
    if sizes and sizes[-1] > max_num_batched_tokens:
        raise ValueError(
            f"LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES: {sizes[-1]} exceeds max_num_batched_tokens="
            f"{max_num_batched_tokens}"
        )
    return list(sizes)


class CudaGraphs:
    """The captured graphs of one model runner; a graph is keyed (DECODE or MIXED, size).

    `eager=True` captures nothing and runs each "replay" as an eager forward of the padded,
    static step instead: the same inputs and metadata as the graph, on any device (CPU tests
    of the padding)."""

    def __init__(
        self,
        model,
        buffers: InputBuffers,
        max_num_seqs: int,
        max_model_len: int,
        mixed_sizes: list[int] | tuple[int, ...] = (),
        eager: bool = False,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.decode_buckets = batch_buckets(max_num_seqs)
        self.mixed_buckets = sorted(set(mixed_sizes))
        if self.mixed_buckets and self.mixed_buckets[-1] > len(buffers.dev.input_ids):
            raise ValueError(f"mixed graph size {self.mixed_buckets[-1]} exceeds the buffers")
        if self.mixed_buckets and self.mixed_buckets[0] < 2:
            raise ValueError("mixed graph sizes must be at least 2")
        self.eager = eager
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.replays = {DECODE: 0, MIXED: 0}  # counts, for tests and benchmarks

    def _args(self, key: tuple[str, int]):
        kind, size = key
        dev = self.buffers.dev
        backend = self.model.attn_backend
        if kind == DECODE:
            md = backend.graph_metadata(self.buffers.attention, size, self.max_model_len)
        else:
            md = backend.graph_metadata(
                self.buffers.attention, self.max_num_seqs, self.max_model_len, num_tokens=size
            )
        return dev.input_ids[:size], dev.positions[:size], md

    def keys(self) -> list[tuple[str, int]]:
        """Every graph, in capture order: largest first, mixed before decode."""
        mixed = [(MIXED, n) for n in reversed(self.mixed_buckets)]
        return mixed + [(DECODE, n) for n in reversed(self.decode_buckets)]

    @torch.inference_mode()
    def capture(self) -> None:
        if self.eager:
            return
        pool = torch.cuda.graph_pool_handle()
        for key in self.keys():
            self.pad(key, 0, 0)  # all padding: no KV written, no attention rows
            self.buffers.to_device(0, 0)
            args = self._args(key)
            self.model(*args)  # compile Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # smaller graphs reuse its memory
                self.outputs[key] = self.model(*args)
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def select(self, step: StepInputs) -> tuple[str, int] | None:
        """The smallest graph that holds `step`, or None (run it eagerly)."""
        if step.max_query_len == 1:
            kind, buckets, need = DECODE, self.decode_buckets, step.num_seqs
        else:
            kind, buckets, need = MIXED, self.mixed_buckets, step.num_tokens
        if step.num_seqs > self.max_num_seqs or not buckets or need > buckets[-1]:
            return None
        size = next(b for b in buckets if b >= need)
        if kind == MIXED and size > MIXED_FINE_MAX and size - need > MIXED_STRIDE:
            return None  # compute-bound: the padding would cost more than the launches save
        return kind, size

    def pad(self, key: tuple[str, int], num_tokens: int, num_seqs: int) -> None:
        """Pad the host buffers' step of `num_tokens` tokens and `num_seqs` sequences to the
        graph `key` (see InputBuffers.pad_decode and pad_mixed)."""
        kind, size = key
        if kind == DECODE:
            self.buffers.pad_decode(num_seqs, size)
        else:
            self.buffers.pad_mixed(num_tokens, num_seqs, size)

    def replay(self, key: tuple[str, int], num_tokens: int) -> torch.Tensor:
        """Run the graph `key` over inputs already in the buffers (padding included); returns
        hidden states [num_tokens, hidden]."""
        self.replays[key[0]] += 1
        if self.eager:
            return self.model(*self._args(key))[:num_tokens]
        self.graphs[key].replay()
        return self.outputs[key][:num_tokens]
