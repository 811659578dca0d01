"""A fake *paged* model for scheduler tests, the scheduler's invariants, and reference outputs.

`FakePagedModel` writes each scheduled token into a dict-backed cache at its slot (as the
real attention layer writes K/V) and, before sampling, reads the request's whole sequence
back through its block table: a block shared by two owners, a stale block, a cached block
overwritten, or a recompute that skipped a token shows up as a mismatch. The next token is
a pure function of the sequence, so preemption, recomputation and prefix cache hits must not
change any request's output. Given the block pool, it also checks that nothing is written into
a cached or shared block.
"""

from __future__ import annotations

import struct
from collections import Counter

from llm_inference.core.block_pool import BlockPool
from llm_inference.core.kv_cache_manager import slot_for_position, slot_mapping
from llm_inference.core.kv_cache_utils import ROOT_BLOCK_HASH, hash_block_tokens
from llm_inference.core.outputs import ModelRunnerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.core.scheduler import Scheduler
from llm_inference.sampling_params import SamplingParams


def next_token(seq: list[int], salt: int, vocab: int) -> int:
    return hash((salt, tuple(seq))) % vocab


class FakePagedModel:
    def __init__(
        self, block_size: int, salt: int = 0, vocab: int = 1000, pool: BlockPool | None = None
    ) -> None:
        self.block_size, self.salt, self.vocab = block_size, salt, vocab
        self.pool = pool
        self.cache: dict[int, int] = {}

    def execute(self, out) -> ModelRunnerOutput:
        bs = self.block_size
        written: set[int] = set()
        sampled = []
        for item in out.scheduled:
            slots = slot_mapping(item.block_ids, item.start_position, len(item.token_ids), bs)
            assert written.isdisjoint(slots), "two tokens of one step share a slot"
            written.update(slots)
            if self.pool is not None:
                for block_id in {s // bs for s in slots}:
                    block = self.pool.blocks[block_id]
                    assert block.block_hash is None, f"write into cached block {block_id}"
                    assert block.ref_cnt <= 1, f"write into shared block {block_id}"
            self.cache.update(zip(slots, item.token_ids, strict=True))
            if not item.needs_sample:
                sampled.append([])
                continue
            assert item.token_ids, "a sample needs its last token computed (for its logits)"
            seq = item.prompt_token_ids + item.output_token_ids
            end = item.start_position + len(item.token_ids)
            assert end == len(seq)
            cached = [self.cache.get(slot_for_position(item.block_ids, p, bs)) for p in range(end)]
            assert cached == seq, f"cache of {item.request_id} does not hold its sequence"
            sampled.append([next_token(seq, self.salt, self.vocab)])
        return ModelRunnerOutput([s.request_id for s in out.scheduled], sampled)


def check_invariants(sched: Scheduler, finished: list[Request]) -> None:
    """Ownership: a block's ref_cnt is the number of running requests holding it; free blocks
    are exactly the unreferenced ones; a cached block in a table is wholly computed."""
    pool = sched.kv_cache_manager.block_pool
    bs = sched.kv_cache_manager.block_size
    holders = Counter(b for r in sched.running for b in r.block_ids)
    for r in sched.running:
        assert len(set(r.block_ids)) == len(r.block_ids), "a block twice in one table"
    used = {b.block_id for b in pool.blocks if b.ref_cnt > 0}
    assert set(holders) == used, "leaked or unowned-but-used blocks"
    assert all(pool.ref_cnt(b) == n for b, n in holders.items())
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) and set(free).isdisjoint(used)
    assert len(free) + len(used) == pool.num_blocks
    assert len(sched.running) <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_ids) * bs >= r.num_computed_tokens
        assert len(r.cache_keys) <= len(r.block_ids)
        for i, b in enumerate(r.block_ids):
            if holders[b] > 1 or pool.blocks[b].block_hash is not None:
                assert (i + 1) * bs <= r.num_computed_tokens, "shared block not fully computed"
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_ids == [] and r.cache_keys == [] and r.num_computed_tokens == 0
    ids = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
    assert sorted(ids) == sorted(sched.requests)
    assert all(r.block_ids == [] and r.is_finished for r in finished)
    if not sched.has_unfinished_requests():
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)


def check_prefix_cache(sched: Scheduler, model: FakePagedModel, hash_fn=hash_block_tokens) -> None:
    """The cache index is consistent and every cached block holds (in the fake cache) the
    tokens it is cached with, under the hash chained from its parent's (when still cached)."""
    pool = sched.kv_cache_manager.block_pool
    bs = sched.kv_cache_manager.block_size
    index = pool.cached_block_ids()
    by_key = {}
    for block_hash, block_id in index.items():
        block = pool.blocks[block_id]
        assert block.block_hash == block_hash and block.cache_key > 0
        assert len(block.token_ids) == 8 * bs  # packed as int64 (kv_cache_utils.pack_tokens)
        slots = range(block_id * bs, (block_id + 1) * bs)
        assert [model.cache.get(s) for s in slots] == _unpacked(block)
        by_key[block.cache_key] = block
    cached_ids = set(index.values())
    uncached = [b for b in pool.blocks if b.block_id not in cached_ids]
    assert all(b.block_hash is None and b.cache_key == 0 for b in uncached)
    for block in by_key.values():
        parent = ROOT_BLOCK_HASH if block.parent_key == 0 else None
        if block.parent_key in by_key:
            parent = by_key[block.parent_key].block_hash
        if parent is not None:
            assert block.block_hash == hash_fn(parent, _unpacked(block))


def _unpacked(block) -> list[int]:
    """A cached block's token ids (stored packed, little-endian int64)."""
    return list(struct.unpack(f"<{len(block.token_ids) // 8}q", block.token_ids))


def reference_outputs(
    prompt: list[int],
    params: SamplingParams,
    salt: int,
    vocab: int,
    eos: tuple[int, ...] = (),
    max_model_len: int = 1 << 30,
) -> list[int]:
    """The outputs of a request run alone, with the scheduler's stop rules."""
    seq, out = list(prompt), []
    max_tokens = params.max_tokens if params.max_tokens is not None else 1 << 30
    while True:
        token = next_token(seq, salt, vocab)
        seq.append(token)
        out.append(token)
        if len(out) >= params.min_tokens and not params.ignore_eos and token in eos:
            return out
        if token in params.stop_token_ids and len(out) >= params.min_tokens:
            return out
        if len(out) >= max_tokens or len(seq) >= max_model_len:
            return out
