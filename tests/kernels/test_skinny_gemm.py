"""The skinny GEMM (kernels/skinny_gemm.py) and its wiring into the layers.

CPU: skinny_gemm_checks.py in two child processes under TRITON_INTERPRET=1 (float32 and
float16, M = 1, 3, 8, 16, N and K not multiples of the blocks, split-K off and on, the fused
SiLU variant; where the Triton ops' linear takes the kernels; the model at one rank and the
parallel layers at two gloo ranks on the Triton ops in float16; FP8 weights: every M of 1 to
16, every e4m3 value exact, the FP8 linear method and an FP8 model); the config rule; the
launchers' input checks.
GPU (skipped without CUDA): bfloat16 at the Llama 3.2 1B and 3B shapes (and their TP=2 halves)
against float64 math, with the default configs; replay inside a CUDA graph; FP8 weights (compute
capability 8.9+) at the Llama 3.1 8B shapes with bfloat16 activations.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import skinny_gemm_checks as checks  # noqa: E402
from helpers import needs_fp8  # noqa: E402
from interpreter import run_checks  # noqa: E402

from llm_inference.kernels import skinny_gemm as sg  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
fp8 = needs_fp8

# (N, K) of each linear layer; gate_up is [2I, K] (the fused kernel's output is I wide).
SHAPES = {
    "1B": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
           "down": (2048, 8192), "lm_head": (128256, 2048)},
    "3B": {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072),
           "down": (3072, 8192), "lm_head": (128256, 3072)},
}  # fmt: skip
# Llama 3.1 8B's FP8 layers (its LM head stays bfloat16)
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}  # fmt: skip
H200_SMS = 132


def _tp2(name: str, n: int, k: int) -> tuple[int, int]:
    """One rank's shape at TP=2: column-parallel layers halve N, row-parallel ones K."""
    return (n, k // 2) if name in ("o", "down") else (n // 2, k)


GPU_CASES = [(f"{model} {name}", n, k) for model, layers in SHAPES.items()
             for name, (n, k) in layers.items()]  # fmt: skip
GPU_CASES += [(f"{model} {name} tp2", *_tp2(name, n, k)) for model, layers in SHAPES.items()
              for name, (n, k) in layers.items() if name != "lm_head"]  # fmt: skip


@pytest.fixture(scope="module")
def interpreter_results() -> tuple[dict[str, str], str]:
    others = [c for c in checks.INTERPRETER_CHECKS if c not in checks.FP8_CHECKS]
    return run_checks(HERE / "skinny_gemm_checks.py", (others, checks.FP8_CHECKS))


@pytest.mark.parametrize("check", checks.INTERPRETER_CHECKS)
def test_skinny_gemm_in_interpreter(interpreter_results, check):
    results, log = interpreter_results
    assert results.get(check) == "ok", log[-8000:]


def test_default_config_fills_the_sms():
    """At the real shapes on 132 SMs: blocks x split reach FILL of the SMs unless another
    doubling would cut K ranges below MIN_K_PER_SPLIT; split-K only where blocks are few."""
    for model, layers in SHAPES.items():
        for name, (n, k) in layers.items():
            for n_out, k_in in ((n, k), _tp2(name, n, k)):
                n_out = n_out // 2 if name == "gate_up" else n_out  # the fused output
                cfg = sg.default_config(n_out, k_in, H200_SMS)
                blocks = -(-n_out // cfg.block_n)
                split, _ = sg.split_plan(k_in, cfg)
                assert split == cfg.split_k, (model, name, cfg)
                full = blocks * split >= sg.FILL * H200_SMS
                assert full or k_in // (2 * split) < sg.MIN_K_PER_SPLIT, (model, name, cfg)
                if split > 1:
                    assert blocks * split // 2 < sg.FILL * H200_SMS, (model, name, cfg)
    assert sg.default_config(2048, 8192, H200_SMS).split_k == 4  # 1B down: 32 blocks
    assert sg.default_config(8192, 2048, H200_SMS).split_k == 1  # 1B gate_up, fused
    assert sg.default_config(128256, 3072, H200_SMS).split_k == 1  # LM head
    tiny = sg.default_config(40, 24, H200_SMS)
    assert (tiny.block_n, tiny.block_k, tiny.split_k) == (64, 32, 1)
    # FP8 weights: twice the fill target (8B shapes: the split the sweep found fastest)
    assert sg.default_config(6144, 4096, H200_SMS, fp8=True).split_k == 4  # qkv: 96 blocks
    assert sg.default_config(4096, 14336, H200_SMS, fp8=True).split_k == 4  # down
    assert sg.default_config(14336, 4096, H200_SMS, fp8=True).split_k == 1  # gate_up, fused


def test_split_plan_never_makes_empty_ranges():
    for k in (16, 100, 128, 129, 1000, 8192):
        for split_k in (1, 2, 3, 8, 64):
            cfg = sg.GemmConfig(block_n=32, block_k=64, split_k=split_k)
            split, per = sg.split_plan(k, cfg)
            assert per % 64 == 0 and 1 <= split <= split_k
            assert (split - 1) * per < k <= split * per, (k, split_k, split, per)


def test_launchers_reject_bad_inputs():
    x, w = torch.randn(3, 32), torch.randn(48, 32)
    with pytest.raises(ValueError, match="rows"):
        sg.skinny_gemm(torch.randn(65, 32), w)
    with pytest.raises(ValueError, match="rows"):
        sg.skinny_gemm(torch.randn(0, 32), w)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        sg.skinny_gemm(x, torch.randn(48, 31))
    with pytest.raises(ValueError, match="dtype"):
        sg.skinny_gemm(x, w.half())
    with pytest.raises(ValueError, match="dtype"):
        sg.skinny_gemm(x.double(), w.double())
    with pytest.raises(ValueError, match="last dim"):
        sg.skinny_gemm(x, torch.randn(32, 48).t())
    with pytest.raises(ValueError, match="out must be"):
        sg.skinny_gemm(x, w, out=torch.empty(3, 47))
    with pytest.raises(ValueError, match="gate then up"):
        sg.skinny_gemm_silu(x, torch.randn(47, 32))
    with pytest.raises(ValueError, match="block_k"):
        sg.GemmConfig(block_k=48)
    q, scale = w.to(sg.FP8), torch.ones(48)
    with pytest.raises(ValueError, match="with weight_scale"):
        sg.skinny_gemm(x, q)  # FP8 without its scales
    with pytest.raises(ValueError, match="with weight_scale"):
        sg.skinny_gemm(x, w, weight_scale=scale)  # scales of a weight in x's dtype
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[48\]"):
        sg.skinny_gemm(x, q, weight_scale=torch.ones(47))
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        sg.skinny_gemm_silu(x, q, weight_scale=scale.half())
    x8, x_scale = x.to(sg.FP8), torch.ones(3)
    with pytest.raises(ValueError, match="x_scale takes x and weight in"):
        sg.skinny_gemm(x, q, weight_scale=scale, x_scale=x_scale)  # x not FP8
    with pytest.raises(ValueError, match="x_scale takes x and weight in"):
        sg.skinny_gemm(x8, w, x_scale=x_scale, out_dtype=torch.float32)  # no weight_scale
    with pytest.raises(ValueError, match="x_scale takes x and weight in"):
        sg.skinny_gemm(x8, w, weight_scale=scale, x_scale=x_scale, out_dtype=x.dtype)  # w not FP8
    with pytest.raises(ValueError, match=r"x_scale must be float32 \[3\]"):
        sg.skinny_gemm(x8, q, weight_scale=scale, x_scale=torch.ones(3, 1), out_dtype=x.dtype)
    with pytest.raises(ValueError, match="result's dtype"):
        sg.skinny_gemm(x8, q, weight_scale=scale, x_scale=x_scale)  # no out_dtype


@cuda
def test_the_cuda_ops_take_the_kernel_only_on_cuda_half_and_few_rows(monkeypatch):
    from llm_inference.kernels.triton_ops import TritonOps

    monkeypatch.delenv("LLM_INFERENCE_SKINNY_GEMM", raising=False)
    monkeypatch.delenv("LLM_INFERENCE_SKINNY_ROWS", raising=False)
    ops = TritonOps("cuda")
    assert ops.skinny_rows == 32  # the default (benchmarks/DECISIONS.md)
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    assert not ops.skinny_applies(torch.randn(2, 4, dtype=torch.bfloat16), w)  # CPU
    wc = w.cuda()
    assert ops.skinny_applies(torch.randn(32, 4, dtype=torch.bfloat16, device="cuda"), wc)
    assert not ops.skinny_applies(torch.randn(33, 4, dtype=torch.bfloat16, device="cuda"), wc)
    assert not ops.skinny_applies(torch.randn(2, 4, device="cuda"), wc.float())  # float32
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    x16 = torch.randn(16, 4, dtype=torch.bfloat16, device="cuda")
    assert ops.skinny_applies(x16, wc.to(sg.FP8)) == ops.skinny_fp8 == fp8_ok
    monkeypatch.setenv("LLM_INFERENCE_SKINNY_ROWS", "64")  # to measure more rows
    ops = TritonOps("cuda")
    assert ops.skinny_applies(torch.randn(64, 4, dtype=torch.bfloat16, device="cuda"), wc)
    assert not ops.skinny_applies(torch.randn(65, 4, dtype=torch.bfloat16, device="cuda"), wc)


@cuda
@pytest.mark.parametrize("case,n,k", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_skinny_gemm_gpu_bf16(case, n, k):
    for m in (1, 3, 8, 16, 17, 40, 64):
        if "gate_up" in case:
            checks.check_silu("cuda", torch.bfloat16, m, n // 2, k, seed=m)
            if m in (1, 16):
                checks.check_gemm("cuda", torch.bfloat16, m, n, k, seed=m)
        else:
            checks.check_gemm("cuda", torch.bfloat16, m, n, k, seed=m)


@cuda
def test_skinny_gemm_gpu_fp16_and_forced_splits():
    cfg = sg.GemmConfig(block_n=32, block_k=64, split_k=8)
    checks.check_gemm("cuda", torch.float16, 5, 2048, 8192, seed=1)
    checks.check_gemm("cuda", torch.bfloat16, 5, 1000, 3000, cfg, seed=2, want_split=8)
    checks.check_silu("cuda", torch.bfloat16, 16, 1000, 3000, cfg, seed=3, want_split=8)
    checks.check_gemm("cuda", torch.float32, 2, 300, 700, seed=4)  # IEEE dot products
    pre = sg.GemmConfig(block_n=64, block_k=128, split_k=4, prefetch=True)  # PDL's prefetch
    checks.check_gemm("cuda", torch.bfloat16, 3, 2048, 8192, pre, seed=5, want_split=4)
    checks.check_silu("cuda", torch.bfloat16, 1, 8192, 2048, pre, seed=6, want_split=4)


@fp8
@pytest.mark.parametrize("layer", list(SHAPES_8B))
def test_skinny_gemm_gpu_fp8(layer):
    """FP8 weights, bfloat16 activations, the default configs (float16 at one size)."""
    n, k = SHAPES_8B[layer]
    for m in (1, 3, 8, 16, 17, 40, 64):
        if layer == "gate_up":
            checks.check_silu("cuda", torch.bfloat16, m, n // 2, k, seed=m, fp8=True)
        else:
            checks.check_gemm("cuda", torch.bfloat16, m, n, k, seed=m, fp8=True)
    checks.check_gemm("cuda", torch.float16, 5, n, k, seed=7, fp8=True)


@fp8
@pytest.mark.parametrize("dot", [True, False], ids=["fp8_dot", "w8a16"])
def test_skinny_gemm_gpu_fp8_dots(dot):
    """Both dots on FP8 weights (GemmConfig.fp8_dot): the FP8 x FP8 dot against float64 math
    on x quantized per row and BLOCK_K columns as the kernel does (so a wrong scale or chunk
    shows), W8A16 against it on x; split and unsplit, plain and fused, K not a multiple of
    the tiles."""
    for split, block_k in ((1, 128), (4, 128), (8, 64), (2, 32)):
        cfg = sg.GemmConfig(block_n=64, block_k=block_k, split_k=split, fp8_dot=dot)
        for m in (1, 5, 16):
            checks.check_gemm("cuda", torch.bfloat16, m, 1000, 3000, cfg, seed=m, fp8=True)
            checks.check_silu("cuda", torch.bfloat16, m, 700, 2900, cfg, seed=m, fp8=True)
    checks.check_gemm("cuda", torch.float16, 3, 4096, 4096, cfg, seed=9, fp8=True)


@fp8
@pytest.mark.parametrize("layer", list(SHAPES_8B))
def test_skinny_gemm_gpu_fp8_x_quantized_per_token(layer):
    """x given in FP8 with a scale per row (`x_scale`, as the norm kernels quantize it): the
    8B shapes at the default configs, with the PDL prefetch, and at a forced split."""
    n, k = SHAPES_8B[layer]
    check = checks.check_silu if layer == "gate_up" else checks.check_gemm
    width = n // 2 if layer == "gate_up" else n
    pre = sg.GemmConfig(block_n=64, block_k=128, split_k=4, prefetch=True)
    for m in (1, 3, 16, 40):
        check("cuda", torch.bfloat16, m, width, k, seed=m, fp8=True, x_fp8=True)
        check("cuda", torch.bfloat16, m, width, k, pre, seed=m, fp8=True, x_fp8=True)
    check("cuda", torch.float16, 5, width, k, seed=7, fp8=True, x_fp8=True)


@fp8
def test_skinny_gemm_gpu_fp8_dot_takes_block_k_of_32():
    x, w = torch.ones(1, 64, device="cuda", dtype=torch.bfloat16), torch.ones(64, 64, device="cuda")
    cfg = sg.GemmConfig(block_n=64, block_k=16)
    with pytest.raises(ValueError, match="block_k >= 32"):
        sg.skinny_gemm(x, w.to(sg.FP8), weight_scale=torch.ones(64, device="cuda"), config=cfg)
    assert sg.default_config(64, 16, H200_SMS, fp8=True).block_k == 32


@fp8
def test_skinny_gemm_gpu_fp8_exact_and_forced_splits():
    for dtype in (torch.bfloat16, torch.float16):
        checks.check_fp8_exact("cuda", dtype)
    cfg = sg.GemmConfig(block_n=32, block_k=64, split_k=8)
    checks.check_gemm("cuda", torch.bfloat16, 5, 1000, 3000, cfg, seed=2, want_split=8, fp8=True)
    checks.check_silu("cuda", torch.bfloat16, 16, 1000, 3000, cfg, 3, want_split=8, fp8=True)
    pre = sg.GemmConfig(block_n=64, block_k=128, split_k=4, prefetch=True)  # PDL's prefetch
    checks.check_gemm("cuda", torch.bfloat16, 3, 4096, 14336, pre, 5, want_split=4, fp8=True)
    checks.check_silu("cuda", torch.bfloat16, 1, 14336, 4096, pre, 6, want_split=4, fp8=True)
    wide = sg.GemmConfig(block_n=64, block_k=256)  # the larger FP8 tile the benchmark sweeps
    checks.check_gemm("cuda", torch.bfloat16, 8, 4096, 4096, wide, seed=8, fp8=True)


@cuda
@pytest.mark.parametrize("fp8_weight", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fused", [False, True])
def test_skinny_gemm_replays_in_cuda_graph(fused, fp8_weight):
    """Workspace allocated and reduce launched inside the capture; new inputs, same graph."""
    if fp8_weight and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's FP8 (e4m3) needs CUDA compute capability 8.9+")
    n, k = (4096, 2048) if fused else (2048, 8192)  # a split-K shape on any large GPU
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).bfloat16()
    x = torch.randn(8, k, generator=g, device="cuda").bfloat16()
    fn = sg.skinny_gemm_silu if fused else sg.skinny_gemm
    if fp8_weight:
        scale = w.float().abs().amax(dim=1) / 448
        w = (w.float() / scale[:, None]).to(sg.FP8)
        fn = functools.partial(fn, weight_scale=scale)
    fn(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w)
    for _ in range(3):
        x.copy_(torch.randn(8, k, generator=g, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, fn(x, w), rtol=0, atol=0)
