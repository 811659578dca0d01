"""CUDA graphs for mixed steps (steps with prompt tokens; executor/cuda_graph.py).

CPU: the engine with its steps padded to graph buckets, each "replay" an eager forward of the
padded static step (CudaGraphs(eager=True), reference kernels), gives the same tokens as the
unpadded eager engine, under chunked prefill, preemption and async scheduling (placeholder
tokens filled into padded mixed steps).
CUDA (skipped without a GPU), float16: greedy tokens with mixed and decode graphs equal those
of enforce_eager=True under the same engine settings (chunked prefill, preemption, async
scheduling, buckets small enough that some mixed steps fall back to eager); a prefill step
replays a mixed graph; graphs captured after a profiled (gpu_memory_utilization) KV cache.

The CUDA comparison allows what tests/engine/test_triton_engine.py allows: a graph pads a
step's GEMMs to its bucket, and cuBLAS may pick another kernel (another summation order) for
another row count, so where eager's two best tokens are within float16 rounding of each other
the argmax may flip. Only then may a sequence part from eager: the first difference is checked
against an eager rerun with logprobs (those run synchronously, hence not in the main runs).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_sharp_checkpoint

from llm_inference import LLM, SamplingParams
from llm_inference.executor.cuda_graph import DECODE, MIXED, CudaGraphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEAR_TIE = 0.15  # log-probability gap under which float16 rounding may flip the argmax


def _runner(llm):
    return llm.engine.executor.workers[0].model_runner


def instrument(graphs: CudaGraphs, runner) -> dict:
    """Count the mixed steps that ran eagerly (no bucket held them) and the mixed replays
    whose input ids took placeholder tokens (async scheduling)."""
    counts = {"eager_mixed": 0, "mixed_with_placeholders": 0, "placeholders": 0}
    select, replay = graphs.select, graphs.replay

    def counting_select(step):
        key = select(step)
        counts["eager_mixed"] += key is None and step.max_query_len > 1
        counts["placeholders"] = len(step.placeholder_tokens)
        return key

    def counting_replay(key, num_tokens):
        counts["mixed_with_placeholders"] += key[0] == MIXED and counts["placeholders"] > 0
        return replay(key, num_tokens)

    graphs.select, graphs.replay = counting_select, counting_replay
    return counts


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


# ---- CPU: padding through the whole engine ----------------------------------------------------

CPU_ENGINES = {
    # Budget 16: steps of 13-16 tokens exceed the largest bucket and run eagerly (as do steps
    # of more than 64 tokens in the other engine).
    "chunked": (dict(max_num_batched_tokens=16, max_num_seqs=3), [4, 8, 12]),
    "preempting": (
        dict(block_size=4, kv_cache_memory_bytes=24 * 2048, max_model_len=96, max_num_seqs=6),
        [8, 32, 64],
    ),
}


@pytest.mark.parametrize("name", list(CPU_ENGINES))
def test_padded_steps_equal_eager_cpu(tiny_ckpt, name):
    engine_kw, sizes = CPU_ENGINES[name]
    prompts = _prompts([3, 17, 40, 1, 9, 25, 60, 5])
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = {}
    for padded in (False, True):
        with LLM(str(tiny_ckpt), device="cpu", async_scheduling=True, **engine_kw) as llm:
            if padded:
                sched, runner = llm.config.scheduler, _runner(llm)
                graphs = CudaGraphs(runner.model, runner.buffers, sched.max_num_seqs,
                                    sched.max_model_len, sizes, eager=True)  # fmt: skip
                counts = instrument(graphs, runner)
                runner.graphs = graphs
            runs[padded] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if engine_kw.get("kv_cache_memory_bytes"):
                assert llm.stats()["num_preemptions"] > 0
    assert runs[True] == runs[False]
    assert graphs.replays[MIXED] > 0 and graphs.replays[DECODE] > 0
    assert counts["mixed_with_placeholders"] > 0 and counts["eager_mixed"] > 0


# ---- CUDA ---------------------------------------------------------------------------------------

FP16_BLOCK_BYTES = 2 * 16 * 2 * 64 * 3 * 2  # K and V, 16 tokens, 2 KV heads x 64, 3 layers, fp16
# Twelve requests, four at a time, finishing at different steps: new prompts keep joining
# running decodes (mixed steps with placeholder tokens under async scheduling).
CUDA_PROMPTS = (1, 7, 33, 120, 250, 64, 90, 3, 17, 200, 45, 9)
CUDA_MAX_TOKENS = [8 + 5 * i % 33 for i in range(len(CUDA_PROMPTS))]
CUDA_ENGINES = {  # (engine arguments, LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES or None)
    # Budget 64 and buckets 16, 32, 48: prompts in chunks, steps of 49-64 tokens run eagerly.
    "chunked_small_buckets": (
        dict(max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20), "16,32,48",
    ),
    # Budget 512, default buckets (128, 256, 512); 20 blocks of 16 tokens: preemption.
    "preempting_default_buckets": (
        dict(max_num_batched_tokens=512, kv_cache_memory_bytes=20 * FP16_BLOCK_BYTES,
             max_model_len=320),
        None,
    ),
}  # fmt: skip
GRAPH_SIZES = "LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES"


@pytest.fixture(scope="module")
def cuda_folder(tmp_path_factory):
    """The model of tests/engine/test_triton_engine.py (GQA 4, head_dim 64), LM head
    sharpened so that near-ties are rare."""
    return make_sharp_checkpoint(tmp_path_factory.mktemp("mixed_graphs"))


def _cuda_llm(folder, eager, **kw):
    return LLM(str(folder), device="cuda", dtype="float16", enforce_eager=eager,
               max_num_seqs=4, **kw)  # fmt: skip


def _greedy(max_tokens=40, logprobs=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs)  # fmt: skip


def _cuda_params(logprobs=None):
    return [_greedy(n, logprobs) for n in CUDA_MAX_TOKENS]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CUDA_ENGINES))
def test_mixed_graphs_greedy_equal_eager(cuda_folder, name, monkeypatch):
    engine_kw, sizes = CUDA_ENGINES[name]
    if sizes is None:
        monkeypatch.delenv(GRAPH_SIZES, raising=False)
    else:
        monkeypatch.setenv(GRAPH_SIZES, sizes)
    prompts = _prompts(CUDA_PROMPTS)
    runs = {}
    for eager in (True, False):
        with _cuda_llm(cuda_folder, eager, **engine_kw) as llm:
            assert llm.config.async_scheduling
            if not eager:
                runner = _runner(llm)
                graphs = runner.graphs
                assert {k for k in graphs.graphs if k[0] == MIXED} == {
                    (MIXED, n) for n in ([16, 32, 48] if name.startswith("chunked") else
                                         [128, 256, 512])
                }  # fmt: skip
                counts = instrument(graphs, runner)
            out = llm.generate(prompts, _cuda_params(), use_tqdm=False)
            runs[eager] = [o.token_ids for o in out]
            if name.startswith("preempting"):
                assert llm.stats()["num_preemptions"] > 0
    assert graphs.replays[MIXED] > 0 and graphs.replays[DECODE] > 0
    assert counts["mixed_with_placeholders"] > 0
    assert (counts["eager_mixed"] > 0) == name.startswith("chunked")
    differ = {}
    for i, (a, b) in enumerate(zip(runs[False], runs[True])):
        j = next((k for k in range(len(a)) if a[k] != b[k]), None)
        if j is not None:
            differ[i] = j
    if not differ:
        return
    # Only a near-tie of eager may part the two: rerun eager with logprobs (synchronously).
    with _cuda_llm(cuda_folder, True, **engine_kw) as llm:
        ref = llm.generate(prompts, _cuda_params(logprobs=5), use_tqdm=False)
    for i, j in differ.items():
        graph_ids, eager_ids = runs[False][i], runs[True][i]
        assert ref[i].token_ids[: j + 1] == eager_ids[: j + 1], f"prompt {i}: eager reruns differ"
        top = ref[i].outputs[0].logprobs[j].top
        assert graph_ids[j] in top, f"prompt {i}: graphs picked a token outside eager's top 5"
        gap = top[eager_ids[j]] - top[graph_ids[j]]
        assert gap < NEAR_TIE, f"prompt {i}: first difference at step {j}, log-prob gap {gap:.3f}"
    assert len(differ) <= len(prompts) // 4, f"{len(differ)} of {len(prompts)} sequences differ"


@cuda
@pytest.mark.cuda
def test_prefill_step_replays_a_mixed_graph(cuda_folder, monkeypatch):
    """One 20-token prompt, 3 tokens: the prefill replays the 32-token mixed graph, the two
    decodes the batch-1 decode graph; the tokens are eager's."""
    prompt = _prompts([20], seed=3)
    monkeypatch.setenv(GRAPH_SIZES, "32,64")
    kw = dict(max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)
    with _cuda_llm(cuda_folder, False, **kw) as llm:
        graphs = _runner(llm).graphs
        keys = []
        replay = graphs.replay
        graphs.replay = lambda key, n: keys.append(key) or replay(key, n)
        got = llm.generate(prompt, _greedy(3), use_tqdm=False)[0].token_ids
        assert keys == [(MIXED, 32), (DECODE, 1), (DECODE, 1)]
        assert graphs.replays == {MIXED: 1, DECODE: 2}
    with _cuda_llm(cuda_folder, True, **kw) as llm:
        assert llm.generate(prompt, _greedy(3), use_tqdm=False)[0].token_ids == got


@cuda
@pytest.mark.cuda
def test_graphs_after_profiled_kv_cache(cuda_folder):
    """No kv_cache_memory_bytes: the memory profile (with room for the graph pool) sizes the
    cache, then the decode and default mixed graphs are captured and replayed."""
    with _cuda_llm(cuda_folder, False, max_num_batched_tokens=1024, max_model_len=512) as llm:
        runner = _runner(llm)
        assert runner.num_blocks > 0
        assert runner.graphs.mixed_buckets == [128, 256, 512, 768, 1024]
        out = llm.generate(_prompts([300, 5, 77]), _greedy(8), use_tqdm=False)
        assert [len(o.token_ids) for o in out] == [8, 8, 8]
        assert runner.graphs.replays[MIXED] >= 1 and runner.graphs.replays[DECODE] >= 1
