"""The memory profile (ModelRunner._profile_free_memory) on the CPU: its step is the largest one
the scheduler can make, run through the kernels real steps take, and the KV cache gets what that
step, the memory outside torch and the CUDA graphs' pool leave. On the GPU, with an 8B-shaped
model: tests/executor/test_memory_profile_gpu.py."""

import pytest
import torch

from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.executor.model_runner import ModelRunner


def _runner(folder, **kw) -> ModelRunner:
    config = EngineArgs(model=str(folder), device="cpu", **kw).create_engine_config()
    return ModelRunner(config, torch.device("cpu"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_profile_step_takes_the_paged_kernels_of_real_steps(tiny_ckpt, monkeypatch, kv_cache_dtype):
    """300 tokens of budget, max_model_len 128, 2 sequences at most: the forward is two 128-token
    prompts through `unified_attention` over the paged cache (in the cache's dtype: the FP8
    kernels with an FP8 cache), never the dense path (which ran one SDPA over [heads, n, n]
    scores: 69 GB at 16k tokens on the 8B shape), and leaves no KV cache behind. The sampler
    gets the logits of 2 rows (one per sequence), on its most demanding path."""
    runner = _runner(tiny_ckpt, max_num_batched_tokens=300, max_model_len=128, max_num_seqs=2,
                     kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    backend, ops = runner.model.attn_backend, runner.ops
    calls, cache_dtype = [], torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32

    def attention(q, k_cache, v_cache, block_table, cu, seq_lens, *args, **kw):
        calls.append((len(q), cu.tolist(), seq_lens.tolist(), kw["max_query_len"], len(k_cache)))
        assert k_cache.dtype == v_cache.dtype == cache_dtype
        return real(q, k_cache, v_cache, block_table, cu, seq_lens, *args, **kw)

    def dense(*args):
        raise AssertionError("the profile took the dense attention")

    real = ops.unified_attention
    monkeypatch.setattr(ops, "unified_attention", attention)
    monkeypatch.setattr(backend, "_dense", dense)
    hidden = runner._profile_forward()
    layers = runner.model.attention_layers()
    assert calls == [(256, [0, 128, 256], [128, 128], 128, 1)] * len(layers)
    assert hidden.shape == (256, runner.config.model.hidden_size)
    assert all(a.k_cache is None and a.v_cache is None for a in layers)

    sampled = []
    sample = runner.sampler.forward
    monkeypatch.setattr(runner.sampler, "forward", lambda lg, md, **kw: sampled.append((lg, md)))
    runner._profile_sampler(hidden)
    ((logits, md),) = sampled
    assert logits.shape == (2, runner.config.model.vocab_size)
    assert not md.no_penalties and md.logprobs_rows is not None and md.top_p is not None
    sample(logits, md)  # the metadata is one the sampler takes


class FakeCuda:
    """torch.cuda's memory counters, for a model whose forward allocates `forward` bytes over
    the weights and whose logits (with the sampler after them) `sampler` bytes more."""

    def __init__(self, monkeypatch, runner, weights, forward, sampler, non_torch, total):
        self.peak = weights
        for name in ("empty_cache", "synchronize", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a: None)
        for counter in ("memory_allocated", "memory_reserved"):  # nothing is freed
            monkeypatch.setattr(torch.cuda, counter, lambda d: self.peak)
            monkeypatch.setattr(torch.cuda, f"max_{counter}", lambda d: self.peak)
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda d: (total - self.peak - non_torch, total)
        )
        model, config = runner.model, runner.config.model

        def run_forward(ids, positions, md):
            self.peak += forward
            return torch.zeros(len(ids), config.hidden_size)

        def run_logits(hidden):
            self.peak += sampler
            return torch.zeros(len(hidden), config.vocab_size)

        monkeypatch.setattr(model, "forward", run_forward)
        monkeypatch.setattr(model, "compute_logits", run_logits)


GB = 1 << 30


@pytest.mark.parametrize("graphs", [True, False])
def test_kv_cache_gets_utilization_less_peak_non_torch_and_graph_pool(
    tiny_ckpt, monkeypatch, graphs
):
    """The accounting, from sizes: the KV cache gets utilization * total less the profiled peak
    (weights + forward + logits and sampler, once), the memory outside torch, and the graphs'
    pool: the forward's activations alone (scaled to the largest mixed graph: here the budget
    itself), neither the weights nor the logits, which are taken outside the graphs. The code
    before reserved the whole peak over the weights a second time for the pool."""
    runner = _runner(tiny_ckpt, max_num_batched_tokens=4096)
    runner.use_cuda_graphs = graphs  # its mixed graphs: the budget is the largest
    FakeCuda(monkeypatch, runner, weights=16 * GB, forward=2 * GB, sampler=1 * GB,
             non_torch=GB // 2, total=140 * GB)  # fmt: skip
    pool = 2 * GB if graphs else 0
    want = int(140 * GB * 0.85) - (16 + 2 + 1) * GB - GB // 2 - pool
    assert runner._profile_free_memory(0.85) == want


def test_graph_pool_scales_to_the_largest_mixed_graph(tiny_ckpt, monkeypatch):
    """With mixed graphs up to 1,024 tokens (the override) and a 4,096-token budget, the pool
    is a quarter of the 4,096-token forward's activations."""
    monkeypatch.setenv("LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES", "256,1024")
    runner = _runner(tiny_ckpt, max_num_batched_tokens=4096)
    runner.use_cuda_graphs = True
    FakeCuda(monkeypatch, runner, weights=16 * GB, forward=4 * GB, sampler=0, non_torch=0,
             total=100 * GB)  # fmt: skip
    assert runner._profile_free_memory(0.5) == 50 * GB - 20 * GB - GB
