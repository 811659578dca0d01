"""The scheduler against a fake *paged* model, and a hypothesis property test.

`FakePagedModel` writes each scheduled token into a dict-backed cache at its slot (as the
real attention layer writes K/V) and, before sampling, reads the request's whole sequence
back through its block table: a block shared by two owners, a stale block, or a recompute
that skipped a token shows up as a mismatch. The next token is a pure function of the
sequence, so preemption and recomputation must not change any request's output.
"""

from __future__ import annotations

from batch_replay import ReplayScheduler as Scheduler
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llm_inference.config import SchedulerConfig
from llm_inference.core.kv_cache_manager import slot_for_position, slot_mapping
from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.sampling_params import SamplingParams

EOS = 0


def next_token(seq: list[int], salt: int, vocab: int) -> int:
    return hash((salt, tuple(seq))) % vocab


class FakePagedModel:
    def __init__(self, block_size: int, salt: int = 0, vocab: int = 1000) -> None:
        self.block_size, self.salt, self.vocab = block_size, salt, vocab
        self.cache: dict[int, int] = {}

    def execute(self, out) -> ModelRunnerOutput:
        bs = self.block_size
        written: set[int] = set()
        sampled = []
        for item in out.scheduled:
            slots = slot_mapping(item.block_ids, item.start_position, len(item.token_ids), bs)
            assert written.isdisjoint(slots), "two tokens of one step share a slot"
            written.update(slots)
            self.cache.update(zip(slots, item.token_ids, strict=True))
            if not item.needs_sample:
                sampled.append([])
                continue
            seq = item.prompt_token_ids + item.output_token_ids
            end = item.start_position + len(item.token_ids)
            assert end == len(seq)
            cached = [self.cache.get(slot_for_position(item.block_ids, p, bs)) for p in range(end)]
            assert cached == seq, f"cache of {item.request_id} does not hold its sequence"
            sampled.append([next_token(seq, self.salt, self.vocab)])
        return ModelRunnerOutput([s.request_id for s in out.scheduled], sampled)


def check_invariants(sched: Scheduler, finished: list[Request]) -> None:
    pool = sched.kv_cache_manager.block_pool
    owned = [b for r in sched.running for b in r.block_ids]
    assert len(owned) == len(set(owned)), "a block has two owners"
    used = {b.block_id for b in pool.blocks if b.ref_cnt > 0}
    assert set(owned) == used, "leaked or unowned-but-used blocks"
    assert all(pool.ref_cnt(b) == 1 for b in owned)
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) and set(free).isdisjoint(used)
    assert len(free) + len(used) == pool.num_blocks
    assert len(sched.running) <= sched.config.max_num_seqs
    bs = sched.kv_cache_manager.block_size
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_ids) * bs >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_ids == [] and r.num_computed_tokens == 0
    ids = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
    assert sorted(ids) == sorted(sched.requests)
    assert all(r.block_ids == [] and r.is_finished for r in finished)
    if not sched.has_unfinished_requests():
        assert pool.num_free_blocks == pool.num_blocks


def reference_outputs(prompt: list[int], max_tokens: int, salt: int, vocab: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq, salt, vocab))
    return seq[len(prompt) :]


def run_workload(num_blocks: int, budget: int) -> tuple[list[Request], Scheduler]:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64)
    sched = Scheduler(config, num_blocks=num_blocks, block_size=4)
    model = FakePagedModel(block_size=4)
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
    return reqs, sched


def test_preemption_and_recompute_do_not_change_outputs():
    roomy, roomy_sched = run_workload(num_blocks=64, budget=32)
    tight, tight_sched = run_workload(num_blocks=7, budget=5)
    assert roomy_sched.num_preemptions == 0
    assert tight_sched.num_preemptions > 0
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
)
def test_random_operations_never_leak_or_share_blocks(
    num_blocks, block_size, max_num_seqs, budget, salt, first_adds, ops
):
    capacity = num_blocks * block_size
    config = SchedulerConfig(max_num_seqs, budget, max_model_len=capacity)
    sched = Scheduler(config, num_blocks=num_blocks, block_size=block_size)
    model = FakePagedModel(block_size, salt=salt, vocab=16)  # EOS comes 1 time in 16
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
