"""The eager engine's warm-up (executor/warm_up.py): its steps reach every compiled attention
variant that any step within the limits reaches, and their forwards change no state.

Whether the warm-up leaves nothing to compile on a GPU is checked there
(tests/engine/test_triton_engine.py, test_first_requests_compile_nothing with enforce_eager)."""

import pytest
import torch

from llm_inference import LLM, SamplingParams
from llm_inference.executor.warm_up import run_warm_up, warm_up_steps
from llm_inference.kernels import paged_attention as pa
from llm_inference.kernels import unified_attention as ua
from llm_inference.layers.attention import ORDER_MIN_SEQS
from llm_inference.layers.linear import SKINNY_MAX_ROWS

SHAPES = [
    # (KV heads, group, head_dim, block size, max_num_seqs, max_model_len, budget, SMs)
    (8, 4, 64, 16, 64, 4096, 512, 132),  # Llama 3.2 1B on an H200
    (8, 3, 128, 16, 40, 8192, 300, 132),  # 3B
    (4, 3, 128, 16, 48, 2048, 64, 132),  # 3B, a TP=2 rank
    (1, 8, 128, 32, 20, 16384, 40, 78),  # one KV head, another GPU
    (8, 3, 128, 16, 8, 32768, 32, 132),  # long contexts: up to 128 splits at one sequence
    (2, 1, 64, 16, 8, 1024, 16, 4),  # small limits, the interpreter's SM count
]


def _key(num_seqs, tokens, max_query_len, max_seq_len, shape):
    kv, group, head_dim, block_size, *_, sms = shape
    ordered = max_query_len == 1 and num_seqs >= ORDER_MIN_SEQS
    plan = ua.plan(
        num_seqs, kv, group, head_dim, block_size, max_query_len, max_seq_len, sms, ordered
    )
    return ua.compile_key(plan, ordered), tokens <= SKINNY_MAX_ROWS


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"kv{s[0]}g{s[1]}d{s[2]}s{s[4]}")
def test_steps_reach_every_variant(shape):
    """Against every decode (batch, context in whole tiles) and every mixed query length."""
    kv, group, head_dim, block_size, max_seqs, max_len, budget, sms = shape
    steps = warm_up_steps(kv, group, head_dim, block_size, max_seqs, max_len, budget, sms)
    warmed = {_key(s.num_seqs, s.num_tokens, s.max_query_len, s.max_seq_len, shape) for s in steps}
    assert len(warmed) == len(steps)  # one step per variant
    block_n = pa.default_block_n(head_dim, block_size)
    every = {
        _key(b, b, 1, min(n, max_len), shape)
        for b in range(1, max_seqs + 1)
        for n in range(block_n, max_len + block_n, block_n)
    }
    # A mixed step's tile follows its longest query; its linear layers, all its tokens.
    for tokens in range(2, budget + 1):
        for query in (2, tokens // 2, tokens):
            if query >= 2:
                every.add(_key(max_seqs, tokens, query, max_len, shape))
    assert every <= warmed, f"not warmed up: {sorted(every - warmed, key=str)}"
    decode_keys = {k for k, _ in warmed if k[0] == "decode"}
    assert {k[1] for k in decode_keys} == {False, True}  # these limits split and do not


def test_warm_up_forwards_change_nothing(tiny_ckpt):
    """The all-padding forwards write no KV block (every cache tensor keeps its bytes) and leave
    the runner's buffers fit for real steps: the same greedy tokens after as before."""
    prompts = [[5, 9, 2, 7, 3, 11, 4], [8, 1, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_ckpt), device="cpu", max_num_seqs=4, max_num_batched_tokens=24) as llm:
        before = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.executor.workers[0].model_runner
        layers = runner.model.attention_layers()
        caches = [(a.k_cache.clone(), a.v_cache.clone()) for a in layers]
        attn, sched = layers[0], llm.config.scheduler
        steps = warm_up_steps(
            attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim,
            runner.block_size, sched.max_num_seqs, sched.max_model_len,
            sched.max_num_batched_tokens, 4,
        )  # fmt: skip
        assert any(s.max_query_len == 1 for s in steps) and any(s.max_query_len > 1 for s in steps)
        run_warm_up(runner.model, runner.buffers, sched.max_num_seqs, steps)
        for a, (k, v) in zip(layers, caches):
            assert torch.equal(a.k_cache, k) and torch.equal(a.v_cache, v)
        after = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
