"""The step shapes that compile every Triton kernel variant an eager engine's steps can launch.

Triton compiles a kernel the first time a launch meets a new constexpr. With CUDA graphs every
step replays a captured graph, whose capture compiled what it launches; without them
(`enforce_eager`) each step runs at its own sizes, and a new variant compiles in the middle of
a run. So the Triton ops
list one step shape per variant (`TritonOps.warm_up_shapes`, from `warm_up_shapes` here), and
the executor runs each as an all-padding forward when it starts without graphs
(executor/warm_up.py); the sampler has its own warm-up.

Only the attention picks its variants from a step's sizes (`unified_attention.compile_keys`, one per
launch): the decode kernel's split count follows the batch and the longest context (and whether it
is dispatched in `seq_order`, `unified_attention.ordered`), a mixed step's tile its longest query
and its token count (`unified_attention.default_tiles`): each query length at its own token
count, the skinny GEMM's rows and the budget reaches every tile.
The linear layers take the skinny GEMM up to `skinny_rows` rows (a variant per padded row count,
`skinny_gemm.block_m`) and cuBLAS above. Every other kernel compiles once for all sizes: the
integers that change from step to step are not specialized (`do_not_specialize`). So
`warm_up_shapes` lists step shapes until every attention variant that the scheduler's limits allow,
and each linear variant, are in one of them.

Finding the decode variants: the split count grows with the context and falls with the batch,
so every context length in whole tiles at one sequence, and every batch size at power-of-two
contexts and at the longest, reach every variant that some (batch, context) pair reaches; a
mixed step's decodes, never ordered, split as a decode step of its batch would
(tests/kernels/test_warm_up_shapes.py checks that against all pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels import skinny_gemm as sg
from llm_inference.kernels import unified_attention as ua


@dataclass(frozen=True)
class StepShape:
    """A step's sizes: `num_seqs` decode rows (max_query_len 1), or a mixed step of
    `num_tokens` tokens whose longest query is `max_query_len`; contexts up to `max_seq_len`."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int


def warm_up_shapes(
    num_kv_heads: int, group: int, head_dim: int, block_size: int, max_num_seqs: int,
    max_model_len: int, max_num_batched_tokens: int, num_sms: int, skinny_rows: int,
) -> list[StepShape]:  # fmt: skip
    """Steps until every attention compile key the limits allow, and each linear path, are
    in one, each the first found that brings a new one (see the module docstring);
    `skinny_rows`: the most rows the linear layers run through the skinny GEMM (0: none)."""
    steps: list[StepShape] = []
    seen: set[tuple] = set()

    def add(num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int) -> None:
        keys = step_keys(
            num_kv_heads, group, head_dim, block_size, num_sms, skinny_rows,
            num_seqs, num_tokens, max_query_len, max_seq_len,
        )  # fmt: skip
        if not keys <= seen:
            seen.update(keys)
            steps.append(StepShape(num_seqs, num_tokens, max_query_len, max_seq_len))

    block_n = pa.default_block_n(head_dim, block_size)
    for n in range(block_n, max_model_len + block_n, block_n):
        add(1, 1, 1, min(n, max_model_len))
    powers = {min(block_n << i, max_model_len) for i in range(max_model_len.bit_length())}
    for n in sorted(powers | {max_model_len}):
        for batch in range(1, max_num_seqs + 1):
            add(batch, batch, 1, n)
    budget = max_num_batched_tokens
    for query in range(2, min(budget, max_model_len) + 1):
        for tokens in sorted({query, min(max(query, skinny_rows + 1), budget), budget}):
            add(max_num_seqs, tokens, query, max_model_len)
    return steps


def step_keys(
    num_kv_heads: int, group: int, head_dim: int, block_size: int, num_sms: int,
    skinny_rows: int, num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
) -> set[tuple]:  # fmt: skip
    """The attention compile keys a step of these sizes launches, and its linear layers'
    path: ("skinny", its padded rows) (the skinny GEMM) or ("cublas",) (F.linear, then the
    Triton SiLU-and-mul)."""
    ordered = ua.ordered(num_seqs, max_query_len)
    plan = ua.plan(
        num_seqs, num_kv_heads, group, head_dim, block_size, max_query_len, max_seq_len,
        num_sms, ordered, num_tokens,
    )  # fmt: skip
    linear = ("skinny", sg.block_m(num_tokens)) if num_tokens <= skinny_rows else ("cublas",)
    return {*ua.compile_keys(plan, ordered), linear}
