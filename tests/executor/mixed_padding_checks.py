"""Checks that padding a step to a CUDA-graph bucket changes no real row of attention; shared by
the in-process tests (reference kernels) and the Triton-interpreter child (python
mixed_padding_checks.py, TRITON_INTERPRET=1; each case prints `RESULT <case> ok|FAIL`).

A step is built the way the runner builds it (InputBatch.prepare into InputBuffers) from
requests with cached context, prompt chunks and decodes. One attention layer (store K/V, then
unified attention) runs over it twice from the same cache: unpadded, with the step's own
metadata; and padded as the graph would replay it (InputBuffers.pad_mixed or pad_decode, then
AttentionBackend.graph_metadata: every sequence slot of the buffers, the whole block-table
width, max_query_len = the bucket). The padding rows of q, k and v hold NaN, the block-table
rows of the padding sequences and the columns past each real sequence's blocks hold an
out-of-range block id: reading or storing any of them shows. The real rows must agree
(exactly with the reference kernels) and the caches must be equal afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from llm_inference.config import cdiv
from llm_inference.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from llm_inference.executor.input_batch import InputBatch, InputBuffers
from llm_inference.layers.attention import Attention, AttentionBackend
from llm_inference.sampling_params import SamplingParams

BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS = 4, 64, 96
BAD_BLOCK = 10**6  # an out-of-range block id: a read of it fails (or reads garbage)
# (prompt length, computed tokens, scheduled tokens) per request, in batch order: chunks from
# position 0 and on top of cached context (inside a block and across blocks), decodes.
MIXED = [(40, 0, 23), (30, 17, 13), (20, 19, 1), (9, 0, 9), (12, 11, 1)]
DECODE = [(20, 19, 1), (7, 6, 1), (33, 32, 1)]
# case -> (requests, kind, bucket, max_seqs, (Hq, Hkv, D))
CASES = {
    "mixed_g2": (MIXED, "mixed", 64, 8, (4, 2, 16)),
    "mixed_g4_many_pad_seqs": (MIXED, "mixed", 48, 16, (8, 2, 32)),
    "mixed_g1_tight": (MIXED, "mixed", 47, 5, (2, 2, 16)),  # bucket == T, no padding sequence
    "decode_g2": (DECODE, "decode", 8, 8, (4, 2, 16)),
}


def build_step(requests, max_seqs: int, max_tokens: int, gen: torch.Generator):
    """A prepared step in fresh buffers, block tables drawn at random without overlap."""
    batch = InputBatch(max_seqs, MAX_MODEL_LEN, BLOCK_SIZE)
    buffers = InputBuffers(max_tokens, max_seqs, cdiv(MAX_MODEL_LEN, BLOCK_SIZE), "cpu")
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    new, scheduled = [], {}
    for i, (prompt_len, computed, count) in enumerate(requests):
        need = cdiv(prompt_len, BLOCK_SIZE)
        blocks, perm = perm[:need], perm[need:]
        prompt = torch.randint(2, 300, (prompt_len,), generator=gen).tolist()
        new.append(NewRequestData(f"r{i}", prompt, [], SamplingParams(), blocks, computed))
        scheduled[f"r{i}"] = count
    so = SchedulerOutput(0, new, CachedRequestData(), scheduled, sum(scheduled.values()))
    batch.apply(so)
    step = batch.prepare(so, buffers)
    # Stale entries the kernels must never read.
    buffers.np_table[step.num_seqs :, 1:] = BAD_BLOCK
    buffers.np_table[:, step.block_width :] = BAD_BLOCK
    return step, buffers


def run_case(case: str, ops, dtype: torch.dtype, exact: bool) -> None:
    requests, kind, bucket, max_seqs, (hq, hkv, d) = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    step, buffers = build_step(requests, max_seqs, max(bucket, 64), gen)
    t, s = step.num_tokens, step.num_seqs
    if kind == "mixed":
        assert step.max_query_len > 1 and t <= bucket and s <= max_seqs
    else:
        assert step.max_query_len == 1 and s <= bucket
        buffers.np_table[s:, 0] = 0  # a decode padding row reads block 0 (stale: a real id)
    backend = AttentionBackend(ops)
    layer = Attention(hq, hkv, d, d**-0.5, backend)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, hkv, d)
    caches = [torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(2)]
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))

    layer.k_cache, layer.v_cache = (c.clone() for c in caches)
    md = backend.metadata(buffers.attention, t, s, step.max_query_len, step.max_seq_len,
                          step.block_width)  # fmt: skip
    want = layer(q, k, v, md)
    want_caches = (layer.k_cache, layer.v_cache)

    if kind == "mixed":
        buffers.pad_mixed(t, s, bucket)
        md = backend.graph_metadata(buffers.attention, max_seqs, MAX_MODEL_LEN, num_tokens=bucket)
        rows = bucket
    else:
        buffers.pad_decode(s, bucket)
        md = backend.graph_metadata(buffers.attention, bucket, MAX_MODEL_LEN)
        rows = bucket
    assert md.max_query_len == (1 if kind == "decode" else bucket)
    assert md.block_table.shape == (md.seq_lens.shape[0], cdiv(MAX_MODEL_LEN, BLOCK_SIZE))
    pad = [torch.full((rows - t, x.shape[1], d), float("nan"), dtype=dtype) for x in (q, k, v)]
    qp, kp, vp = (torch.cat([x, p]) for x, p in zip((q, k, v), pad))
    layer.k_cache, layer.v_cache = (c.clone() for c in caches)
    got = layer(qp, kp, vp, md)
    for name, a, b in zip(("k_cache", "v_cache"), want_caches, (layer.k_cache, layer.v_cache)):
        assert torch.equal(a, b), f"{case}: padding changed {name}"
    assert torch.isfinite(got[:t]).all(), f"{case}: a real row read padding"
    if exact:
        assert torch.equal(got[:t], want), f"{case}: padded rows differ"
    else:
        err = ((got[:t].float() - want.float()).norm() / want.float().norm()).item()
        tol = {torch.float32: 1e-5, torch.float16: 3e-3}[dtype]
        assert err < tol, f"{case}: relative error {err:.2e} padded against unpadded"


def main(cases: list[str]) -> None:
    """Triton kernels (under the interpreter): each case in float32 and float16."""
    from llm_inference.kernels.triton_ops import TritonOps

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: interpreter.py
    from interpreter import report_each

    def run(case: str) -> None:
        for dtype in (torch.float32, torch.float16):
            run_case(case, TritonOps("cpu"), dtype, exact=False)

    report_each(cases, run)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
