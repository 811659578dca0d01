"""Mixed-step CUDA graphs without a GPU: the bucket ladder and selection, and that padding a
step to its bucket (pad_mixed / pad_decode, graph_metadata) leaves every real row of attention
and the KV cache as the unpadded step gives them: with the reference kernels in process
(exactly) and with the Triton kernels under the interpreter (mixed_padding_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interpreter import run_checks
from mixed_padding_checks import CASES, run_case

from llm_inference.executor.cuda_graph import (
    DECODE,
    MIXED,
    CudaGraphs,
    mixed_buckets,
    mixed_graph_sizes,
)
from llm_inference.executor.input_batch import InputBuffers, StepInputs
from llm_inference.kernels.reference import ReferenceOps

HERE = Path(__file__).resolve().parent


def test_default_mixed_buckets():
    fine = [128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert mixed_buckets(8192) == [*fine, 8192]
    assert mixed_buckets(2048) == fine
    assert mixed_buckets(1000) == [128, 256, 512, 768, 1000]
    assert mixed_buckets(64) == [64]
    assert mixed_buckets(1) == []
    assert len(mixed_buckets(1 << 20)) <= 12


def test_mixed_graph_sizes_override(monkeypatch):
    """envs.LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES replaces the default ladder; sizes beyond the
    token budget are refused with the variable's name."""
    name = "LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES"
    monkeypatch.delenv(name, raising=False)
    assert mixed_graph_sizes(1000) == mixed_buckets(1000)
    monkeypatch.setenv(name, "64,16,64")
    assert mixed_graph_sizes(100) == [16, 64]
    monkeypatch.setenv(name, "")
    assert mixed_graph_sizes(100) == []
    monkeypatch.setenv(name, "100")
    assert mixed_graph_sizes(100) == [100]
    monkeypatch.setenv(name, "16,128")
    with pytest.raises(ValueError, match=f"{name}: 128 exceeds max_num_batched_tokens=100"):
        mixed_graph_sizes(100)


def step(num_tokens, num_seqs, max_query_len):
    return StepInputs([], num_tokens, num_seqs, max_query_len, 10, 1, [], [], [], [], [])


def test_select_picks_the_smallest_bucket_or_none():
    buffers = InputBuffers(max_tokens=512, max_seqs=40, max_blocks=4, device="cpu")
    graphs = CudaGraphs(None, buffers, 40, 64, mixed_sizes=[128, 64, 512], eager=True)
    assert graphs.mixed_buckets == [64, 128, 512]
    assert graphs.decode_buckets == [1, 2, 4, 8, 16, 32, 40]
    assert graphs.select(step(3, 3, 1)) == (DECODE, 4)
    assert graphs.select(step(40, 40, 1)) == (DECODE, 40)
    assert graphs.select(step(2, 1, 2)) == (MIXED, 64)  # a two-token prompt is a mixed step
    assert graphs.select(step(64, 30, 35)) == (MIXED, 64)
    assert graphs.select(step(65, 40, 26)) == (MIXED, 128)
    assert graphs.select(step(512, 1, 512)) == (MIXED, 512)
    assert graphs.select(step(513, 2, 500)) is None  # past the largest bucket: eager
    none = CudaGraphs(None, buffers, 40, 64, mixed_sizes=(), eager=True)
    assert none.select(step(20, 2, 10)) is None and none.select(step(2, 2, 1)) == (DECODE, 2)
    assert [k for k, _ in graphs.keys()] == [MIXED] * 3 + [DECODE] * 7
    assert graphs.keys()[0] == (MIXED, 512) and graphs.keys()[3] == (DECODE, 40)
    with pytest.raises(ValueError, match="exceeds"):
        CudaGraphs(None, buffers, 40, 64, mixed_sizes=[1024], eager=True)


def test_long_steps_pad_to_a_large_bucket_only_when_nearly_full():
    """Above 2,048 tokens a step takes a bucket only within 256 tokens of it (padded tokens
    cost GEMM time there); below, the smallest bucket as before."""
    buffers = InputBuffers(max_tokens=8192, max_seqs=8, max_blocks=4, device="cpu")
    graphs = CudaGraphs(None, buffers, 8, 64, mixed_sizes=mixed_buckets(8192), eager=True)
    assert graphs.select(step(2048, 3, 900)) == (MIXED, 2048)
    assert graphs.select(step(1800, 3, 900)) == (MIXED, 2048)
    assert graphs.select(step(2049, 3, 900)) is None  # 6,143 padded tokens: eager
    assert graphs.select(step(7935, 8, 4000)) is None
    assert graphs.select(step(7936, 8, 4000)) == (MIXED, 8192)
    assert graphs.select(step(8192, 8, 4000)) == (MIXED, 8192)
    assert graphs.select(step(8, 8, 1)) == (DECODE, 8)


@pytest.mark.parametrize("case", list(CASES))
def test_padding_keeps_real_rows_reference(case):
    run_case(case, ReferenceOps(), torch.float32, exact=True)


@pytest.fixture(scope="module")
def interpreter_results():
    return run_checks(HERE / "mixed_padding_checks.py")


@pytest.mark.parametrize("case", list(CASES))
def test_padding_keeps_real_rows_triton_interpreter(interpreter_results, case):
    results, log = interpreter_results
    assert results.get(case) == "ok", log[-8000:]
