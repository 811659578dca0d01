"""The scheduler with prefix caching on (fake model outputs): admission from a cached prefix,
what the workers are sent, same-step admission, decode blocks, preemption re-matching, LRU."""

from __future__ import annotations

from batch_replay import ReplayScheduler as Scheduler

from llm_inference.config import SchedulerConfig
from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, caching=True):
    config = SchedulerConfig(max_num_seqs, budget, max_model_len=256)
    return Scheduler(config, num_blocks, block_size, enable_prefix_caching=caching)


def add(sched, rid, prompt, max_tokens=100):
    req = Request(rid, list(prompt), SamplingParams(), max_tokens=max_tokens)
    sched.add_request(req)
    return req


def step(sched, token=7):
    out = sched.schedule()
    sampled = [[token] if s.needs_sample else [] for s in out.scheduled]
    sched.update_from_output(out, ModelRunnerOutput([s.request_id for s in out.scheduled], sampled))
    return out


def plan(out) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled]


def kv_stats(sched) -> tuple[int, int]:
    kv = sched.kv_cache_manager
    return kv.prefix_cache_queries, kv.prefix_cache_hits


def test_full_prompt_hit_after_the_first_finished_computes_only_the_last_block():
    sched = make_scheduler()
    a = add(sched, "a", range(100, 109), max_tokens=1)  # 9 tokens: blocks [0-3], [4-7], [8]
    step(sched)
    assert a.is_finished
    b = add(sched, "b", range(100, 109), max_tokens=2)
    out = sched.schedule()
    assert plan(out) == [("b", 8, 1)]  # blocks 0 and 1 come from the cache
    (new,) = out.new_requests
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == b.block_ids[:2]
    assert out.num_batched_tokens == 1
    assert kv_stats(sched) == (9 + 9, 8)
    add(sched, "c", range(100, 108), max_tokens=1)  # 8 tokens: a full-prompt hit of
    sched.update_from_output(out, ModelRunnerOutput(["b"], [[7]]))  # 1 block, not 2
    assert plan(step(sched)) == [("b", 9, 1), ("c", 4, 4)]


def test_requests_admitted_in_the_same_step_do_not_hit_later_ones_do():
    sched = make_scheduler()
    for rid in "ab":
        add(sched, rid, range(12), max_tokens=3)
    assert plan(step(sched)) == [("a", 0, 12), ("b", 0, 12)]
    add(sched, "c", range(12), max_tokens=3)
    assert plan(step(sched)) == [("a", 12, 1), ("b", 12, 1), ("c", 8, 4)]
    a, b, c = (sched.requests[r] for r in "abc")
    pool = sched.kv_cache_manager.block_pool
    assert c.block_ids[:2] == a.block_ids[:2]  # a cached first; b's copies stay private
    assert [pool.ref_cnt(x) for x in a.block_ids[:2]] == [2, 2]
    assert [pool.ref_cnt(x) for x in b.block_ids[:2]] == [1, 1]
    assert pool.blocks[b.block_ids[0]].block_hash is None


def test_decode_blocks_are_cached_once_computed():
    sched = make_scheduler()
    a = add(sched, "a", range(6), max_tokens=5)  # tokens 0..5, outputs 7 x 5
    while not a.is_finished:
        step(sched)
    # 11 tokens, 10 computed (the last sample never is): blocks 0 and 1 full and cached
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 2
    b = add(sched, "b", a.all_token_ids + [50, 51], max_tokens=1)  # a follow-up turn
    assert plan(step(sched)) == [("b", 8, 5)]
    assert b.finish_reason == "length"


def test_a_preempted_request_rematches_its_prefix_when_readmitted():
    sched = make_scheduler(num_blocks=3)
    a = add(sched, "a", range(4), max_tokens=2)
    b = add(sched, "b", range(2000, 2004), max_tokens=3)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[11], [21]]))
    out = sched.schedule()  # a takes the last block, b then needs one: b preempts itself
    assert out.preempted_request_ids == ["b"]
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[12]]))
    assert a.finish_reason == "length"
    out = sched.schedule()
    assert plan(out) == [("b", 4, 1)]  # its first block survived in the cache
    (item,) = out.scheduled
    assert item.token_ids == [21] and item.output_token_ids == [21] and item.needs_sample
    sched.update_from_output(out, ModelRunnerOutput(["b"], [[22]]))
    assert b.output_token_ids == [21, 22] and b.num_computed_tokens == 5
    assert sched.num_preemptions == 1


def test_shared_blocks_survive_preemption_of_one_holder():
    sched = make_scheduler(num_blocks=4, budget=16)
    a = add(sched, "a", range(9), max_tokens=20)
    step(sched)
    b = add(sched, "b", range(9), max_tokens=20)  # shares a's two full blocks
    step(sched)
    pool = sched.kv_cache_manager.block_pool
    assert b.block_ids[:2] == a.block_ids[:2] and pool.ref_cnt(a.block_ids[0]) == 2
    for _ in range(3):  # a's third block fills; a needs a fourth: b (newest) is preempted
        out = step(sched)
    assert b.status is RequestStatus.PREEMPTED and out.preempted_request_ids == ["b"]
    assert pool.ref_cnt(a.block_ids[0]) == 1 and b.block_ids == []
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out = step(sched)
    assert plan(out) == [("b", 8, 4)]  # prompt blocks re-matched; the rest recomputed
    assert (b.num_computed_tokens, b.num_output_tokens) == (12, 4)
    assert pool.num_free_blocks == pool.num_blocks - 3


def test_eviction_is_least_recently_used_first():
    sched = make_scheduler(num_blocks=4)
    add(sched, "old", range(100, 105), max_tokens=1)
    step(sched)
    add(sched, "new", range(200, 205), max_tokens=1)
    step(sched)
    add(sched, "big", range(300, 312), max_tokens=1)  # 3 blocks: evicts old's, not new's
    step(sched)
    assert plan(step_after(sched, "new2", range(200, 205))) == [("new2", 4, 1)]
    assert plan(step_after(sched, "old2", range(100, 105))) == [("old2", 0, 5)]


def step_after(sched, rid, prompt):
    add(sched, rid, prompt, max_tokens=1)
    return step(sched)


def test_hits_do_not_count_against_the_token_budget():
    sched = make_scheduler(budget=4)
    add(sched, "a", range(13), max_tokens=1)
    while sched.has_unfinished_requests():
        step(sched)
    add(sched, "b", range(13), max_tokens=1)
    add(sched, "c", range(4), max_tokens=1)
    assert plan(step(sched)) == [("b", 12, 1), ("c", 0, 3)]


def test_caching_off_recomputes_everything():
    sched = make_scheduler(caching=False)
    add(sched, "a", range(9), max_tokens=1)
    step(sched)
    add(sched, "b", range(9), max_tokens=1)
    assert plan(step(sched)) == [("b", 0, 9)]
    assert kv_stats(sched) == (0, 0)
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 0
