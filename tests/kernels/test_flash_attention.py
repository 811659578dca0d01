"""Prompt chunks through FlashAttention 4 (kernels/flash_attention.py), where the flash-attn-4
package runs: which steps TritonOps sends there and how the decodes join them (CPU, with the
two kernels replaced by recorders), and on a GPU with the package, mixed steps against the
float32 reference, eagerly and replayed in a CUDA graph with new contents."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import unified_attention_checks as checks  # noqa: E402
from triton_kernel_checks import ATTN_TOL  # noqa: E402

from llm_inference.kernels import flash_attention, triton_ops  # noqa: E402

# A mixed step: chunks from 0 and after deep contexts, decodes at 1..32,767 tokens of context,
# empty padding sequences (test_unified_attention.py's).
GPU_Q = [2048, 1, 1, 17, 300, 0, 1, 1024, 5, 1, 64, 0]
GPU_CTX = [0, 32767, 5, 1000, 30000, 7, 4096, 2048, 31, 0, 16, 3]
needs_fa4 = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_attention.available(torch.device("cuda"))),
    reason="needs a Hopper or Blackwell GPU and the flash-attn-4 package",
)


def test_decodes_and_padding_sequences_get_no_flash_rows():
    cu = torch.tensor([0, 1, 301, 302, 302, 340], dtype=torch.int32)
    assert flash_attention.prompt_rows(cu).tolist() == [0, 300, 0, 0, 38]


def test_it_applies_to_large_half_precision_steps_at_head_size_128_and_pages_of_16_or_32(
    monkeypatch,
):
    monkeypatch.setattr(flash_attention, "_runs", lambda *layout: True)
    q = torch.zeros(flash_attention.MIN_TOKENS, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    assert flash_attention.applies(q, cache)
    assert flash_attention.applies(q, cache.new_zeros(2, 32, 2, 128))
    assert not flash_attention.applies(q[1:], cache)  # fewer tokens: our one launch
    assert not flash_attention.applies(q, cache.to(torch.float8_e4m3fn))  # FP8 cache: ours
    assert not flash_attention.applies(q.float(), cache.float())
    assert not flash_attention.applies(q[..., :64], cache[..., :64])  # head size 64: ours
    assert not flash_attention.applies(q, cache.new_zeros(2, 128, 2, 128))  # not checked yet
    assert not flash_attention.available(torch.device("cpu"))


def test_a_layout_whose_first_call_fails_keeps_the_triton_kernel(monkeypatch):
    """A compiler or runtime piece missing on the machine: a warning, not a failed step."""

    def broken(*args, **kwargs):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(flash_attention, "_varlen_func", lambda: broken)
    flash_attention._runs.cache_clear()
    q = torch.zeros(flash_attention.MIN_TOKENS, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="FlashAttention 4 does not run here.*no ptxas"):
        assert not flash_attention.applies(q, cache)
    flash_attention._runs.cache_clear()


@pytest.fixture
def recorded(monkeypatch):
    """TritonOps on the CPU as if FlashAttention ran: both kernels replaced by recorders;
    steps of 10 tokens (`_case`'s) large enough for it."""
    calls = []

    def flash(q, k_cache, v_cache, table, cu, lens, scale, max_query_len, max_seq_len):
        calls.append(("flash", max_query_len, max_seq_len))
        return torch.full_like(q, 7.0)

    def ours(q, k_cache, v_cache, table, cu, lens, scale, out, max_query_len, max_seq_len,
             *rest, pdl):  # fmt: skip
        written = None if out is None else out[0, 0, 0]
        calls.append(("ours", max_query_len, max_seq_len, written, rest[0]))  # rest[0]: the order
        return out

    monkeypatch.setattr(flash_attention, "available", lambda device: True)
    monkeypatch.setattr(flash_attention, "MIN_TOKENS", 10)
    monkeypatch.setattr(flash_attention, "_runs", lambda *layout: True)
    monkeypatch.setattr(flash_attention, "prompt_attention", flash)
    monkeypatch.setattr(triton_ops, "unified_attention", ours)
    return triton_ops.TritonOps("cpu"), calls


def _case(dtype=torch.bfloat16, head_size=128, block_size=16):
    """A step of 10 tokens (a decode, a chunk of 8 rows, a decode); by default at head size 128
    and block size 16, a layout FlashAttention takes."""
    q = torch.zeros(10, 8, head_size, dtype=torch.bfloat16)
    cache = torch.zeros(4, block_size, 2, head_size, dtype=dtype)
    table, cu = torch.zeros(3, 4, dtype=torch.int32), torch.tensor([0, 1, 9, 10], dtype=torch.int32)
    return q, cache, cache, table, cu, torch.tensor([5, 20, 3], dtype=torch.int32), 0.125


def test_a_step_with_chunks_sends_them_to_flash_and_its_decodes_to_ours(recorded):
    ops, calls = recorded
    assert ops.flash_prompts
    order = torch.arange(3, dtype=torch.int32)
    out = ops.unified_attention(*_case(), max_query_len=8, max_seq_len=64, seq_order=order)
    # ours writes the decodes into FlashAttention's output, the decode kernel alone, in batch
    # order (as in any step with chunks)
    assert calls == [("flash", 8, 64), ("ours", 1, 64, 7.0, None)] and out[0, 0, 0] == 7.0
    calls.clear()
    given = torch.zeros(10, 8, 128, dtype=torch.bfloat16)
    assert ops.unified_attention(*_case(), out=given, max_query_len=8) is given
    assert calls == [("flash", 8, 64), ("ours", 1, 64, 7.0, None)]  # bound: the capacity


def test_decode_steps_small_steps_and_fp8_caches_stay_on_ours(recorded, monkeypatch):
    ops, calls = recorded
    ops.unified_attention(*_case(), max_query_len=1, max_seq_len=64)
    ops.unified_attention(*_case(torch.float8_e4m3fn), max_query_len=8, max_seq_len=64)
    monkeypatch.setattr(flash_attention, "MIN_TOKENS", 11)
    ops.unified_attention(*_case(), max_query_len=8, max_seq_len=64)
    ours = ("ours", 8, 64, None, None)
    assert calls == [("ours", 1, 64, None, None), ours, ours]


def test_head_size_64_and_block_size_128_stay_on_ours(recorded):
    """The 1B's head size (slower through FlashAttention) and a page size not checked against
    the reference on a GPU: the whole step in our one launch, `_runs` notwithstanding."""
    ops, calls = recorded
    ops.unified_attention(*_case(head_size=64), max_query_len=8, max_seq_len=64)
    ops.unified_attention(*_case(block_size=128), max_query_len=8, max_seq_len=64)
    assert calls == [("ours", 8, 64, None, None)] * 2


def _assert_rows_close(out, case, scale, what):
    from llm_inference.kernels import reference

    q, k_cache, v_cache, table, cu, lens = case
    ref = reference.unified_attention(q.float(), k_cache, v_cache, table, cu, lens, scale)
    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            assert torch.isfinite(out[a:b]).all(), f"{what}: seq {s} not finite"
            err = ((out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()).item()
            assert err < ATTN_TOL[q.dtype], f"{what}: error {err:.2e} at seq {s} ({b - a} rows)"


@needs_fa4
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32, 8, 64), (32, 8, 128), (24, 8, 128)])
def test_flash_prompts_match_the_reference_on_cuda(shape, monkeypatch):
    """Chunks from 0 and after deep contexts beside decodes and empty sequences, block sizes 16,
    32 and 128; unused cache rows hold NaN. FlashAttention takes the chunks exactly where
    `applies` says (head size 128, block size 16 or 32), the Triton kernel the other cases; the
    result matches the reference in every case."""
    ops = triton_ops.TritonOps("cuda")
    assert ops.flash_prompts
    real, flash_blocks = flash_attention.prompt_attention, []

    def counted(q, k_cache, *rest):
        flash_blocks.append(k_cache.shape[1])
        return real(q, k_cache, *rest)

    monkeypatch.setattr(flash_attention, "prompt_attention", counted)
    gen = torch.Generator().manual_seed(shape[2])
    for block_size in (16, 32, 128):  # 128: FlashAttention's TMA block, its NaN once
        what = f"head size {shape[2]}, block size {block_size}"
        case, _ = checks.make_case("cuda", torch.bfloat16, GPU_Q, GPU_CTX, shape,
                                   block_size, gen)  # fmt: skip
        takes = flash_attention.applies(case[0], case[1])  # before: `_runs`'s call is cleared
        assert takes == (shape[2] == 128 and block_size in (16, 32)), what
        flash_blocks.clear()
        lens = [c + n for c, n in zip(GPU_CTX, GPU_Q)]
        out = ops.unified_attention(*case, shape[2] ** -0.5, max_query_len=max(GPU_Q),
                                    max_seq_len=max(lens))  # fmt: skip
        assert flash_blocks == ([block_size] if takes else []), what
        _assert_rows_close(out, case, shape[2] ** -0.5, what)


