"""Prefix caching through the real engine (tiny random checkpoint, float32 on CPU): greedy
outputs are the same with caching on and off (and as transformers'), on prompts sharing
prefixes that end inside a block and at a block edge, full-prompt hits, follow-up turns that
hit decoded blocks, n > 1 completions, and preemption (with a float32 and an FP8 KV cache);
the switch and the stats."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import hf_model

from llm_inference import LLM, SamplingParams
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.entrypoints.cli import build_parser

BLOCK = 16  # the default block size; one block of the tiny model is 8192 bytes in float32
BLOCK_BYTES = {"auto": 8192, "fp8": 2048}  # by kv_cache_dtype (FP8: one byte an element)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 300) for _ in range(n)]


BASE = tokens(0, 70)
FIRST = [BASE[:40] + tokens(1, 5)]
SECOND = [
    BASE[:40] + tokens(1, 5),  # the same prompt again: a full-prompt hit (2 of 3 blocks)
    BASE[:16] + tokens(2, 9),  # shares exactly one block
    BASE[:20] + tokens(3, 7),  # shares a prefix ending inside block 1: one block hit
    BASE[:32],  # two full blocks: the hit stops at one, the last block is recomputed
    BASE[:33],  # one token past the edge: a two-block hit, one token computed
    BASE[:70],
]


def llm(ckpt, caching: bool, **kw) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", enable_prefix_caching=caching, **kw)


def run_turns(ckpt, caching: bool, **kw):
    """Three calls: a first prompt, prompts sharing its prefix, then a follow-up turn."""
    with llm(ckpt, caching, **kw) as engine:
        first = engine.generate(FIRST, GREEDY, use_tqdm=False)
        second = engine.generate(SECOND, GREEDY, use_tqdm=False)
        follow_up = FIRST[0] + first[0].token_ids + tokens(4, 6)  # hits decoded blocks
        third = engine.generate([follow_up], GREEDY, use_tqdm=False)
        stats = engine.stats()
    outs = [[o.token_ids for o in batch] for batch in (first, second, third)]
    return outs, stats


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(
    "engine_kw",
    [{}, dict(max_num_batched_tokens=24), dict(kv_cache_blocks=8, max_model_len=80)],
    ids=["default", "chunked_prefill", "preempting"],
)
def test_greedy_outputs_equal_with_caching_on_and_off(tiny_ckpt, engine_kw, kv_cache_dtype):
    kw = dict(engine_kw, kv_cache_dtype=kv_cache_dtype)
    if "kv_cache_blocks" in kw:  # as many blocks in either dtype
        kw["kv_cache_memory_bytes"] = kw.pop("kv_cache_blocks") * BLOCK_BYTES[kv_cache_dtype]
    on, on_stats = run_turns(tiny_ckpt, True, **kw)
    off, off_stats = run_turns(tiny_ckpt, False, **kw)
    assert on == off
    assert off_stats["prefix_cache_hits"] == off_stats["prefix_cache_queries"] == 0
    queries = sum(len(p) for p in FIRST + SECOND) + 45 + 8 + 6  # tokens of each admission
    assert on_stats["prefix_cache_hits"] >= 2 * BLOCK
    if "kv_cache_blocks" in engine_kw:  # readmissions after preemption query again
        assert on_stats["num_preemptions"] > 0
        assert on_stats["prefix_cache_queries"] > queries
    else:  # 32 + 16 + 16 + 16 + 32 + 32 (SECOND) + 48 (the follow-up turn hits its outputs)
        assert on_stats["prefix_cache_queries"] == queries
        assert on_stats["prefix_cache_hits"] == 192
    assert on_stats["num_free_kv_blocks"] == on_stats["num_kv_blocks"]


def test_cached_prefixes_match_transformers_greedy(tiny_ckpt):
    ref = hf_model(tiny_ckpt)
    want = []
    for p in SECOND[:3]:
        ids = ref.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        want.append(ids[0, len(p) :].tolist())
    with llm(tiny_ckpt, True) as engine:
        engine.generate(FIRST, GREEDY, use_tqdm=False)
        outs = engine.generate(SECOND[:3], GREEDY, use_tqdm=False)
        assert engine.stats()["prefix_cache_hits"] == 64
    assert [o.token_ids for o in outs] == want


def test_n_completions_share_the_prompt_blocks(tiny_ckpt):
    params = SamplingParams(temperature=0.0, n=3, max_tokens=4, ignore_eos=True)
    with llm(tiny_ckpt, True, max_num_seqs=1) as engine:  # children admitted one by one
        (out,) = engine.generate([BASE[:40]], params, use_tqdm=False)
        stats = engine.stats()
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert stats["prefix_cache_hits"] == 2 * 2 * BLOCK


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_64_requests_with_aborts_and_preemption_equal_caching_off(tiny_ckpt, kv_cache_dtype):
    rng = random.Random(5)
    prompts = []
    for i in range(64):
        stem = BASE[: rng.choice([16, 20, 32, 33, 47, 64])]
        prompts.append(stem + tokens(100 + i, rng.randint(0, 12)) if i % 7 else stem)
    params = [replace_max(GREEDY, rng.randint(2, 10)) for _ in prompts]
    kw = dict(kv_cache_memory_bytes=24 * BLOCK_BYTES[kv_cache_dtype], max_model_len=96,
              max_num_seqs=16, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    with llm(tiny_ckpt, False, **kw) as engine:
        want = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    with llm(tiny_ckpt, True, **kw) as engine:
        core = engine.engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            core.add_request(str(i), p, sp)
        got: dict[str, list[int]] = {}
        aborted = set()
        for n in range(2000):
            if not core.has_unfinished_requests():
                break
            if n % 3 == 1:  # abort a request now and then, running or waiting
                rid = str(rng.randrange(64))
                aborted.update(o.request_id for o in core.abort_request(rid))
            for out in core.step():
                got[out.request_id] = out.outputs[0].token_ids
        stats = core.stats()
    assert aborted and stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    for i, tokens_i in enumerate(want):
        if str(i) in aborted:
            assert got.get(str(i), []) == tokens_i[: len(got.get(str(i), []))]
        else:
            assert got[str(i)] == tokens_i, i


def replace_max(params: SamplingParams, max_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_tokens=max_tokens)


def test_prefix_caching_switch(tiny_ckpt):
    def config(**kw):
        return EngineArgs(tiny_ckpt, device="cpu", **kw).create_engine_config()

    assert config().cache.enable_prefix_caching
    assert not config(enable_prefix_caching=False).cache.enable_prefix_caching
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        config(enable_prefix_caching="no")
    parser = build_parser()
    assert parser.parse_args(["generate", "x"]).enable_prefix_caching is True
    args = parser.parse_args(["generate", "x", "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
    args = parser.parse_args(["chat", "--enable-prefix-caching"])
    assert args.enable_prefix_caching is True
