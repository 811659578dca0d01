"""Sampling through the whole engine: seeds independent of batch companions, n > 1,
logprobs against transformers, stop strings, min_tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model

from llm_inference import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu", seed=0) as engine:
        yield engine


PROMPT = [5, 17, 42, 99, 3]


def test_seeded_request_same_alone_and_in_batches(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for k in (1, 3):
        companions = [torch.randint(2, 320, (7 * (i + 1),), generator=g).tolist() for i in range(k)]
        batch = companions[: k // 2] + [PROMPT] + companions[k // 2 :]
        params = [others] * (k // 2) + [p] + [others] * (k - k // 2)
        outs = llm.generate(batch, params, use_tqdm=False)
        assert outs[k // 2].token_ids == alone
    other_seed = llm.generate([PROMPT], p.replace(seed=99), use_tqdm=False)[0].token_ids
    assert other_seed != alone


def test_unseeded_requests_differ_and_n_completions(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3)
    out = llm.generate([PROMPT], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
    for c in out.outputs:
        # Random tokens may end inside a multi-byte character: that tail is not text yet.
        full = llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.text == full.rstrip("\ufffd")
    seeded = p.replace(seed=7)
    a = llm.generate([PROMPT], seeded, use_tqdm=False)[0]
    b = llm.generate([PROMPT], seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_logprobs_equal_transformers_log_softmax(llm, tiny_ckpt):
    p = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)
    out = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    ref = hf_model(tiny_ckpt)
    seq = torch.tensor([PROMPT + out.token_ids])
    with torch.no_grad():
        logp = ref(seq).logits[0].log_softmax(-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(PROMPT) - 1 + i]
        assert lp.token_id == tok
        assert abs(lp.logprob - row[tok].item()) < 1e-4
        want_top = row.topk(4)
        assert list(lp.top) == want_top.indices.tolist()
        assert torch.allclose(torch.tensor(list(lp.top.values())), want_top.values, atol=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_stop_string_cuts_text(llm):
    greedy = llm.generate([PROMPT], max_new_tokens=12, use_tqdm=False)[0]
    text = greedy.text
    assert len(text) > 6
    stop = text[3:6]
    p = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    out = llm.generate([PROMPT], p, use_tqdm=False)[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    keep = llm.generate([PROMPT], p.replace(include_stop_str_in_output=True), use_tqdm=False)
    assert keep[0].text == text[: text.index(stop) + len(stop)]
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_min_tokens_suppresses_eos(llm):
    greedy = llm.generate([PROMPT], max_new_tokens=10, use_tqdm=False)[0].token_ids
    eos = greedy[0]  # treat the first greedy token as a stop token
    p = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[eos])
    assert llm.generate([PROMPT], p, use_tqdm=False)[0].token_ids == [eos]
    out = llm.generate([PROMPT], p.replace(min_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) >= 5
    assert eos not in out.token_ids[:4]
