"""Checks of unified_attention (Triton) against reference.unified_attention, and of the reference
against dense float64 causal attention; shared by the CPU (interpreter) and GPU tests.

Every case draws fresh random inputs: each sequence's K/V is written at a random, non-contiguous
set of cache blocks; free blocks and the unused tail of each last block hold NaN, so a kernel
that reads any of them fails. The padding rows of q past cu_seqlens_q[-1] hold 100 (finite, so
that a write to the padding rows of `out` shows). Outputs are NaN-poisoned before each run, and
must stay NaN in the padding rows. The CPU tests run `python unified_attention_checks.py` in a
child process with TRITON_INTERPRET=1 (the interpreter must be on before triton is imported);
each case prints `RESULT <case> ok|FAIL`.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_kernel_checks import ATTN_TOL, FP8_SCALES, as_cache  # noqa: E402


def make_case(device, dtype, q_lens, contexts, shape, block_size, gen, pad_rows=3,
              width=None, num_blocks=None, fp8=False):  # fmt: skip
    """(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens) and the dense per-sequence
    K/V [n, Hkv, D] (float32) that the cache holds (`fp8`: FP8 caches with FP8_SCALES, which
    hold that K/V rounded). Sequence s has q_lens[s] new rows after contexts[s] cached tokens;
    `width`/`num_blocks` fix the table and pool sizes (graph replay)."""
    num_heads, num_kv_heads, head_dim = shape
    lens = [c + n for c, n in zip(contexts, q_lens)]
    need = [math.ceil(n / block_size) for n in lens]
    width = width or max(need) + 2
    num_blocks = num_blocks or sum(need) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(lens), width + 3), generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full(cache_shape, float("nan"))
    dense, used = [], 0
    for s, n in enumerate(lens):
        blocks = perm[used : used + need[s]]
        tables[s, : need[s]] = blocks
        used += need[s]
        k, v = torch.randn(2, n, num_kv_heads, head_dim, generator=gen).to(dtype).float()
        k_cache.view(-1, num_kv_heads, head_dim)[_slots(blocks, n, block_size)] = k
        v_cache.view(-1, num_kv_heads, head_dim)[_slots(blocks, n, block_size)] = v
        dense.append((k, v))
    num_tokens = sum(q_lens) + pad_rows
    q = torch.full((num_tokens, num_heads, head_dim), 100.0)  # finite: a write of it shows
    q[: sum(q_lens)] = 2 * torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    k_cache = as_cache(k_cache, device, dtype, fp8, FP8_SCALES[0])
    v_cache = as_cache(v_cache, device, dtype, fp8, FP8_SCALES[1])
    case = (q.to(device, dtype), k_cache, v_cache, tables.to(device, torch.int32)[:, :width],
            cu.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))  # fmt: skip
    return case, dense


def _slots(blocks: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of a sequence's first n tokens."""
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]


