"""Async scheduling (step n+1 scheduled and launched before step n's tokens are read) gives the
same tokens as one step at a time: greedy and seeded, under preemption and chunked prefill,
with stop strings, n > 1, penalties (which fall back to synchronous steps) and aborts."""

from __future__ import annotations

import pytest
import torch

from llm_inference import LLM, SamplingParams
from llm_inference.config import SchedulerConfig
from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.core.request import Request
from llm_inference.core.scheduler import Scheduler


def _prompts(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 1, 9, 25, 60, 5, 33, 12][:n]
    return [torch.randint(2, 320, (k,), generator=g).tolist() for k in lengths]


def _params():
    out = []
    for i in range(10):
        if i % 3 == 0:
            p = SamplingParams(temperature=0.0, max_tokens=9 + i, ignore_eos=True)
        elif i % 3 == 1:
            p = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, n=2)
        else:
            p = SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=14, stop=["e"])
        out.append(p)
    return out


ENGINES = [
    dict(),
    dict(block_size=4, kv_cache_memory_bytes=24 * 2048, max_model_len=96),  # preempts
    dict(max_num_batched_tokens=16, max_num_seqs=3),  # chunked prefill, few sequences
]


@pytest.mark.parametrize("engine_kw", ENGINES, ids=["default", "preempting", "chunked"])
def test_async_equals_sync(tiny_ckpt, engine_kw):
    runs = {}
    for mode in (False, True):
        with LLM(str(tiny_ckpt), device="cpu", async_scheduling=mode, **engine_kw) as llm:
            runs[mode] = llm.generate(_prompts(), _params(), use_tqdm=False)
            stats = llm.stats()
            assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            # No step's record outlives it: an empty step (every request waiting on samples
            # that end it) once left one per request, for good.
            assert llm.engine.scheduler._in_flight == {}
            if engine_kw.get("kv_cache_memory_bytes"):
                assert stats["num_preemptions"] > 0
    for sync, overlap in zip(runs[False], runs[True]):
        for a, b in zip(sync.outputs, overlap.outputs):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def test_one_request_at_a_time_leaves_no_step_records(tiny_ckpt):
    """A long-running engine fed one request at a time: with async scheduling each request's
    last step was an empty one, whose in-flight record nothing popped (one per request)."""
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        for i in range(20):
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            llm.generate([[5, 6, 7, i + 3]], params, use_tqdm=False)
        assert llm.engine.scheduler._in_flight == {}


def test_penalties_and_logprobs_run_synchronously_and_match(tiny_ckpt):
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=10, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=3),
        SamplingParams(temperature=0.8, seed=2, max_tokens=10),
    ]
    runs = {}
    for mode in (False, True):
        with LLM(str(tiny_ckpt), device="cpu", async_scheduling=mode) as llm:
            runs[mode] = llm.generate(_prompts(3), params, use_tqdm=False)
            assert not llm.engine.core._sync_ids  # every finished request left the sync set
    for a, b in zip(runs[False], runs[True]):
        assert a.token_ids == b.token_ids
    assert [lp.top for lp in runs[False][1].logprobs] == [lp.top for lp in runs[True][1].logprobs]


def test_scheduler_counts_samples_in_flight():
    """Two steps scheduled before the first one's token arrives: the second computes the
    in-flight token's position and samples the one after; a request whose in-flight sample
    reaches max_tokens is not scheduled again."""
    sched = Scheduler(SchedulerConfig(8, 64, 64), num_blocks=16, block_size=4)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add_request(req)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"r": 3} and req.num_output_placeholders == 1
    second = sched.schedule()  # before the first step's token is known
    assert second.num_scheduled_tokens == {"r": 1}
    assert second.cached_requests.num_computed_tokens == [3]  # position 3: the placeholder
    assert second.cached_requests.new_token_ids == [[]]
    assert req.num_output_placeholders == 2
    assert sched.schedule().is_empty  # both samples in flight reach max_tokens=2
    sched.update_from_output(first, ModelRunnerOutput(["r"], [[7]]))
    out = sched.update_from_output(second, ModelRunnerOutput(["r"], [[8]]))
    assert req.output_token_ids == [7, 8] and out[0].finish_reason == "length"
    assert req.num_output_placeholders == 0
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_preempted_request_keeps_its_in_flight_token():
    sched = Scheduler(SchedulerConfig(8, 64, 64), num_blocks=2, block_size=4)
    a = Request("a", [1] * 4, SamplingParams(max_tokens=10))
    b = Request("b", [2] * 4, SamplingParams(max_tokens=10))
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()  # both fill their block; both samples in flight
    second = sched.schedule()  # a needs a second block: b is preempted
    assert second.preempted_request_ids == ["b"] and b.num_output_placeholders == 0
    sched.update_from_output(first, ModelRunnerOutput(["a", "b"], [[5], [6]]))
    assert b.output_token_ids == [6] and b.num_computed_tokens == 0  # recomputed later
    sched.update_from_output(second, ModelRunnerOutput(["a"], [[7]]))
    assert a.output_token_ids == [5, 7]