@needs_fa4
@pytest.mark.cuda
def test_flash_prompts_replay_in_a_cuda_graph():
    """Captured at fixed sizes as the engine's mixed-step graphs are, then replayed on new
    query lengths, contexts, tables and caches."""
    ops = triton_ops.TritonOps("cuda")
    num_seqs, max_query_len, max_len, block_size = 8, 512, 4096, 16
    num_tokens = num_seqs * max_query_len + 5
    width, num_blocks = max_len // block_size, num_seqs * max_len // block_size + 5
    gen = torch.Generator().manual_seed(0)

    def draw():
        q_lens = torch.randint(0, max_query_len + 1, (num_seqs,), generator=gen).tolist()
        q_lens[0] = 1  # a decode among them
        ctx = [int(torch.randint(0, max_len - n + 1, (), generator=gen)) for n in q_lens]
        return checks.make_case("cuda", torch.bfloat16, q_lens, ctx, (32, 8, 128), block_size,
                                gen, num_tokens - sum(q_lens), width, num_blocks)[0]  # fmt: skip

    static = draw()
    assert flash_attention.applies(static[0], static[1])  # head size 128, block size 16
    out = torch.empty_like(static[0])
    checks.check_replays(
        lambda: ops.unified_attention(*static, 0.088, out, max_query_len, max_len), static, draw,
        lambda replay: _assert_rows_close(out, static, 0.088, f"replay {replay}"),
    )  # fmt: skip
