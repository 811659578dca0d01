"""SamplingParams.prompt_logprobs on the CPU engine against transformers' log_softmax of the
same prompt: every prompt token after the first, in one step or in chunks, beside other
requests, in a batch that preempts, when the prompt is already in the prefix cache, and with
n > 1.
(TP=2 against TP=1: tests/distributed/test_tp_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model

from llm_inference import LLM, SamplingParams

PROMPT = [5 + (i * 7) % 250 for i in range(70)]
K = 3


@pytest.fixture(scope="module")
def reference(tiny_ckpt) -> torch.Tensor:
    """log_softmax of transformers' logits at each prompt position [len - 1, V]."""
    with torch.no_grad():
        logits = hf_model(tiny_ckpt)(torch.tensor([PROMPT])).logits[0, :-1]
    return logits.float().log_softmax(-1)


def check(prompt_lps, reference, k: int = K, tol: float = 1e-4) -> None:
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    for p in range(1, len(PROMPT)):
        lp, ref = prompt_lps[p], reference[p - 1]
        assert lp.token_id == PROMPT[p]
        assert lp.logprob == pytest.approx(ref[PROMPT[p]].item(), abs=tol)
        want = ref.topk(k)
        assert list(lp.top) == want.indices.tolist()  # most likely first
        assert list(lp.top.values()) == pytest.approx(want.values.tolist(), abs=tol)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, **kw})


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 3}],
    ids=["one_step", "chunked"],
)
def test_prompt_logprobs_equal_transformers(tiny_ckpt, reference, engine):
    with LLM(str(tiny_ckpt), device="cpu", **engine) as llm:
        plain = llm.generate([PROMPT, PROMPT[:9]], params(), use_tqdm=False)
        out = llm.generate(
            [PROMPT[:9], PROMPT, [7, 8]],
            [params(), params(prompt_logprobs=K), params(prompt_logprobs=0)],
            use_tqdm=False,
        )
        check(out[1].prompt_logprobs, reference)
        assert out[0].prompt_logprobs is None  # only who asked
        assert out[2].prompt_logprobs[1].top == {} and out[2].prompt_logprobs[1].token_id == 8
        # the companions' tokens are unchanged, and so are the asker's
        assert out[0].token_ids == plain[1].token_ids and out[1].token_ids == plain[0].token_ids
        # the prompt is now in the prefix cache: a plain request hits it, an asker does not
        hits = llm.stats()["prefix_cache_hits"]
        llm.generate([PROMPT], params(), use_tqdm=False)
        assert llm.stats()["prefix_cache_hits"] > hits
        hits = llm.stats()["prefix_cache_hits"]
        (again,) = llm.generate([PROMPT], params(prompt_logprobs=K, n=2), use_tqdm=False)
        assert llm.stats()["prefix_cache_hits"] == hits
        check(again.prompt_logprobs, reference)


def test_prompt_logprobs_in_a_batch_that_preempts(tiny_ckpt, reference):
    """In a batch whose KV cache runs out (requests preempted and recomputed), the asker's
    prompt logprobs are still one per token and right. (That a recomputed prompt adds nothing
    twice is checked directly in tests/core/test_scheduler.py.)"""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block * kv heads * dim * fp32
    with LLM(str(tiny_ckpt), device="cpu", kv_cache_memory_bytes=8 * block_bytes,
             max_model_len=128, block_size=16) as llm:  # fmt: skip
        others = [[9 + i] * 40 for i in range(3)]
        # admitted last: the newest request, which the scheduler preempts first
        outs = llm.generate(
            [*others, PROMPT],
            [params(max_tokens=40)] * 3 + [params(prompt_logprobs=K, max_tokens=40)],
            use_tqdm=False,
        )
        assert llm.stats()["num_preemptions"] > 0
    check(outs[-1].prompt_logprobs, reference)


def test_prompt_logprobs_validated():
    for bad in (-1, 21, 1.0):
        with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer"):
            SamplingParams(prompt_logprobs=bad)
