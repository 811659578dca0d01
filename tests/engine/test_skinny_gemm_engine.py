"""On CUDA: the engine with the skinny GEMM (the Triton ops' choice for decode-sized matmuls,
on by default; LLM_INFERENCE_SKINNY_GEMM=0 turns it off) gives the greedy tokens it gives
without (the sharp random checkpoint of test_triton_engine.py, float16, with and without CUDA
graphs), and the kernels did run: their calls are counted (during the warm-up and capture of
each graph, or on each eager step).

The kernels round differently from cuBLAS (the fused gate_up keeps gate and up in float32
before the activation; split-K adds in another order), so where the two best tokens are within
rounding of each other the argmax may legitimately flip: as in test_triton_engine.py, tokens
must be identical up to the first difference, which must be a near-tie of the run without.

An FP8 engine (compute capability 8.9+) takes the kernels on its FP8 weights in decode steps
and torch._scaled_mm without them, and its requests compile nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_greedy_close,
    make_sharp_checkpoint,
    needs_fp8,
    random_prompts,
    triton_compiles,
)

from llm_inference import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from fp8_testfiles import steady  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEAR_TIE = 0.15  # log-probability gap under which fp16 rounding may flip the argmax


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """The kernels' calls: {"gemm": n, "silu": n, "fp8": those of them on FP8 weights, "rows":
    the most rows of one}."""
    from llm_inference.kernels import skinny_gemm as sg

    calls = {"gemm": 0, "silu": 0, "fp8": 0, "rows": 0}

    def counting(name, fn):
        def wrapper(x, *args, **kwargs):
            calls[name] += 1
            calls["fp8"] += kwargs.get("weight_scale") is not None
            calls["rows"] = max(calls["rows"], x.shape[0])
            return fn(x, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(sg, "skinny_gemm", counting("gemm", sg.skinny_gemm))
    monkeypatch.setattr(sg, "skinny_gemm_silu", counting("silu", sg.skinny_gemm_silu))
    return calls


@pytest.mark.parametrize("seqs", [8, 32], ids=lambda n: f"seqs{n}")
@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_skinny_gemm_greedy_equals_cublas(tmp_path, counted, eager, seqs, monkeypatch):
    """With 32 sequences the decode steps reach 17-32 rows (the dot padded to 32)."""
    folder = make_sharp_checkpoint(tmp_path, hidden_size=1024, intermediate_size=2816)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    prompts = random_prompts() * (seqs // 8)
    runs = {}
    for skinny in (True, False):
        counted.update(gemm=0, silu=0, fp8=0, rows=0)
        monkeypatch.setenv("LLM_INFERENCE_SKINNY_GEMM", "1" if skinny else "0")
        with LLM(
            str(folder),
            device="cuda",
            dtype="float16",
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=eager,
            max_num_seqs=seqs,
        ) as llm:
            runs[skinny] = llm.generate(prompts, params, use_tqdm=False)
        layers = 3
        if skinny:  # qkv, o, down per layer plus the LM head; gate_up fused
            assert counted["silu"] >= layers and counted["gemm"] >= 3 * layers + 1, counted
            assert counted["fp8"] == 0, counted
            assert counted["rows"] > 16 or seqs <= 16, counted
        else:
            assert counted == {"gemm": 0, "silu": 0, "fp8": 0, "rows": 0}
    assert_greedy_close(runs[True], runs[False], NEAR_TIE, "skinny GEMM")


@needs_fp8
@pytest.mark.parametrize("seqs", [8, 32], ids=lambda n: f"seqs{n}")
@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_fp8_decode_steps_take_the_skinny_gemm(tmp_path, counted, eager, seqs, monkeypatch):
    """quantization="fp8" in bfloat16: decode steps run the kernels on the FP8 weights (qkv, o
    and down the GEMM, gate_up the fused variant, in each of the 2 layers), no request compiles
    a kernel, and greedy tokens follow the engine without them (torch._scaled_mm at every step)
    up to near ties as wide as test_fp8_checkpoints.py's CUDA test's: the two differ by the
    activations' FP8 rounding (W8A16 against W8A8), ~1 nat on this checkpoint's large logits.
    With 32 sequences the decode steps reach 17-32 rows (the dot padded to 32), which the
    engine's kernel takes too (envs.LLM_INFERENCE_SKINNY_ROWS)."""
    folder = steady(tmp_path / "peaked", make_sharp_checkpoint, factor=100, num_hidden_layers=2)
    prompts = random_prompts((1, 7, 33, 120, 250) * (seqs // 5))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs = {}
    for skinny in (True, False):
        counted.update(gemm=0, silu=0, fp8=0, rows=0)
        monkeypatch.setenv("LLM_INFERENCE_SKINNY_GEMM", "1" if skinny else "0")
        with LLM(str(folder), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                 enforce_eager=eager, quantization="fp8", max_num_seqs=seqs) as llm:  # fmt: skip
            with triton_compiles() as compiled:
                runs[skinny] = llm.generate(prompts, params, use_tqdm=False)
        assert compiled == [], compiled.details
        if skinny:
            assert counted["fp8"] >= 4 * 2 and counted["silu"] >= 2, counted
            assert counted["rows"] > 16 or seqs <= 16, counted
        else:
            assert counted == {"gemm": 0, "silu": 0, "fp8": 0, "rows": 0}
    assert_greedy_close(runs[True], runs[False], near_tie=1.5, who="FP8 skinny GEMM")
