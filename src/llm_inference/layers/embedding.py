"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the
vocabulary (the last one padded with zero rows).

The embedding looks up the ids of its slice (zeros elsewhere) and one all-reduce sums the
ranks. The LM head's `compute_logits` all-gathers the full vocabulary; `compute_local_logits`
gives only this rank's slice, padding columns at -inf, for the distributed sampler.

The LM head's matmul is its linear method's (unquantized: the kernel ops' `linear`; see
layers/quantization), over the weight the embedding created (shared with it when tied).

Weight loaders take the full checkpoint tensor or anything with `.narrow(dim, start, length)`
(models/loader.py passes lazy safetensors slices, so a rank reads only its rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm_inference.config import cdiv
from llm_inference.distributed.parallel_state import (
    all_gather_last_dim,
    all_reduce,
    get_tp_rank,
    get_tp_size,
)
from llm_inference.kernels import KernelOps
from llm_inference.layers.quantization import UnquantizedLinearMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = cdiv(vocab_size, self.tp_size)  # the last shard is padded
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data.zero_()
        if rows:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask[:, None], 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Shares VocabParallelEmbedding's sharding; `compute_logits` gathers the full vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, ops: KernelOps) -> None:
        super().__init__(vocab_size, hidden_size)
        self.quant_method = UnquantizedLinearMethod(ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(self.quant_method.apply(self, hidden))
        return logits[..., : self.vocab_size]

    def compute_local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [B, shard_size]: column j is token
        `vocab_start + j`; padding columns (beyond the vocabulary) are -inf."""
        logits = self.quant_method.apply(self, hidden)
        pad = self.vocab_start + self.shard_size - self.vocab_size
        if pad > 0:
            logits[..., max(0, self.shard_size - pad) :] = float("-inf")
        return logits
