"""Scheduler driven by fake ModelRunnerOutputs: admission, budget, chunked prefill, preemption.

These tests plan steps token by token, so they run with prefix caching off (their prompts
share prefixes); tests/core/test_prefix_caching.py has the caching-on versions."""

from __future__ import annotations

from batch_replay import ReplayScheduler as Scheduler

from llm_inference.config import SchedulerConfig
from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.sampling_params import SamplingParams


def make_scheduler(
    num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256, caching=False
):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
    )
    return Scheduler(
        config, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching
    )


def add(sched, rid, num_prompt, max_tokens=100, first_token=1000):
    req = Request(
        rid,
        list(range(first_token, first_token + num_prompt)),
        SamplingParams(),
        max_tokens=max_tokens,
    )
    sched.add_request(req)
    return req


def fake_output(out, token=7) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        request_ids=[s.request_id for s in out.scheduled],
        sampled_token_ids=[[token] if s.needs_sample else [] for s in out.scheduled],
    )


def step(sched, token=7):
    out = sched.schedule()
    sched.update_from_output(out, fake_output(out, token))
    return out


def plan(out) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled]


def test_admission_is_fifo_and_limited_by_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abcd":
        add(sched, rid, 3, max_tokens=2)
    out = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    out = step(sched)  # a and b decode their second token and finish
    assert plan(out) == [("a", 3, 1), ("b", 3, 1)]
    assert sched.running == []
    out = step(sched)
    assert [s.request_id for s in out.scheduled] == ["c", "d"]


def test_chunked_prefill_respects_the_token_budget():
    sched = make_scheduler(budget=8)
    req = add(sched, "a", 20)
    outs = [step(sched) for _ in range(3)]
    assert [plan(o) for o in outs] == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)]]
    assert [o.scheduled[0].needs_sample for o in outs] == [False, False, True]
    assert [o.num_batched_tokens for o in outs] == [8, 8, 4]
    assert outs[1].scheduled[0].token_ids == list(range(1008, 1016))
    assert req.output_token_ids == [7]
    assert req.num_computed_tokens == 20
    assert plan(step(sched)) == [("a", 20, 1)]  # now decoding: its sampled token, position 20


def test_running_requests_come_first_and_waiting_ones_share_the_rest_of_the_budget():
    sched = make_scheduler(budget=10)
    add(sched, "a", 4)
    add(sched, "b", 12)
    out = step(sched)
    assert plan(out) == [("a", 0, 4), ("b", 0, 6)]
    out = step(sched)
    assert plan(out) == [("a", 4, 1), ("b", 6, 6)]
    assert out.num_batched_tokens == 7
    assert [s.needs_sample for s in out.scheduled] == [True, True]
    add(sched, "c", 30)
    out = step(sched)  # a, b decode; c takes the remaining 8 tokens of the budget
    assert plan(out) == [("a", 5, 1), ("b", 12, 1), ("c", 0, 8)]
    assert out.num_batched_tokens == 10


def test_batch_changes_every_step_as_requests_arrive_and_finish():
    sched = make_scheduler(budget=16, max_num_seqs=3)
    add(sched, "a", 2, max_tokens=3)
    batches = [[s.request_id for s in step(sched).scheduled]]
    add(sched, "b", 2, max_tokens=3)
    batches.append([s.request_id for s in step(sched).scheduled])
    add(sched, "c", 2, max_tokens=1)
    add(sched, "d", 2, max_tokens=1)
    for _ in range(3):
        batches.append([s.request_id for s in step(sched).scheduled])
    assert batches == [["a"], ["a", "b"], ["a", "b", "c"], ["b", "d"], []]
    assert not sched.has_unfinished_requests()
    assert sched.num_steps == 4
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_preemption_evicts_the_newest_running_request():
    sched = make_scheduler(num_blocks=2, block_size=4)
    a = add(sched, "a", 4)
    b = add(sched, "b", 4)
    step(sched)  # each holds one full block; the pool is full
    out = step(sched)  # a needs a second block: b (newest) is preempted
    assert out.preempted_request_ids == ["b"]
    assert plan(out) == [("a", 4, 1)]
    assert sched.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.block_ids) == (0, [])
    assert list(sched.waiting) == [b]
    assert sched.running == [a]
    assert len(a.block_ids) == 2


def test_a_request_that_is_itself_newest_preempts_itself_and_stops_the_step():
    sched = make_scheduler(num_blocks=3, block_size=4)
    reqs = [add(sched, rid, 4) for rid in "abc"]
    step(sched)  # three full blocks, none free
    out = step(sched)
    # a needs a block -> c preempted; b needs a block -> b is the newest -> preempted; stop.
    assert out.preempted_request_ids == ["c", "b"]
    assert plan(out) == [("a", 4, 1)]
    assert list(sched.waiting) == [reqs[1], reqs[2]]  # older first
    assert sched.num_preemptions == 2
    out = step(sched)  # no preemption: a decodes in its block, b does not fit yet
    assert plan(out) == [("a", 5, 1)]


