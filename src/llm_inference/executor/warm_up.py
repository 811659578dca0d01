"""The start-up warm-up of eager steps: one all-padding forward per step shape the kernels list.

A step no CUDA graph holds (every step with `enforce_eager`; with graphs, a mixed step past
the buckets) runs at its own sizes, and Triton compiles a kernel variant the first time a
launch needs it: in the middle of the first requests. The kernel ops list the step shapes that
reach every variant steps within the scheduler's limits can launch (`ops.warm_up_shapes`,
kernels/warm_up.py; none for the reference kernels), and `ModelRunner` runs each here at start
(no KV written, no query row read), before capturing the graphs, whose captures compile what
they launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kernels/warm_up.py imports Triton, which a CPU install may lack
    from llm_inference.kernels.warm_up import StepShape


@torch.inference_mode()
def run_warm_up(model, buffers, max_num_seqs: int, steps: list[StepShape]) -> None:
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
