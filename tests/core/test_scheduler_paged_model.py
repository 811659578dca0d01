"""The scheduler against a fake *paged* model (tests/paged_model.py), and a hypothesis
property test, with prefix caching on and off: preemption, recomputation and cache hits must
not change any request's output, leak a block or share one that is being written."""

from __future__ import annotations

import pytest
from batch_replay import ReplayScheduler as Scheduler
from hypothesis import event, given, settings
from hypothesis import strategies as st
from paged_model import FakePagedModel, check_invariants, check_prefix_cache, next_token

from llm_inference.config import SchedulerConfig
from llm_inference.core.request import Request, RequestStatus
from llm_inference.sampling_params import SamplingParams

EOS = 0


def reference_outputs(prompt: list[int], max_tokens: int, salt: int, vocab: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq, salt, vocab))
    return seq[len(prompt) :]


def run_workload(
    num_blocks: int, budget: int, caching: bool = False
) -> tuple[list[Request], Scheduler]:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64)
    sched = Scheduler(config, num_blocks=num_blocks, block_size=4, enable_prefix_caching=caching)
    model = FakePagedModel(block_size=4, pool=sched.kv_cache_manager.block_pool)
    reqs = []
    for i in range(6):
        prompt = [100 * (i + 1) + j for j in range(3 + 2 * i)]
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    for step in range(500):
        if step < len(reqs):  # one arrival per step while others run
            sched.add_request(reqs[step])
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, model.execute(out))
        check_invariants(sched, [r for r in reqs if r.is_finished])
        check_prefix_cache(sched, model)
    return reqs, sched


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_and_recompute_do_not_change_outputs(caching):
    roomy, roomy_sched = run_workload(num_blocks=64, budget=32, caching=caching)
    tight, tight_sched = run_workload(num_blocks=7, budget=5, caching=caching)
    assert roomy_sched.num_preemptions == 0
    assert tight_sched.num_preemptions > 0
    if caching:  # preempted requests re-match their prefix when readmitted
        assert tight_sched.kv_cache_manager.prefix_cache_hits > 0
    for a, b in zip(roomy, tight, strict=True):
        expected = reference_outputs(a.prompt_token_ids, 8, salt=0, vocab=1000)
        assert a.output_token_ids == expected
        assert b.output_token_ids == expected
        assert a.finish_reason == b.finish_reason == "length"


add_op = st.tuples(st.just("add"), st.integers(1, 8), st.integers(1, 20), st.integers(0, 3))
op = st.one_of(
    add_op,
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 50), st.just(0), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(2, 10),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 16),
    salt=st.integers(0, 10**6),
    first_adds=st.lists(add_op, min_size=1, max_size=6),
    ops=st.lists(op, max_size=60),
    caching=st.booleans(),
)
def test_random_operations_never_leak_or_share_blocks(
    num_blocks, block_size, max_num_seqs, budget, salt, first_adds, ops, caching
):
    capacity = num_blocks * block_size
    config = SchedulerConfig(max_num_seqs, budget, max_model_len=capacity)
    sched = Scheduler(config, num_blocks, block_size, enable_prefix_caching=caching)
    pool = sched.kv_cache_manager.block_pool
    model = FakePagedModel(block_size, salt=salt, vocab=16, pool=pool)  # EOS 1 time in 16
    reqs: list[Request] = []

    def step(abort_index: int | None = None) -> None:
        out = sched.schedule()
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled) <= budget
        if abort_index is not None and out.scheduled:
            rid = out.scheduled[abort_index % len(out.scheduled)].request_id
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        sched.update_from_output(out, model.execute(out))

    for kind, a, b, c in first_adds + ops:
        if kind == "add":
            params = SamplingParams(max_tokens=b, min_tokens=min(c % 3, b), ignore_eos=c == 3)
            prompt = [1 + (len(reqs) * 7 + j) % 50 for j in range(min(a, capacity - 1))]
            reqs.append(Request(f"r{len(reqs)}", prompt, params, eos_token_ids=(EOS,)))
            sched.add_request(reqs[-1])
        elif kind == "step":
            for _ in range(a):
                step()
        elif kind == "abort" and reqs:
            sched.finish_requests(reqs[a % len(reqs)].request_id, RequestStatus.FINISHED_ABORTED)
        elif kind == "abort_mid_step":
            step(abort_index=a)
        check_invariants(sched, [r for r in reqs if r.is_finished])
        check_prefix_cache(sched, model)

    for _ in range(2000):  # drain: everything finishes, nothing hangs
        if not sched.has_unfinished_requests():
            break
        step()
        check_invariants(sched, [r for r in reqs if r.is_finished])
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
    event(f"preempted: {sched.num_preemptions > 0}")
    for reason in {r.finish_reason for r in reqs}:
        event(f"finish reason: {reason}")
    for r in reqs:
        assert r.is_finished
        assert r.num_output_tokens <= r.max_tokens
        assert r.num_tokens <= capacity
        if r.finish_reason == "stop":
            assert r.output_token_ids[-1] == EOS
            assert r.num_output_tokens >= r.sampling_params.min_tokens
