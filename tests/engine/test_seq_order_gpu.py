"""On CUDA: decode steps of at least ORDER_MIN_SEQS sequences dispatch their attention programs
longest context first (`seq_order`, built by the input batch, followed by
kernels/unified_attention.py from ORDER_MIN_SEQS sequences on). Only the order in which programs
start changes, never what one computes, so (at the same split count) tokens and logprobs must be
exactly those of batch order, with CUDA graphs and eagerly."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sharp_checkpoint

from llm_inference import LLM, SamplingParams
from llm_inference.kernels import paged_attention, unified_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts():
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 300, (40,), generator=g).tolist()
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("eager", [False, True], ids=["cuda_graphs", "eager"])
def test_longest_first_changes_no_token(tmp_path, eager, monkeypatch):
    folder = make_sharp_checkpoint(tmp_path, head_dim=128)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    ordered_steps = []
    real_launch = paged_attention.launch

    def spy(*args, **kwargs):  # the decode kernel's launches (at graph capture, or each step)
        ordered_steps.append(kwargs.get("seq_order") is not None)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "launch", spy)
    # Ordered launches also split further (ORDERED_WAVES), which rounds differently: the same
    # split rule in both runs, so that only the dispatch order differs.
    monkeypatch.setattr(paged_attention, "ORDERED_WAVES", paged_attention.WAVES)
    runs = {}
    for min_seqs in (unified_attention.ORDER_MIN_SEQS, 10**9):  # longest first, then batch order
        monkeypatch.setattr(unified_attention, "ORDER_MIN_SEQS", min_seqs)
        ordered_steps.clear()
        with LLM(
            str(folder), device="cuda", dtype="bfloat16", kv_cache_memory_bytes=256 << 20,
            enforce_eager=eager, max_num_seqs=48,
        ) as llm:  # fmt: skip
            runs[min_seqs] = llm.generate(_prompts(), params, use_tqdm=False)
        assert any(ordered_steps) == (min_seqs < 10**9)
    ordered, plain = runs.values()
    for a, b in zip(ordered, plain):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