def test_preempted_request_recomputes_prompt_and_outputs_then_samples_next_position():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a = add(sched, "a", 4, max_tokens=2)
    b = add(sched, "b", 4, max_tokens=3, first_token=2000)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[11], [21]]))
    out = sched.schedule()  # a takes the last block, b then needs one: b preempts itself
    assert out.preempted_request_ids == ["b"]
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[12]]))
    assert a.finish_reason == "length"  # frees a's two blocks
    out = sched.schedule()
    assert plan(out) == [("b", 0, 5)]
    (item,) = out.scheduled
    assert item.token_ids == [2000, 2001, 2002, 2003, 21]
    assert item.needs_sample
    assert item.output_token_ids == [21]
    sched.update_from_output(out, ModelRunnerOutput(["b"], [[22]]))
    assert b.output_token_ids == [21, 22]
    assert b.num_computed_tokens == 5
    assert plan(sched.schedule()) == [("b", 5, 1)]


def test_preemption_waits_until_the_next_step_to_admit():
    sched = make_scheduler(num_blocks=2, block_size=4)
    add(sched, "a", 4)
    add(sched, "b", 4)
    step(sched)
    add(sched, "c", 1)
    out = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]  # nothing admitted this step
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_scheduled_request_carries_block_table_and_sampling_inputs():
    sched = make_scheduler(block_size=4)
    req = add(sched, "a", 6)
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.block_ids == req.block_ids and len(item.block_ids) == 2
    assert item.prompt_token_ids == list(range(1000, 1006))
    assert item.sampling_params == req.sampling_params
    assert not out.is_empty
    sched.update_from_output(out, fake_output(out))
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().is_empty
    assert sched.num_steps == 1


def test_no_admission_in_a_step_that_preempted_even_if_blocks_came_free():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=5)
    add(sched, "a", 4)
    add(sched, "b", 8)
    assert plan(step(sched)) == [("a", 0, 4), ("b", 0, 1)]  # b: a 1-token chunk, 1 block
    out = step(sched)  # a takes the last block; b's next chunk needs one: b preempts itself
    assert out.preempted_request_ids == ["b"]
    assert plan(out) == [("a", 4, 1)]  # b's freed block would fit a 4-token chunk: not now
    assert plan(step(sched)) == [("a", 5, 1), ("b", 0, 4)]


def test_prompt_logprobs_are_reported_once_with_the_first_token():
    """The runner's prompt logprobs (opaque here) gather over the prompt's chunks; positions
    reported again (a prompt recomputed after a preemption) are not added twice; the request's
    first record carries them all, None first (the first prompt token has none), and no later
    record does."""
    sched = make_scheduler(budget=8)
    prompt = list(range(1000, 1020))
    sched.add_request(Request("a", prompt, SamplingParams(prompt_logprobs=0), max_tokens=5))
    lps = [f"lp{p}" for p in range(1, 20)]  # position p - 1's entry: prompt token p

    def run(chunk):
        out = sched.schedule()
        runner_out = fake_output(out)
        runner_out.prompt_logprobs = {"a": chunk}
        return sched.update_from_output(out, runner_out)

    assert run((0, lps[0:8])) == []  # positions 0-7, no sample yet
    assert run((0, lps[0:16])) == []  # positions 8-15, as if 0-7 were recomputed too
    (first,) = run((16, lps[16:19]))  # positions 16-19: the last one samples
    assert first.new_token_ids == [7] and first.prompt_logprobs == [None, *lps]
    (second,) = run((19, []))
    assert second.new_token_ids == [7] and second.prompt_logprobs is None


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    """A prompt computes at most `long_prefill_token_threshold` tokens a step (vLLM's option),
    running or newly admitted, and the budget it leaves goes to the next requests; decodes and
    short prompts are not affected."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_model_len=256,
                             long_prefill_token_threshold=10)  # fmt: skip
    sched = Scheduler(config, num_blocks=64, block_size=4, enable_prefix_caching=False)
    add(sched, "a", 25)
    add(sched, "b", 6)
    add(sched, "c", 30)
    out = step(sched)
    assert plan(out) == [("a", 0, 10), ("b", 0, 6), ("c", 0, 10)]
    out = step(sched)
    assert plan(out) == [("a", 10, 10), ("b", 6, 1), ("c", 10, 10)]
    out = step(sched)
    assert plan(out) == [("a", 20, 5), ("b", 7, 1), ("c", 20, 10)]
    assert plan(step(sched)) == [("a", 25, 1), ("b", 8, 1), ("c", 30, 1)]
