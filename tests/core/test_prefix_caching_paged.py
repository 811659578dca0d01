"""Prefix caching against the fake paged model (tests/paged_model.py): hypothesis-driven
operations on requests that share prefixes (also under a hash that collides all the time),
and a 512-request stress run with preemption and aborts. Every step checks ownership (a
block's ref_cnt is the number of running requests holding it, nothing written into a cached
or shared block) and the cache (each cached block holds its tokens); at the end every block
is free, and every request's outputs equal those of the request run alone."""

from __future__ import annotations

import random
from contextlib import nullcontext
from unittest import mock

from batch_replay import ReplayScheduler as Scheduler
from hypothesis import event, given, settings
from hypothesis import strategies as st
from paged_model import FakePagedModel, check_invariants, check_prefix_cache, reference_outputs

from llm_inference.config import SchedulerConfig
from llm_inference.core import kv_cache_utils
from llm_inference.core.request import Request, RequestStatus
from llm_inference.sampling_params import SamplingParams

EOS = 0


def weak_hash(parent: bytes, tokens) -> bytes:
    """A hash with four values: collisions everywhere (hits must still be exact)."""
    return bytes([(parent[0] + sum(tokens)) % 4])


class Harness:
    """A scheduler, the fake model, the requests added, and the checks of every step."""

    def __init__(
        self, num_blocks, block_size, max_num_seqs, budget, salt, vocab, hash_fn, max_len=None
    ):
        self.capacity = max_len or num_blocks * block_size  # max_model_len
        config = SchedulerConfig(max_num_seqs, budget, max_model_len=self.capacity)
        self.sched = Scheduler(config, num_blocks, block_size, enable_prefix_caching=True)
        pool = self.sched.kv_cache_manager.block_pool
        self.model = FakePagedModel(block_size, salt=salt, vocab=vocab, pool=pool)
        self.salt, self.vocab, self.hash_fn = salt, vocab, hash_fn
        self.reqs: list[Request] = []
        self.aborted: set[str] = set()

    def add(self, prompt: list[int], params: SamplingParams) -> None:
        prompt = prompt[: self.capacity - 1] or [1]
        req = Request(f"r{len(self.reqs)}", prompt, params, eos_token_ids=(EOS,))
        self.reqs.append(req)
        self.sched.add_request(req)

    def abort(self, rid: str) -> None:
        if rid in self.sched.requests:
            self.aborted.add(rid)
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def step(self, abort_index: int | None = None) -> None:
        out = self.sched.schedule()
        if abort_index is not None and out.scheduled:
            self.abort(out.scheduled[abort_index % len(out.scheduled)].request_id)
        self.sched.update_from_output(out, self.model.execute(out))

    def check(self, cache_too: bool = True) -> None:
        check_invariants(self.sched, [r for r in self.reqs if r.is_finished])
        if cache_too:
            check_prefix_cache(self.sched, self.model, self.hash_fn)

    def drain(self, limit: int = 5000) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            self.check(cache_too=False)
        self.check()
        assert not self.sched.has_unfinished_requests()

    def check_outputs(self) -> None:
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks  # every block free, cached or not
        for r in self.reqs:
            assert r.is_finished
            want = reference_outputs(
                r.prompt_token_ids, r.sampling_params, self.salt, self.vocab, (EOS,), self.capacity
            )
            if r.request_id in self.aborted:
                assert r.output_token_ids == want[: r.num_output_tokens]
            else:
                assert r.output_token_ids == want, r.request_id


stem = st.lists(st.integers(1, 6), min_size=0, max_size=14)
add_op = st.tuples(
    st.just("add"),
    st.integers(0, 2),  # which stem
    st.integers(0, 14),  # how much of it
    st.lists(st.integers(1, 9), max_size=4),  # own suffix
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # min_tokens / ignore_eos
)
op = st.one_of(
    add_op,
    st.tuples(st.just("again"), st.integers(0, 50)),  # resubmit an earlier prompt
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 50)),
)


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(2, 16),
    block_size=st.integers(1, 4),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    salt=st.integers(0, 10**6),
    weak=st.booleans(),
    stems=st.lists(stem, min_size=3, max_size=3),
    first_adds=st.lists(add_op, min_size=1, max_size=6),
    ops=st.lists(op, max_size=60),
)
def test_shared_prefixes_never_change_outputs_leak_or_overwrite_blocks(
    num_blocks, block_size, max_num_seqs, budget, salt, weak, stems, first_adds, ops
):
    hash_fn = weak_hash if weak else kv_cache_utils.hash_block_tokens
    patch = mock.patch.object(kv_cache_utils, "hash_block_tokens", weak_hash)
    with patch if weak else nullcontext():
        h = Harness(num_blocks, block_size, max_num_seqs, budget, salt, vocab=8, hash_fn=hash_fn)
        for kind, *args in first_adds + ops:
            if kind == "add":
                which, k, suffix, max_tokens, c = args
                params = SamplingParams(
                    max_tokens=max_tokens, min_tokens=min(c % 3, max_tokens), ignore_eos=c == 3
                )
                h.add(stems[which][:k] + suffix, params)
            elif kind == "again":
                old = h.reqs[args[0] % len(h.reqs)]
                h.add(old.prompt_token_ids, old.sampling_params)
            elif kind == "step":
                for _ in range(args[0]):
                    h.step()
            elif kind == "abort":
                h.abort(h.reqs[args[0] % len(h.reqs)].request_id)
            else:
                h.step(abort_index=args[0])
            h.check()
        h.drain()
        h.check_outputs()
    kv = h.sched.kv_cache_manager
    event(f"hit: {kv.prefix_cache_hits > 0}")
    event(f"preempted: {h.sched.num_preemptions > 0}")
    event(f"evicted: {kv.block_pool.num_evictions > 0}")


def test_stress_512_requests_with_shared_prefixes_preemption_and_aborts():
    rng = random.Random(1234)
    h = Harness(96, 4, 64, 128, 7, 64, kv_cache_utils.hash_block_tokens, max_len=128)
    stems = [[rng.randrange(1, 64) for _ in range(rng.randint(8, 48))] for _ in range(8)]
    for _ in range(512):
        if h.reqs and rng.random() < 0.1:
            prompt = list(rng.choice(h.reqs).prompt_token_ids)  # the same prompt again
        else:
            s = rng.choice(stems)
            cut = rng.choice([len(s), len(s) - 1, rng.randint(0, len(s))])
            prompt = s[:cut] + [rng.randrange(1, 64) for _ in range(rng.randint(0, 8))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
        h.add(prompt, params)
    for n in range(5000):
        if not h.sched.has_unfinished_requests():
            break
        if rng.random() < 0.05:
            h.abort(rng.choice(h.reqs).request_id)
        h.step(abort_index=rng.randrange(64) if rng.random() < 0.03 else None)
        h.check(cache_too=n % 10 == 0)
    h.drain()
    h.check_outputs()
    kv = h.sched.kv_cache_manager
    assert h.sched.num_preemptions > 0 and kv.block_pool.num_evictions > 0 and h.aborted
    assert kv.prefix_cache_hits > kv.prefix_cache_queries // 5
