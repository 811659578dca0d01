from __future__ import annotations

import random

import pytest

from llm_inference.core.kv_cache_manager import KVCacheManager, slot_for_position, slot_mapping
from llm_inference.core.request import Request
from llm_inference.sampling_params import SamplingParams


def flat_slots(block_ids: list[int], block_size: int) -> list[int]:
    """Oracle: enumerate the slots of a block table in logical order, one block at a time."""
    slots = []
    for block in block_ids:
        first = block * block_size
        slots.extend(first + offset for offset in range(block_size))
    return slots


def make_request(num_prompt: int, rid: str = "r") -> Request:
    return Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=4))


def test_slot_for_position_examples():
    # block_size 4, table [7, 2]: positions 0..3 -> 28..31, 4..7 -> 8..11
    assert slot_for_position([7, 2], 0, 4) == 28
    assert slot_for_position([7, 2], 3, 4) == 31
    assert slot_for_position([7, 2], 4, 4) == 8
    assert slot_for_position([7, 2], 6, 4) == 10
    with pytest.raises(IndexError):
        slot_for_position([7, 2], 8, 4)
    with pytest.raises(IndexError):
        slot_for_position([7, 2], -1, 4)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_slot_mapping_matches_block_by_block_enumeration(block_size):
    rng = random.Random(block_size)
    for _ in range(50):
        num_blocks = rng.randint(1, 8)
        table = rng.sample(range(100), num_blocks)
        oracle = flat_slots(table, block_size)
        start = rng.randrange(len(oracle))
        count = rng.randint(0, len(oracle) - start)
        assert slot_mapping(table, start, count, block_size) == oracle[start : start + count]
        assert all(slot_for_position(table, p, block_size) == oracle[p] for p in range(len(oracle)))


def test_slot_mapping_past_the_table_raises():
    with pytest.raises(IndexError):
        slot_mapping([0, 1], 6, 3, 4)


def test_allocate_slots_grows_the_block_table_only_as_needed():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = make_request(6)
    assert kv.num_blocks_needed(req, 6) == 2
    assert kv.allocate_slots(req, 6)
    assert req.block_ids == [0, 1]
    req.num_computed_tokens = 6
    assert kv.num_blocks_needed(req, 2) == 0  # positions 6, 7 fit in block 1
    assert kv.allocate_slots(req, 2)
    assert req.block_ids == [0, 1]
    req.num_computed_tokens = 8
    assert kv.num_blocks_needed(req, 1) == 1
    assert kv.allocate_slots(req, 1)
    assert req.block_ids == [0, 1, 2]
    assert kv.num_free_blocks == 3
    assert kv.usage == pytest.approx(0.5)


def test_allocate_slots_without_room_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request(8, "a"), make_request(8, "b")
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == []
    assert kv.num_free_blocks == 1


def test_free_returns_blocks_and_clears_the_table():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request(5)
    kv.allocate_slots(req, 5)
    assert kv.num_free_blocks == 1
    kv.free(req)
    assert req.block_ids == []
    assert kv.num_free_blocks == 4
    assert kv.usage == 0.0
    assert all(kv.block_pool.ref_cnt(i) == 0 for i in range(4))


def test_can_fit_compares_with_the_whole_pool():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots(make_request(12), 12)  # pool now full
    assert kv.can_fit(12)
    assert not kv.can_fit(13)
