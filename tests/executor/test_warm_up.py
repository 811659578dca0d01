"""The eager engine's warm-up (executor/warm_up.py): the all-padding forwards of the step shapes
the kernels list (kernels/warm_up.py; that they reach every variant: tests/kernels/
test_warm_up_shapes.py) change no state.

Whether the warm-up leaves nothing to compile on a GPU is checked there
(tests/engine/test_triton_engine.py, test_first_requests_compile_nothing with enforce_eager)."""

import pytest
import torch

from llm_inference import LLM, SamplingParams
from llm_inference.executor.warm_up import run_warm_up

pytest.importorskip("triton")
from llm_inference.kernels.warm_up import warm_up_shapes  # noqa: E402


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
        steps = warm_up_shapes(
            attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim,
            runner.block_size, sched.max_num_seqs, sched.max_model_len,
            sched.max_num_batched_tokens, 4, 16,
        )  # fmt: skip
        assert any(s.max_query_len == 1 for s in steps) and any(s.max_query_len > 1 for s in steps)
        run_warm_up(runner.model, runner.buffers, sched.max_num_seqs, steps)
        for a, (k, v) in zip(layers, caches):
            assert torch.equal(a.k_cache, k) and torch.equal(a.v_cache, v)
        after = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
