"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the
vocabulary."""

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
        shard = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
