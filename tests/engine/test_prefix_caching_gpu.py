"""On CUDA, bfloat16: prefix caching through the Triton path (CUDA graphs for decode and mixed
steps, async scheduling) gives the greedy tokens of the PyTorch reference path with caching
off, on the turns of test_prefix_caching_engine.py (prefixes ending inside a block and at a
block edge, a full-prompt hit, a follow-up turn hitting decoded blocks) and with preemption.

The two paths round differently, so sequences may part where the reference's two best tokens
are nearly tied (as in test_triton_engine.py; bfloat16 rounds 8x coarser than float16)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sharp_checkpoint
from test_prefix_caching_engine import FIRST, SECOND, tokens

from llm_inference import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEAR_TIE = 8 * 0.15
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_turns(folder, fast: bool, follow: list[int] | None = None, **kw):
    """The three turns; the reference run asks for logprobs (to judge a difference). The
    follow-up turn resends the first conversation with its answer: `follow` (the fast run's
    answer, so that both runs get the same prompt even where their answers parted at a near
    tie), by default the run's own."""
    params = PARAMS if fast else PARAMS.replace(logprobs=5)
    with LLM(
        str(folder), device="cuda", dtype="bfloat16", block_size=16,
        kernel_backend="auto" if fast else "reference", enable_prefix_caching=fast, **kw,
    ) as llm:  # fmt: skip
        first = llm.generate(FIRST, params, use_tqdm=False)
        second = llm.generate(SECOND, params, use_tqdm=False)
        answer = first[0].token_ids if follow is None else follow
        follow_up = FIRST[0] + answer + tokens(4, 6)
        third = llm.generate([follow_up], params, use_tqdm=False)
        stats = llm.stats()
    return first + second + third, stats


BLOCK_BYTES = 16 * 2 * 2 * 2 * 64 * 2  # tokens x layers x (K, V) x KV heads x head_dim x bf16


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_cache_memory_bytes=64 << 20),
        dict(kv_cache_memory_bytes=7 * BLOCK_BYTES, max_model_len=112, max_num_seqs=4),
    ],
    ids=["default", "preempting"],
)
def test_caching_on_triton_equals_reference_off(tmp_path, kw):
    folder = make_sharp_checkpoint(tmp_path, num_hidden_layers=2)
    fast, fast_stats = run_turns(folder, True, **kw)
    ref, _ = run_turns(folder, False, follow=fast[0].token_ids, **kw)
    assert [o.prompt_token_ids for o in fast] == [o.prompt_token_ids for o in ref]
    assert fast_stats["prefix_cache_hits"] >= 2 * 16  # the cache was used
    if "max_model_len" in kw:
        assert fast_stats["num_preemptions"] > 0
    exact = 0
    for i, (f, r) in enumerate(zip(fast, ref)):
        a, b = f.token_ids, r.token_ids
        j = next((k for k in range(len(a)) if a[k] != b[k]), None)
        if j is None:
            exact += 1
            continue
        top = r.outputs[0].logprobs[j].top
        assert a[j] in top and top[b[j]] - top[a[j]] < NEAR_TIE, f"prompt {i} step {j}"
    assert exact >= len(fast) // 2
    assert fast_stats["num_free_kv_blocks"] == fast_stats["num_kv_blocks"]
