"""Data parallelism (engine/data_parallel.py) on the CPU, tiny random model: the balancing and
affinity rule; DP=2 equals DP=1 request for request (greedy, seeded) through LLM and AsyncLLM,
with both replicas used; a killed replica is an error naming it within seconds; no process is
left after close. Engine instances are few: each DP=2 start spawns two core processes."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
from helpers import child_processes, error_after_killing, wait_gone

from llm_inference import LLM, AsyncLLM, SamplingParams
from llm_inference.core.outputs import EngineCoreOutput
from llm_inference.engine.core_process import EngineCoreError
from llm_inference.engine.data_parallel import Balancer
from llm_inference.entrypoints.openai.metrics import render

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ENGINE = dict(device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 20)
PROMPTS = [[1, 5, 9, 20], [3, 4], list(range(10, 50)), [7] * 13, list(range(100, 300, 7)), [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True) for i in range(6)]


# ---- the balancing rule ---------------------------------------------------------------------


def test_balancer_sends_each_request_to_the_least_loaded_replica():
    b = Balancer(3, block_size=4)
    assert [b.route(f"r{i}", [i] * 2) for i in range(3)] == [0, 1, 2]  # ties: lowest index
    assert b.route("big", list(range(3))) == 0
    assert b.load == [5, 2, 2]
    assert b.route("next", [9]) == 1


def test_balancer_counts_generated_tokens_until_a_request_finishes():
    b = Balancer(2, block_size=4)
    b.route("a", [1, 2])
    b.route("b", [3, 4])
    b.on_records([EngineCoreOutput("a", [7, 7, 7])])
    assert b.load == [5, 2]
    assert b.route("c", [5]) == 1
    b.on_records([EngineCoreOutput("a", [8], finish_reason="length")])
    b.finished(["c", "unknown"])  # an abort, and an id it never saw
    assert b.load == [0, 2] and b.replica_of == {"b": 1}
    assert b.has_requests()


def test_balancer_keeps_prefix_affinity_unless_that_replica_is_clearly_busier():
    b = Balancer(2, block_size=4)
    shared = [11, 12, 13, 14]
    assert b.route("a", shared + [1]) == 0
    # Same first block: replica 0 again, though replica 1 is idle (5 <= 2 * 0 + 5).
    assert b.route("b", shared + [2]) == 0
    # Replica 0 now carries 10 tokens, more than twice replica 1's (0) plus this prompt (5):
    # the request goes to replica 1, which then serves the prefix.
    assert b.route("c", shared + [3]) == 1
    assert b.route("d", shared + [4, 5]) == 1
    # Prompts shorter than a block have no affinity; another first block neither.
    assert b.route("e", [11, 12, 13]) == 0  # loads [10, 11]
    assert b.route("f", [99, 12, 13, 14]) == 1  # loads [13, 11]


# ---- checks ---------------------------------------------------------------------------------


def test_options_are_checked_before_anything_starts(tiny_ckpt, monkeypatch):
    import torch

    from llm_inference.engine.arg_utils import EngineArgs
    from llm_inference.engine.data_parallel import DataParallelCore

    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(str(tiny_ckpt), distributed_executor_backend="slurm").create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(str(tiny_ckpt), data_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match="engine_process=False"):
        AsyncLLM(str(tiny_ckpt), engine_process=False, data_parallel_size=2, **ENGINE)
    # Two replicas of TP=2 from cuda:1 need cuda:1 .. cuda:4: refused on a 4-GPU machine.
    config = EngineArgs(str(tiny_ckpt), data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    config = dataclasses.replace(config.create_engine_config(), device="cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match="up to cuda:4, but only 4"):
        DataParallelCore(config)
    assert child_processes() == []


# ---- end to end -----------------------------------------------------------------------------


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def dp1(tiny_ckpt):
    with LLM(str(tiny_ckpt), **ENGINE) as llm:
        yield {
            "greedy": _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
            "seeded": _tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False)),
        }


def test_llm_dp2_equals_dp1_and_uses_both_replicas(tiny_ckpt, dp1):
    with LLM(str(tiny_ckpt), data_parallel_size=2, **ENGINE) as llm:
        replicas = llm.engine.core.replicas
        pids = [r.pid for r in replicas]
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1["greedy"]
        assert _tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False)) == dp1["seeded"]
        steps = [r.stats()["num_steps"] for r in replicas]
        assert all(s > 0 for s in steps), steps
        assert llm.stats()["num_steps"] == sum(steps)
        assert llm.engine.core.balancer.load == [0, 0]
    assert wait_gone(pids, 10) == []
    assert child_processes() == []


def test_async_llm_dp2_equals_dp1(tiny_ckpt, dp1):
    async def final(llm, prompt, params):
        last = None
        async for out in llm.generate(prompt, params):
            last = out
        return last.outputs[0].token_ids

    async def run(llm):
        return await asyncio.gather(*[final(llm, p, s) for p, s in zip(PROMPTS, SEEDED)])

    with AsyncLLM(str(tiny_ckpt), data_parallel_size=2, **ENGINE) as llm:
        pids = [r.pid for r in llm.core_process.replicas]
        assert asyncio.run(run(llm)) == dp1["seeded"]
        assert llm.health() is None
        page = render(llm.metrics, "m")
        blocks = [r.stats()["num_kv_blocks"] for r in llm.core_process.replicas]
    # /metrics: the engine's gauges once per replica, labelled.
    for i in (0, 1):
        assert f'vllm:num_kv_blocks{{model_name="m",engine="{i}"}} {blocks[i]:.1f}' in page
        assert f'vllm:kv_cache_usage_perc{{model_name="m",engine="{i}"}} 0.0' in page
    assert 'vllm:num_kv_blocks{model_name="m"}' not in page
    assert wait_gone(pids, 10) == []


def test_killed_replica_is_an_error_naming_it(tiny_ckpt):
    """A replica killed mid-run: generate raises EngineCoreError naming the replica (within
    10 s, polled), and close leaves no process."""
    llm = LLM(str(tiny_ckpt), data_parallel_size=2, **ENGINE)
    pids = [r.pid for r in llm.engine.core.replicas]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    try:
        error = error_after_killing(
            pids[1], lambda: llm.generate(PROMPTS * 4, params, use_tqdm=False)
        )
        assert isinstance(error, EngineCoreError), error
        assert "data-parallel replica 1" in str(error)
    finally:
        llm.close()
    assert wait_gone(pids, 10) == []