def assert_close(out, case, scale, what="", k_scale=1.0, v_scale=1.0):
    """Per sequence, relative L2 error of its rows against the float32 reference (which reads
    any cache in float32)."""
    from llm_inference.kernels import reference

    q, k_cache, v_cache, block_table, cu, lens = case
    ref = reference.unified_attention(q.float(), k_cache, v_cache, block_table, cu, lens, scale,
                                      k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    bounds = cu.tolist()
    assert torch.isfinite(out[: bounds[-1]]).all(), f"{what}: unwritten (NaN) or non-finite rows"
    assert torch.isnan(out[bounds[-1] :]).all(), f"{what}: padding rows were written"
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        err = ((out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()).item()
        assert err < ATTN_TOL[q.dtype], (
            f"{what}: relative error {err:.2e} at seq {s} (rows {b - a}, len {int(lens[s])})"
        )


def check_unified(device, dtype, q_lens, contexts, shape, block_size, seed, tiles=(),
                  decode_splits=(), fp8=False):  # fmt: skip
    """The public op with tight and default bounds, then each tile config (BLOCK_M, BLOCK_N)
    through unified_attention.launch and, for decode-only batches, each split count through
    paged_attention.launch with cu_seqlens, in batch order and in a random `seq_order`.
    `fp8`: FP8 caches, with FP8_SCALES."""
    from llm_inference.kernels import paged_attention, triton_ops, unified_attention

    gen = torch.Generator().manual_seed(seed)
    case, _ = make_case(device, dtype, q_lens, contexts, shape, block_size, gen, fp8=fp8)
    scale = shape[2] ** -0.5
    scales = dict(zip(("k_scale", "v_scale"), FP8_SCALES if fp8 else (1.0, 1.0)))
    lens = [c + n for c, n in zip(contexts, q_lens)]
    for bounds in ((max(q_lens), max(lens)), (None, None)):
        out = torch.full_like(case[0], float("nan"))
        res = triton_ops.unified_attention(*case, scale, out, *bounds, **scales)
        assert res is out
        assert_close(out, case, scale, f"bounds {bounds}", **scales)
    for block_m, block_n in tiles:
        out = torch.full_like(case[0], float("nan"))
        unified_attention.launch(*case, scale, out, block_m, block_n, **scales)
        assert_close(out, case, scale, f"tiles {block_m}x{block_n}", **scales)
    q, k_cache, v_cache, block_table, cu, seq_lens = case
    for splits in decode_splits:
        assert max(q_lens) <= 1
        for order in (None, torch.randperm(len(q_lens), generator=gen).to(device)):
            out = torch.full_like(q, float("nan"))
            paged_attention.launch(q, k_cache, v_cache, block_table, seq_lens, scale, out,
                                   splits, 16, cu_seqlens=cu, seq_order=order,
                                   **scales)  # fmt: skip
            assert_close(out, case, scale, f"decode splits {splits} order {order}", **scales)
    if decode_splits:  # the public op passes the order on
        order = torch.argsort(seq_lens, descending=True)
        out = torch.full_like(q, float("nan"))
        triton_ops.unified_attention(*case, scale, out, 1, max(lens), seq_order=order, **scales)
        assert_close(out, case, scale, "decode, longest first", **scales)


def check_replays(call, static, draw, check, before=lambda: None, replays: int = 3) -> None:
    """Capture `call` in a CUDA graph (after one eager call: compiles happen outside the
    capture), then `replays` times: `draw()`'s new case copied into the `static` one that
    `call` reads, `before()`, a replay, `check(replay)`."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for replay in range(replays):
        for dst, src in zip(static, draw()):
            dst.copy_(src)
        before()
        graph.replay()
        check(replay)


def dense_attention(q, k, v, context, scale):
    """Causal attention of q [L, Hq, D] at positions context.. over k/v [n, Hkv, D], float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,nhd->hln", q.double(), k) * scale
    pos = context + torch.arange(q.shape[0])
    scores[:, torch.arange(k.shape[0])[None, :] > pos[:, None]] = float("-inf")
    return torch.einsum("hln,nhd->lhd", scores.softmax(-1), v)


def check_reference_dense(q_lens, contexts, shape, block_size, seed, budget=None):
    """reference.unified_attention (float32 inputs) against dense float64 attention per sequence;
    `budget` shrinks its score chunk so the chunked path runs."""
    from llm_inference.kernels import reference

    gen = torch.Generator().manual_seed(seed)
    case, dense = make_case("cpu", torch.float32, q_lens, contexts, shape, block_size, gen)
    scale = shape[2] ** -0.5
    saved = reference.SCORE_BUDGET
    reference.SCORE_BUDGET = budget or saved
    try:
        out = torch.full_like(case[0], float("nan"))
        assert reference.unified_attention(*case, scale, out) is out
    finally:
        reference.SCORE_BUDGET = saved
    bounds = case[4].tolist()
    for s, (k, v) in enumerate(dense):
        a, b = bounds[s], bounds[s + 1]
        want = dense_attention(case[0][a:b], k, v, contexts[s], scale)
        torch.testing.assert_close(out[a:b].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[bounds[-1] :]).all(), "padding rows must be left alone"


# Interpreter cases (small). Mixed: chunks from position 0 (seqs 0, 3), at offsets inside a block
# (13, 20) and across blocks (13 + 17 crosses 16, 16 + 33 spans three), decodes (seqs 2, 5) and
# empty padding sequences in the middle and at the end.
MIXED_Q = [5, 0, 1, 40, 17, 1, 33, 0]
MIXED_CTX = [0, 3, 20, 0, 13, 70, 16, 9]
DECODE_Q = [1, 1, 0, 1, 1, 1, 0]
DECODE_CTX = [0, 15, 4, 16, 31, 130, 2]
# and the default tiles (BLOCK_M up to 128, BLOCK_N 64); the long-prefill tiles 128 x 128 and
# 256 x 64 (unified_attention.default_tiles) in float32
TILES = ((16, 16), (32, 32), (128, 128), (256, 64))
SHAPES = {  # name -> ((Hq, Hkv, D), block size)
    "g4_d64_bs16": ((8, 2, 64), 16),
    "g2_d64_bs32": ((4, 2, 64), 32),
    "g1_d64_bs16": ((2, 2, 64), 16),
    "g3_d32_bs16": ((6, 2, 32), 16),
    "g4_d128_bs32": ((4, 1, 128), 32),
}
INTERPRETER_CASES = (*(f"mixed_{name}" for name in SHAPES), "decode", "fp8", "reference_dense")


def run_case(case: str) -> None:
    for i, dtype in enumerate((torch.float32, torch.float16)):
        if case.startswith("mixed_"):
            shape, bs = SHAPES[case.removeprefix("mixed_")]
            tiles = TILES if dtype == torch.float32 else TILES[1:2]
            check_unified("cpu", dtype, MIXED_Q, MIXED_CTX, shape, bs, seed=i, tiles=tiles)
        elif case == "decode":
            for shape, bs in (((8, 2, 32), 16), ((6, 2, 64), 32)):
                check_unified("cpu", dtype, DECODE_Q, DECODE_CTX, shape, bs, seed=i,
                              tiles=((16, 16),), decode_splits=(1, 3))  # fmt: skip
        elif case == "fp8":  # FP8 caches (float8 -> float32 / float16 reads): mixed, decode
            shape, bs = SHAPES["g4_d64_bs16"]
            check_unified("cpu", dtype, MIXED_Q, MIXED_CTX, shape, bs, seed=i, tiles=TILES[:1],
                          fp8=True)  # fmt: skip
            check_unified("cpu", dtype, DECODE_Q, DECODE_CTX, shape, bs, seed=i,
                          decode_splits=(3,), fp8=True)  # fmt: skip
        elif case == "reference_dense" and dtype == torch.float32:
            check_reference_dense(MIXED_Q, MIXED_CTX, (8, 2, 16), 16, seed=i)
            check_reference_dense(MIXED_Q, MIXED_CTX, (6, 3, 32), 8, seed=i, budget=300)
            check_reference_dense([100, 1, 0], [0, 500, 0], (4, 1, 16), 32, seed=i, budget=4096)


def main(cases: list[str]) -> None:
    """Run each case; print one `RESULT <case> ok|FAIL` line each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: interpreter.py
    from interpreter import report_each

    report_each(cases, run_case)


if __name__ == "__main__":
    main(sys.argv[1:] or list(INTERPRETER_CASES))
