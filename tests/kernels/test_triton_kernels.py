"""Triton kernels against their PyTorch references (kernels/reference.py).

CPU: the interpreter cases of triton_kernel_checks.py (small sizes, float32 and float16; FP8
caches read by the paged attention, and stored where no rounding happens: the interpreter's
float32 -> float8 cast rounds wrongly) run once in a child process started with
TRITON_INTERPRET=1, so the interpreter is on before triton is imported there; each kernel
reports its own result.
GPU (skipped without CUDA): bfloat16 at real sizes: context lengths mixed from 1 to 4096 in one
batch, random non-contiguous block tables, block sizes 16 and 32, Llama 3 head shapes; the
paged attention and the KV stores with bfloat16 and FP8 caches.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import triton_kernel_checks as checks  # noqa: E402
from helpers import FP8_CACHES, needs_fp8  # noqa: E402
from interpreter import run_checks  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LLAMA_SHAPES = [(32, 8, 64), (24, 8, 128)]  # Llama 3.2 1B and 3B: (q heads, KV heads, head dim)


@pytest.fixture(scope="module")
def interpreter_results() -> tuple[dict[str, str], str]:
    return run_checks(HERE / "triton_kernel_checks.py")


@pytest.mark.parametrize("kernel", checks.INTERPRETER_KERNELS)
def test_kernel_matches_reference_in_interpreter(interpreter_results, kernel):
    results, log = interpreter_results
    assert results.get(kernel) == "ok", log[-8000:]


def test_ops_objects_have_the_protocol_and_reference_signatures():
    """get_ops' objects implement every KernelOps member; the Triton methods take the reference
    parameters first, any extras optional."""
    from llm_inference.kernels import KernelOps, get_ops
    from llm_inference.kernels.reference import ReferenceOps
    from llm_inference.kernels.triton_ops import TritonOps

    assert isinstance(get_ops("auto", "cpu"), ReferenceOps)
    assert isinstance(get_ops("reference", "cpu"), ReferenceOps)
    if torch.cuda.is_available():
        assert isinstance(get_ops("auto", "cuda"), TritonOps)
        assert isinstance(get_ops("reference", "cuda"), ReferenceOps)
    ref, fast = ReferenceOps(), TritonOps("cpu")
    assert (ref.fused_sampler, fast.fused_sampler) == (False, True)
    methods = [n for n in vars(KernelOps) if not n.startswith("_") and callable(getattr(ref, n))]
    assert {"linear", "gate_up_silu", "unified_attention", "warm_up_shapes"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(ref, name)).parameters.values())
        got = list(inspect.signature(getattr(fast, name)).parameters.values())
        assert [p.name for p in got[: len(want)]] == [p.name for p in want], name
        assert all(p.default is not inspect.Parameter.empty for p in got[len(want) :]), name
    for name in ("sample", "race_shard", "warm_up_sampler"):  # the fused sampler
        assert callable(getattr(fast, name)), name


def test_launchers_reject_bad_inputs():
    from llm_inference.kernels import triton_ops as ops

    q, kc = torch.randn(2, 4, 16), torch.randn(5, 16, 2, 16)
    bt, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_attention_decode(torch.randn(2, 3, 16), kc, kc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        ops.paged_attention_decode(q.half(), kc, kc, bt, lens, 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        ops.paged_attention_decode(q, kc, kc, bt.float(), lens, 1.0)
    with pytest.raises(ValueError, match="last dim"):
        ops.paged_attention_decode(q.transpose(1, 2).contiguous().transpose(1, 2), kc, kc, bt,
                                   lens, 1.0)  # fmt: skip
    from llm_inference.distributed.all_reduce_norm import all_reduce_add_rms_norm
    from llm_inference.kernels import paged_attention

    x, ptrs = torch.randn(2, 8), torch.zeros(2, dtype=torch.int64)
    for args, message in (
        ((x, x.half(), torch.ones(8), 1e-5, ptrs, ptrs, 0, 0), "residual"),
        ((x, x, torch.ones(8), 1e-5, ptrs, ptrs[:1], 0, 0), "one buffer and one flag"),
        ((x, x, torch.ones(8), 1e-5, ptrs, ptrs, 2, 0), "rank 2"),
        ((x.t(), x.t(), torch.ones(2), 1e-5, ptrs, ptrs, 0, 0), "last dim"),
    ):
        with pytest.raises(ValueError, match=message):
            all_reduce_add_rms_norm(*args)

    for order in (torch.arange(3, dtype=torch.int32), torch.arange(2).float()):
        with pytest.raises(ValueError, match=r"seq_order must be \[2\] int32 or int64"):
            paged_attention.launch(q, kc, kc, bt, lens, 1.0, None, 1, 16, seq_order=order)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5, torch.randn(3, 8).half())
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(torch.randn(3, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="last dim"):
        ops.silu_and_mul(torch.randn(8, 3).t())
    with pytest.raises(ValueError, match=r"floating point \[R, C\]"):
        ops.quantize_rows(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="one element"):
        ops.quantize_rows(torch.randn(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match=r"\[T, 2\*I\]"):
        ops.silu_and_mul_quant(torch.randn(2, 5))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        ops.rotary_embedding(torch.zeros(3, dtype=torch.long), torch.randn(3, 4, 16),
                             torch.randn(3, 2, 16), torch.randn(10, 8))  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.store_kv_cache(torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, kc,
                           torch.zeros(3, dtype=torch.float32))  # fmt: skip


def mixed_lens(num_seqs: int, block_size: int, seed: int) -> list[int]:
    """1 and 4096, block edges, and random lengths in between."""
    gen = torch.Generator().manual_seed(seed)
    edges = [1, 4096, block_size - 1, block_size, block_size + 1, 4095, 2 * block_size]
    rand = torch.randint(1, 4097, (num_seqs - len(edges),), generator=gen).tolist()
    return [edges[i] if i < len(edges) else rand.pop() for i in range(num_seqs)]


@cuda
@FP8_CACHES
@pytest.mark.parametrize("shape", LLAMA_SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_gpu_bf16(shape, block_size, fp8):
    from llm_inference.kernels.paged_attention import default_block_n

    block_n = default_block_n(shape[2], block_size)
    cfgs = [(1, block_n, False), (32, block_n, False), (3, 32, False), (32, block_n, True),
            (5, block_n, True), (128, block_n, False), (1, block_n, False, True),
            (5, block_n, True, True), (32, block_n, False, True)]  # fmt: skip
    lens = mixed_lens(40, block_size, seed=block_size)
    checks.check_paged_attention("cuda", torch.bfloat16, lens, *shape, block_size, 1, cfgs, fp8)


@cuda
def test_paged_attention_gpu_fp16_small_batch():
    lens = [4096, 1, 777]
    checks.check_paged_attention("cuda", torch.float16, lens, 24, 8, 128, 16, seed=3)


@cuda
@pytest.mark.parametrize("fused_merge", [False, True])
def test_paged_attention_replays_in_cuda_graph(fused_merge, monkeypatch):
    """No host sync: capture once, then change lengths, tables and q in place and replay."""
    from llm_inference.kernels import paged_attention
    from llm_inference.kernels.triton_ops import paged_attention_decode

    monkeypatch.setattr(paged_attention, "FUSED_MERGE", fused_merge)
    gen = torch.Generator().manual_seed(4)
    case = checks.make_paged_case("cuda", torch.bfloat16, [4096] * 8, 32, 8, 64, 16, gen)
    q, k_cache, v_cache, block_tables, lens = case
    out = torch.full_like(q, float("nan"))
    call = lambda: paged_attention_decode(q, k_cache, v_cache, block_tables, lens, 0.125, out)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in range(3):
        lens.copy_(torch.tensor(mixed_lens(8, 16, seed)))
        tables = torch.randint(0, k_cache.shape[0], block_tables.shape, generator=gen)
        block_tables.copy_(tables)
        q.copy_(torch.randn(q.shape, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        checks.assert_attention_close(out, *case, 0.125, f"replay {seed}")


@cuda
@pytest.mark.parametrize("hidden", [2048, 3072, 8192])
def test_rms_norm_gpu_bf16(hidden):
    checks.check_rms_norm("cuda", torch.bfloat16, 2048, hidden, seed=hidden)


@cuda
@pytest.mark.parametrize("inter", [8192, 14336])
def test_silu_and_mul_gpu_bf16(inter):
    checks.check_silu_and_mul("cuda", torch.bfloat16, 1024, inter, seed=inter)


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 14336])
def test_quantize_rows_gpu_bit_for_bit(dtype, hidden):
    """Llama 3 8B's linear inputs (hidden, MLP intermediate): scales and FP8 bytes equal."""
    checks.check_quantize_rows("cuda", dtype, 2048, hidden, seed=hidden)


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_quant_gpu(dtype):
    """Llama 3 8B's MLP intermediate (14,336): a prompt-sized step and a decode batch."""
    checks.check_silu_and_mul_quant("cuda", dtype, 2048, 14336, seed=1)
    checks.check_silu_and_mul_quant("cuda", dtype, 64, 14336, seed=2)


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_quant_gpu(dtype):
    """Llama 3 8B's hidden size (4,096): a prompt-sized step and a decode batch."""
    checks.check_rms_norm_quant("cuda", dtype, 2048, 4096, seed=1)
    checks.check_rms_norm_quant("cuda", dtype, 64, 4096, seed=2)


@cuda
@pytest.mark.parametrize("shape", LLAMA_SHAPES)
def test_rotary_gpu_bf16(shape):
    checks.check_rotary("cuda", torch.bfloat16, 4096, *shape, seed=shape[2])


@cuda
@FP8_CACHES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_kv_cache_gpu_bf16(block_size, head_dim, fp8):
    """FP8: rounded to nearest even and saturated bit for bit as reference.to_cache."""
    checks.check_store_kv_cache("cuda", torch.bfloat16, 4096, 8, head_dim, block_size, seed=1,
                                fp8=fp8)  # fmt: skip


@cuda
@FP8_CACHES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("shape", LLAMA_SHAPES)
def test_rotary_store_kv_gpu_bf16(shape, block_size, fp8):
    checks.check_rotary_store_kv("cuda", torch.bfloat16, 4096, *shape, block_size, seed=7,
                                 fp8=fp8)  # fmt: skip
