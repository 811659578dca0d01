"""CUDA graphs for decode steps.

A decode step launches ~10 kernels per layer; at small batches their launch cost, not the GPU,
sets the step time. So for each batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to
`max_num_seqs`) the model's forward over one token per sequence is captured once, reading
static input buffers; a step copies its inputs into them and replays the smallest bucket that
fits. Padding rows write no KV (slot -1) and attend to one cached token: their outputs are
ignored. The attention kernels' grids depend only on the bucket and `max_model_len`, so one
graph serves every mix of context lengths.
"""

from __future__ import annotations

import torch

from llm_inference.layers.attention import AttentionMetadata


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, device):
        self.model = model
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        n, width = self.buckets[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            decode_block_tables=self.block_tables[:bs],
            decode_seq_lens=self.seq_lens[:bs],
            decode_max_seq_len=self.max_model_len,
            all_decode=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its pool
            md = self._metadata(bs)
            args = (self.input_ids[:bs], self.positions[:bs], md)
            self.model(*args)  # compile Triton kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.buckets[-1]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """One token per sequence; returns hidden states [num_seqs, hidden]."""
        n = len(input_ids)
        bs = next(b for b in self.buckets if b >= n)
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.input_ids[:n].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.block_tables[:n, :width].copy_(padded, non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
