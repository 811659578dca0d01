from __future__ import annotations

import pytest

from llm_inference.core.block_pool import BlockPool, KVCacheBlock, NoFreeBlocksError


def test_allocate_takes_free_blocks_in_fifo_order_with_ref_count_one():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 2
    assert pool.num_used_blocks == 3
    assert [pool.ref_cnt(i) for i in range(5)] == [1, 1, 1, 0, 0]
    assert pool.allocate(0) == []


def test_freed_blocks_go_to_the_tail_of_the_free_queue():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.free([1, 0])
    assert pool.free_block_ids() == [3, 1, 0]
    assert pool.allocate(2) == [3, 1]


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="only 1 of 3"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_double_free_raises_and_leaves_pool_unchanged():
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.free([ids[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[1], ids[0]])
    # ids[1] was not released by the failed call
    assert pool.ref_cnt(ids[1]) == 1
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[1], ids[1]])
    assert pool.ref_cnt(ids[1]) == 1


def test_free_of_unknown_block_id_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="outside"):
        pool.free([2])
    with pytest.raises(ValueError, match="outside"):
        pool.free([-1])


def test_shared_block_is_free_only_after_last_owner_frees_it():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_cnt(block) == 2
    pool.free([block])
    assert pool.ref_cnt(block) == 1
    assert block not in pool.free_block_ids()
    pool.free([block])
    assert pool.ref_cnt(block) == 0
    assert pool.free_block_ids()[-1] == block
    with pytest.raises(ValueError, match="is free"):
        pool.incref([block])


def test_blocks_are_kv_cache_block_records_with_hash_slot():
    pool = BlockPool(2)
    assert pool.blocks[1] == KVCacheBlock(block_id=1, ref_cnt=0, block_hash=None)
    with pytest.raises(ValueError):
        BlockPool(0)
