"""unified_attention (Triton) against reference.unified_attention, and the reference against
dense float64 attention.

CPU: the cases of unified_attention_checks.py (small sizes, float32 and float16: mixed batches
of chunks and decodes, empty sequences, padding rows, GQA 1-4, block sizes 16 and 32, head_dim
32-128, several tile configs, the decode path with and without splits, FP8 caches) run once
in a child process started with TRITON_INTERPRET=1; each case reports its own result.
GPU (skipped without CUDA): bfloat16 at real sizes: query lengths 1 to 5,000, contexts up to
32,768, GQA 1-8, head_dim 64 and 128, block sizes 16 and 32, random non-contiguous block
tables, bfloat16 and FP8 caches; and CUDA-graph replays with new contents.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import unified_attention_checks as checks  # noqa: E402
from helpers import FP8_CACHES  # noqa: E402
from interpreter import run_checks  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def interpreter_results() -> tuple[dict[str, str], str]:
    return run_checks(HERE / "unified_attention_checks.py")


def test_default_tiles_by_head_dim_and_step_size():
    """The measured rule (benchmarks/DECISIONS.md): at head_dim 128 the 256-row tile from
    LONG_TILE_TOKENS tokens where one sequence fills it, else 128 rows on 4 warps; at head_dim
    64, 128 x 64 on 8 warps, 128 x 128 from a LONG_QUERY-token query; fewer rows for short
    queries, 64 at head_dim 256."""
    from llm_inference.kernels import unified_attention as ua

    long_tile, tokens = (256, 64, 8, 3), ua.LONG_TILE_TOKENS
    assert ua.default_tiles(4, 128, 411, 768) == (128, 64, 4, 3)  # a chat-like step's graph
    assert ua.default_tiles(4, 128, 2000, 16000) == long_tile  # prompts of 2,000, eager
    assert ua.default_tiles(4, 128, 64, tokens) == long_tile  # 16 x 64: 256 rows a sequence
    assert ua.default_tiles(4, 128, 63, 4096) == (128, 64, 4, 3)
    assert ua.default_tiles(4, 128, 1024, tokens - 1) == (128, 64, 4, 3)
    assert ua.default_tiles(4, 128, 8, 4096) == (32, 64, 4, 3)
    assert ua.default_tiles(4, 64, 2000, 16000) == (128, 64, 8, 3)
    assert ua.default_tiles(4, 64, ua.LONG_QUERY, ua.LONG_QUERY) == (128, 128, 4, 3)
    assert ua.default_tiles(4, 256, 2000, 16000) == (64, 64, 4, 2)


@pytest.mark.parametrize("case", checks.INTERPRETER_CASES)
def test_unified_attention_in_interpreter(interpreter_results, case):
    results, log = interpreter_results
    assert results.get(case) == "ok", log[-8000:]


def test_reference_long_sequence_among_short_is_chunked():
    """One 2,000-token prompt beside decodes: the reference works per sequence, in row chunks
    (no [S, max_len] padding), and still matches dense attention."""
    checks.check_reference_dense([2000, 1, 1], [0, 40, 7], (4, 2, 16), 16, seed=5, budget=1 << 20)


def test_reference_fused_path_with_cached_context_matches_dense():
    """Prompt chunks of >= FUSED_MIN_ROWS rows on top of cached tokens take PyTorch's fused
    attention with a mask, in row chunks (a small budget): still dense attention."""
    from llm_inference.kernels import reference

    assert 90 >= reference.FUSED_MIN_ROWS
    checks.check_reference_dense([90, 300, 1], [150, 0, 60], (6, 2, 16), 16, seed=7, budget=4096)


def test_unified_attention_rejects_bad_inputs():
    from llm_inference.kernels.triton_ops import unified_attention as op

    q, kc = torch.randn(6, 4, 16), torch.randn(5, 16, 2, 16)
    bt, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        op(torch.randn(6, 3, 16), kc, kc, bt, cu, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        op(q.half(), kc, kc, bt, cu, lens, 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        op(q, kc, kc, bt, cu.float(), lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        op(q, kc, kc, bt, cu[:2], lens, 1.0)
    with pytest.raises(ValueError, match="last dim"):
        op(q.transpose(1, 2).contiguous().transpose(1, 2), kc, kc, bt, cu, lens, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        op(q, kc, kc, bt, cu, lens, 1.0, out=torch.empty(5, 4, 16))
    with pytest.raises(ValueError, match="head_dim"):
        op(torch.randn(6, 4, 24), *[torch.randn(5, 16, 2, 24)] * 2, bt, cu, lens, 1.0)


# GPU: (Hq, Hkv, D) covering GQA 1, 3 (Llama 3B), 4 (Llama 1B) and 8.
GPU_SHAPES = [(32, 8, 64), (24, 8, 128), (8, 8, 128), (16, 2, 64)]
# A mixed step: long and short chunks from 0 and from deep contexts, decodes at 1..32,767
# tokens of context, and empty padding sequences.
GPU_Q = [2048, 1, 1, 17, 300, 0, 1, 1024, 5, 1, 64, 0]
GPU_CTX = [0, 32767, 5, 1000, 30000, 7, 4096, 2048, 31, 0, 16, 3]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
@FP8_CACHES
def test_unified_attention_gpu_bf16_mixed(shape, block_size, fp8):
    checks.check_unified("cuda", torch.bfloat16, GPU_Q, GPU_CTX, shape, block_size,
                         seed=block_size + shape[2], tiles=((64, 32), (128, 64)),
                         fp8=fp8)  # fmt: skip


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
@FP8_CACHES
def test_unified_attention_gpu_bf16_long_prefill(shape, fp8):
    """Steps with a chunk of at least LONG_QUERY tokens take the long-prefill tile (head_dim 64
    and 128); from 0 and after a deep context, beside shorter chunks and a decode."""
    from llm_inference.kernels import unified_attention as ua

    tiles = ua.default_tiles(shape[0] // shape[1], shape[2], 5000, 9600)
    assert tiles[:2] in ((128, 128), (256, 64))
    q_lens, contexts = [5000, 1, 300, ua.LONG_QUERY], [0, 9000, 100, 2003]
    checks.check_unified("cuda", torch.bfloat16, q_lens, contexts, shape, 16, seed=3,
                         tiles=((128, 128), (256, 64)), fp8=fp8)  # fmt: skip


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", GPU_SHAPES[:2])
@FP8_CACHES
def test_unified_attention_gpu_bf16_decode(shape, fp8):
    """Decode-only steps (the split-K path): 1 and 40 sequences, contexts up to 32,768."""
    lens = [32767, 0, 4095, 1, 15, 16, 17, 2000] * 5
    checks.check_unified("cuda", torch.bfloat16, [1] * 40, lens, shape, 16, seed=1,
                         decode_splits=(1, 7, 64), fp8=fp8)  # fmt: skip
    checks.check_unified("cuda", torch.bfloat16, [1], [32767], shape, 16, seed=2, fp8=fp8)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("max_query_len", [1, 512])
def test_unified_attention_replays_in_cuda_graph(max_query_len):
    """Capture with fixed sizes, then change q, cu_seqlens_q, seq_lens, the tables and the
    caches in place and replay: each replay must match the reference on its new contents."""
    from llm_inference.kernels.triton_ops import unified_attention

    num_seqs, num_tokens, max_len, block_size = 8, 8 * max_query_len + 5, 4096, 16
    width, num_blocks = max_len // block_size, num_seqs * max_len // block_size + 5
    gen = torch.Generator().manual_seed(max_query_len)

    def draw():
        q_lens = torch.randint(0, max_query_len + 1, (num_seqs,), generator=gen).tolist()
        ctx = [int(torch.randint(0, max_len - n + 1, (), generator=gen)) for n in q_lens]
        pad = num_tokens - sum(q_lens)
        return checks.make_case("cuda", torch.bfloat16, q_lens, ctx, (32, 8, 64), block_size,
                                gen, pad, width, num_blocks)[0]  # fmt: skip

    static = draw()
    out = torch.full_like(static[0], float("nan"))
    checks.check_replays(
        lambda: unified_attention(*static, 0.125, out, max_query_len, max_len), static, draw,
        lambda replay: checks.assert_close(out, static, 0.125, f"replay {replay}"),
        before=lambda: out.fill_(float("nan")),
    )  # fmt: skip


def test_decode_split_count_follows_the_dispatch_order(monkeypatch):
    """Decode steps dispatched longest first split further (ORDERED_WAVES): on an H200-sized
    GPU, 64 sequences of 3B heads take two splits ordered and one in batch order."""
    from llm_inference.kernels import paged_attention as pa
    from llm_inference.kernels import unified_attention as ua

    seen = []
    monkeypatch.setattr(ua, "num_sms", lambda device: 132)
    monkeypatch.setattr(pa, "launch", lambda *a, **kw: seen.append(a[7]) or a[6])
    q = torch.zeros(64, 24, 128)
    cache = torch.zeros(4, 16, 8, 128)
    table, cu = torch.zeros(64, 256, dtype=torch.int32), torch.arange(65, dtype=torch.int32)
    lens = torch.ones(64, dtype=torch.int32)
    for order in (None, torch.arange(64, dtype=torch.int32)):
        ua.unified_attention(q, cache, cache, table, cu, lens, 1.0, max_query_len=1,
                             max_seq_len=4096, seq_order=order)  # fmt: skip
    assert seen == [1, 2]


def test_the_order_is_followed_from_order_min_seqs_on(monkeypatch):
    """A `seq_order` reaches the decode kernel from ORDER_MIN_SEQS sequences on; below, and
    for mixed steps, the launch is in batch order (the layers pass the order whenever they
    have one: the kernels decide)."""
    from llm_inference.kernels import paged_attention as pa
    from llm_inference.kernels import unified_attention as ua

    seen = []
    monkeypatch.setattr(pa, "launch", lambda *a, **kw: seen.append(kw["seq_order"]) or a[6])
    cache = torch.zeros(4, 16, 8, 128)
    for n in (ua.ORDER_MIN_SEQS - 1, ua.ORDER_MIN_SEQS):
        table, cu = torch.zeros(n, 8, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32)
        order = torch.arange(n, dtype=torch.int32)
        ua.unified_attention(torch.zeros(n, 24, 128), cache, cache, table, cu,
                             torch.ones(n, dtype=torch.int32), 1.0, max_query_len=1,
                             seq_order=order)  # fmt: skip
    assert seen[0] is None and seen[1] is not None
    assert not ua.ordered(ua.ORDER_MIN_SEQS, 2) and ua.ordered(ua.ORDER_MIN_SEQS, 1)


def test_mixed_steps_leave_their_decodes_to_the_decode_kernel(monkeypatch):
    """A step with a prompt chunk launches the decode kernel (it takes the one-row sequences,
    split by the step's sizes) and then the tiled kernel, told to skip them; a decode-only
    step the decode kernel alone."""
    from llm_inference.kernels import paged_attention as pa
    from llm_inference.kernels import unified_attention as ua

    seen = []
    monkeypatch.setattr(ua, "num_sms", lambda device: 132)
    monkeypatch.setattr(pa, "launch", lambda *a, **kw: seen.append(("decode", a[7])))
    monkeypatch.setattr(ua, "launch", lambda *a, **kw: seen.append(("tiled", kw["skip_decodes"])))
    cache = torch.zeros(4, 16, 8, 128)
    for q_lens in ([1, 1, 300], [1, 1, 1]):
        cu = torch.tensor([0, 1, 2, 2 + q_lens[2]], dtype=torch.int32)
        ua.unified_attention(torch.zeros(sum(q_lens), 32, 128), cache, cache,
                             torch.zeros(3, 256, dtype=torch.int32), cu,
                             torch.full((3,), 400, dtype=torch.int32), 1.0,
                             max_query_len=max(q_lens), max_seq_len=4096)  # fmt: skip
    splits = pa.choose_splits(3, 8, 4096, pa.default_block_n(128, 16), 132)
    assert splits > 1  # three sequences of 4,096 tokens split
    assert seen == [("decode", splits), ("tiled", True), ("decode", splits)]
