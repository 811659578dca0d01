"""On a CUDA GPU of compute capability 9.0+: the engine with PDL (programmatic dependent launch
for the decode step's Triton kernels, kernels/pdl.py; a property of the Triton ops object, on by
default, LLM_INFERENCE_PDL=0 turns it off) gives exactly the tokens and logprobs it gives
without, with CUDA graphs and eagerly, at TP=1. Every PDL kernel waits for the previous one
before it touches memory, so nothing may differ, not even at a near-tie."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sharp_checkpoint

from llm_inference import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9.0+",
)


def _ops(llm):
    return llm.engine.executor.workers[0].model_runner.ops


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in (1, 9, 40, 130, 3)]


@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_pdl_changes_no_token(tmp_path, eager, monkeypatch):
    folder = make_sharp_checkpoint(tmp_path, hidden_size=1024, intermediate_size=2816)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    runs = {}
    for flag in (True, False):
        monkeypatch.setenv("LLM_INFERENCE_PDL", "1" if flag else "0")
        with LLM(
            str(folder), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
            enforce_eager=eager, max_num_seqs=8,
        ) as llm:  # fmt: skip
            assert _ops(llm).pdl is flag
            runs[flag] = llm.generate(_prompts(), params, use_tqdm=False)
    for on, off in zip(runs[True], runs[False]):
        assert on.token_ids == off.token_ids
        assert on.outputs[0].logprobs == off.outputs[0].logprobs


def test_pdl_is_on_by_default_on_hopper(tmp_path, monkeypatch):
    folder = make_sharp_checkpoint(tmp_path, hidden_size=256, intermediate_size=512)
    monkeypatch.delenv("LLM_INFERENCE_PDL", raising=False)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_memory_bytes=16 << 20)
    with LLM(str(folder), **kw) as llm:
        assert _ops(llm).pdl
    monkeypatch.setenv("LLM_INFERENCE_PDL", "0")
    with LLM(str(folder), **kw) as llm:
        assert not _ops(llm).pdl
