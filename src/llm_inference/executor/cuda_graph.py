"""CUDA graphs for decode steps.

A decode step launches ~10 kernels per layer; at small batches their launch cost, not the GPU,
sets the step time. So for each batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to
`max_num_seqs`) the model's forward over one token per sequence is captured once, reading the
model runner's persistent input buffers through the attention backend's static metadata
(`AttentionBackend.graph_metadata`); a step writes its inputs into those buffers and replays
the smallest bucket that fits. Padding rows write no KV (slot -1) and attend to one cached
token: their outputs are ignored. The attention grid depends only on the bucket and
`max_model_len`, so one graph serves every mix of context lengths.
"""

from __future__ import annotations

import torch

from llm_inference.executor.input_batch import InputBuffers


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, model, buffers: InputBuffers, max_num_seqs: int, max_model_len: int):
        self.model = model
        self.buffers = buffers
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _args(self, bs: int):
        views = self.buffers.views
        md = self.model.attn_backend.graph_metadata(self.buffers.attention, bs, self.max_model_len)
        return views["input_ids"][:bs], views["positions"][:bs], md

    @torch.inference_mode()
    def capture(self) -> None:
        largest = self.buckets[-1]
        self.buffers.pad_decode(0, largest)
        self.buffers.to_device(largest, 1)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool
            args = self._args(bs)
            self.model(*args)  # compile Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds `num_seqs`, or None."""
        if not self.graphs or num_seqs > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= num_seqs)

    def replay(self, num_seqs: int, bucket: int) -> torch.Tensor:
        """Run the graph of `bucket` over inputs already in the buffers (padding included);
        returns hidden states [num_seqs, hidden]."""
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_seqs]
