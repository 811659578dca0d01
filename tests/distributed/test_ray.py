"""The Ray executor (executor/ray_executor.py) on a local Ray, gloo on the CPU, tiny random
model: with no Ray running the engine starts one and stops it at close; TP=2 through Ray
equals TP=1 (greedy, seeded, structured outputs: their steps in two calls); DP=2 x TP=2 through
Ray equals too; a step whose forward raises is that error, not its sampling's; a killed Ray
worker is a clear error within 10 s; close leaves no actor running and gives the placement
group's CPUs back. One Ray for the other tests of the module (its start is slow)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from helpers import child_processes, error_after_killing, wait_gone

from llm_inference import LLM, SamplingParams
from llm_inference import StructuredOutputsParams as S
from llm_inference.core.outputs import CachedRequestData, SchedulerOutput
from llm_inference.executor.multiproc import WorkerError

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

RAY_CPUS = 4
ENGINE = dict(device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 20)
RAY = dict(ENGINE, distributed_executor_backend="ray")
PROMPTS = [[1, 5, 9, 20], [3, 4], list(range(10, 50)), [7] * 13, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True) for i in range(5)]
CONSTRAINED = [
    SamplingParams(temperature=0.8, seed=i, max_tokens=12, structured_outputs=so)
    for i, so in enumerate([S(regex=r"[a-z]{2,6}\d"), S(choice=["one", "two"])])
]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False)
    yield
    ray.shutdown()


def _run(llm: LLM) -> dict:
    gen = lambda params: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]  # noqa: E731
    out = {"greedy": gen(GREEDY), "seeded": gen(SEEDED)}
    out["constrained"] = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], CONSTRAINED)]
    return out


@pytest.fixture(scope="module")
def tp1(tiny_ckpt):
    with LLM(str(tiny_ckpt), **ENGINE) as llm:
        return _run(llm)


def _all_cpus_free() -> bool:
    """Polled: every bundle given back (Ray reports resources a moment later)."""
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < RAY_CPUS:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif("RAY_ADDRESS" in os.environ, reason="a Ray cluster is named: it joins that")
def test_without_a_ray_it_starts_one_and_stops_it_at_close(tiny_ckpt, tp1):
    """First in the module, before `local_ray`: no Ray runs, so the engine starts a local one,
    whose processes (children of this one) are gone after close."""
    assert not ray.is_initialized()
    with LLM(str(tiny_ckpt), **RAY) as llm:  # TP=1: one actor
        assert ray.is_initialized() and child_processes()
        assert _run(llm) == tp1
    assert not ray.is_initialized()
    assert wait_gone([pid for pid, _ in child_processes()], 10) == []


def test_tp2_through_ray_equals_tp1_and_leaves_nothing(local_ray, tiny_ckpt, tp1):
    with LLM(str(tiny_ckpt), tensor_parallel_size=2, **RAY) as llm:
        pids = llm.engine.executor.worker_pids
        assert len(pids) == 2 and os.getpid() not in pids
        assert _run(llm) == tp1
        # a step sent in two calls whose forward raises (no such request on the ranks): the
        # forward's error, though each actor runs the sampling call after it anyway
        ghost = SchedulerOutput(-1, [], CachedRequestData(["ghost"], [[]], [[]], [0]),
                                {"ghost": 1}, 1)  # fmt: skip
        executor = llm.engine.executor
        executor.execute_model(ghost, sync=False, sample=False)
        with pytest.raises(WorkerError, match=r"rank 0 raised in(?s:.*)KeyError: 'ghost'"):
            executor.sample_tokens(None).result()
    assert wait_gone(pids, 10) == []
    assert _all_cpus_free()
    assert ray.is_initialized()  # the caller's Ray is kept


def test_dp2_tp2_through_ray_equals_tp1(local_ray, tiny_ckpt, tp1):
    """Two engine core processes, each joining this Ray with two actors (four bundles)."""
    with LLM(str(tiny_ckpt), tensor_parallel_size=2, data_parallel_size=2, **RAY) as llm:
        assert _run(llm) == tp1
        assert all(r.stats()["num_steps"] > 0 for r in llm.engine.core.replicas)
    assert _all_cpus_free()


def test_killed_ray_worker_is_a_clear_error(local_ray, tiny_ckpt):
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, **RAY)
    pids = llm.engine.executor.worker_pids
    try:
        error = error_after_killing(pids[1], lambda: llm.generate(PROMPTS, GREEDY))
        assert isinstance(error, WorkerError), error
        assert "rank 1 (a Ray actor) died" in str(error)
        with pytest.raises(WorkerError, match="unusable"):
            llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
    assert wait_gone(pids, 10) == []
    assert _all_cpus_free()
