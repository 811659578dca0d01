"""The eager engine's start-up warm-up: one dummy forward per compiled attention variant.

With CUDA graphs, capturing a graph first runs its forward eagerly, which compiles every Triton
kernel variant that graph launches, and every step replays one of the graphs. With
`enforce_eager` each step runs at its own sizes, and Triton compiles a kernel the first time a
launch meets a new constexpr. Measured on the H200 (`benchmarks/first_run.py --enforce-eager`,
1B, an empty Triton cache): the first eight requests waited for 10 compiles (4.6 s), and the
throughput run after them for 5 more (2.7 s), in the middle of its steps.

Only the attention picks its variant from a step's sizes (`unified_attention.compile_key`): a
decode step's split count follows its batch and its longest context, a mixed step's tile its
longest query. The linear layers take the skinny GEMM up to SKINNY_MAX_ROWS rows (one variant
for all of them) and cuBLAS above. Every other kernel compiles once for all sizes: the integers
that change from step to step are not specialized (`do_not_specialize`). So `warm_up_steps`
lists one step shape for each (attention variant, skinny or not) that the scheduler's limits
allow, and `ModelRunner` runs each as an all-padding forward (no KV written, no query row read)
when it starts without graphs; the sampler has its own warm-up.

Finding the decode variants: the split count grows with the context and falls with the batch,
so every context length in whole tiles at one sequence, and every batch size at power-of-two
contexts and at the longest, reach every variant that some (batch, context) pair reaches
(tests/executor/test_warm_up.py checks that against all pairs, with shapes where each sweep is
needed). That is a few thousand calls of pure Python (26-64 ms on the development CPU for
the 1B and 3B shapes at 256-1,024 sequences and 131,072 tokens) and a few dozen forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels import unified_attention as ua
from llm_inference.layers.attention import ORDER_MIN_SEQS
from llm_inference.layers.linear import SKINNY_MAX_ROWS


@dataclass(frozen=True)
class WarmStep:
    """A step's sizes: `num_seqs` decode rows (max_query_len 1), or a mixed step of
    `num_tokens` tokens whose longest query is `max_query_len`; contexts up to `max_seq_len`."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int


def warm_up_steps(
    num_kv_heads: int, group: int, head_dim: int, block_size: int,
    max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, num_sms: int,
) -> list[WarmStep]:  # fmt: skip
    """One step per (attention compile key, skinny GEMM or not) the limits allow, the
    smallest first found (see the module docstring)."""
    steps: dict[tuple, WarmStep] = {}

    def add(num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int) -> None:
        ordered = max_query_len == 1 and num_seqs >= ORDER_MIN_SEQS
        plan = ua.plan(
            num_seqs, num_kv_heads, group, head_dim, block_size, max_query_len, max_seq_len,
            num_sms, ordered,
        )  # fmt: skip
        key = ua.compile_key(plan, ordered), num_tokens <= SKINNY_MAX_ROWS
        steps.setdefault(key, WarmStep(num_seqs, num_tokens, max_query_len, max_seq_len))

    block_n = pa.default_block_n(head_dim, block_size)
    for n in range(block_n, max_model_len + block_n, block_n):
        add(1, 1, 1, min(n, max_model_len))
    powers = {min(block_n << i, max_model_len) for i in range(max_model_len.bit_length())}
    for n in sorted(powers | {max_model_len}):
        for batch in range(1, max_num_seqs + 1):
            add(batch, batch, 1, n)
    budget = min(max_num_batched_tokens, max_model_len)
    for query in range(2, budget + 1):
        for tokens in sorted({query, min(max(query, SKINNY_MAX_ROWS + 1), budget)}):
            add(max_num_seqs, tokens, query, max_model_len)
    return list(steps.values())


@torch.inference_mode()
def run_warm_up(model, buffers, max_num_seqs: int, steps: list[WarmStep]) -> None:
    """An all-padding forward of each step through the model runner's input `buffers` (as a
    graph capture pads them): decode rows attend to one cached token and write no KV, mixed
    steps' tokens belong to no sequence."""
    backend, dev = model.attn_backend, buffers.dev
    width = buffers.attention.block_table.shape[1]
    for step in steps:
        n = step.num_tokens
        if step.max_query_len == 1:  # n decode rows
            buffers.pad_decode(0, n)
            seqs = n
        else:  # n tokens in no sequence's rows
            buffers.pad_mixed(0, 0, n)
            seqs = max_num_seqs
        buffers.to_device(0, 0)
        md = backend.metadata(
            buffers.attention, n, seqs, step.max_query_len, step.max_seq_len, width
        )
        model(dev.input_ids[:n], dev.positions[:n], md)
