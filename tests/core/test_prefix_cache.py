"""Prefix caching units: stable chained hashes, the block pool's cache index and LRU free
queue, longest-hit lookup (capped short of the last token, confirmed against tokens)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from llm_inference.core import kv_cache_utils
from llm_inference.core.block_pool import BlockPool
from llm_inference.core.kv_cache_manager import KVCacheManager
from llm_inference.core.kv_cache_utils import (
    ROOT_BLOCK_HASH,
    block_hashes,
    hash_block_tokens,
    pack_tokens,
)
from llm_inference.core.prefix_cache import CacheHit
from llm_inference.core.request import Request
from llm_inference.sampling_params import SamplingParams


def req(tokens, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def compute(kv: KVCacheManager, r: Request) -> CacheHit:
    """Admit `r` as the scheduler does, compute all its tokens and cache its full blocks."""
    hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r, r.num_computed_tokens)
    return hit


# ---- hashing ---------------------------------------------------------------------------------


def test_block_hash_is_a_stable_sha256_chained_to_the_parent():
    want = hashlib.sha256(ROOT_BLOCK_HASH + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4]) == want
    # A constant of this code, not of the process (never Python's salted hash).
    assert want.hex().startswith("bab579354963cc1f")
    assert hash_block_tokens(want, [1, 2, 3, 4]) != want
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 5]) != want


def test_block_hashes_cover_full_blocks_only_and_are_computed_once():
    r = req(range(10))
    hashes = block_hashes(r, 2, 4)
    assert hashes is r.block_hashes and len(hashes) == 2
    assert hashes[1] == hash_block_tokens(
        hash_block_tokens(ROOT_BLOCK_HASH, [0, 1, 2, 3]), [4, 5, 6, 7]
    )
    with pytest.raises(ValueError):
        block_hashes(r, 3, 4)  # tokens 8, 9 are not a full block
    r.append_output_token(10)
    r.append_output_token(11)
    assert block_hashes(r, 3, 4)[:2] == hashes[:2] and len(r.block_hashes) == 3


# ---- block pool ------------------------------------------------------------------------------


def test_freed_cached_block_stays_cached_until_allocate_evicts_it_lru_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    ka = pool.cache_block(a, b"ha", pack_tokens([1]), 0)
    kb = pool.cache_block(b, b"hb", pack_tokens([2]), ka)
    assert (ka, kb) == (1, 2) and pool.num_cached_blocks == 2
    pool.free([b, a, c])  # free order = LRU order: b is evicted first
    assert pool.free_block_ids() == [b, a, c] and pool.num_free_blocks == 3
    assert pool.lookup(b"ha").block_id == a and pool.is_cached_key(ka)
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"hb") is None and not pool.is_cached_key(kb)
    assert pool.blocks[b].block_hash is None and pool.blocks[b].token_ids == b""
    assert pool.num_evictions == 1 and pool.cached_block_ids() == {b"ha": a}


def test_touch_revives_a_free_cached_block_from_the_middle_of_the_queue():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    pool.cache_block(ids[1], b"h", pack_tokens([7]), 0)
    pool.free(ids)
    pool.touch([ids[1]])
    assert pool.ref_cnt(ids[1]) == 1 and pool.free_block_ids() == [ids[0], ids[2], ids[3]]
    pool.touch([ids[1]])  # a second owner of a used block
    assert pool.ref_cnt(ids[1]) == 2 and pool.num_used_blocks == 1
    assert pool.allocate(3) == [ids[0], ids[2], ids[3]]  # never the touched block
    assert pool.lookup(b"h").block_id == ids[1]
    with pytest.raises(ValueError, match="not cached"):
        pool.touch([ids[0]])


def test_cache_block_preconditions_and_uncache():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="used"):
        pool.cache_block(0, b"h", pack_tokens([1]), 0)  # a free block
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h", pack_tokens([1]), 0)
    with pytest.raises(ValueError, match="used and not yet cached"):
        pool.cache_block(a, b"h2", pack_tokens([1]), 0)
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_block(b, b"h", pack_tokens([1]), 0)
    pool.uncache(a)
    assert pool.lookup(b"h") is None and pool.ref_cnt(a) == 1
    with pytest.raises(ValueError, match="not cached"):
        pool.uncache(a)


# ---- longest hit -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "want_hit"),
    [(8, 4), (9, 8), (12, 8), (13, 12), (3, 0), (4, 0), (5, 4)],
)
def test_full_prompt_hit_stops_short_of_the_last_token_in_whole_blocks(num_tokens, want_hit):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    compute(kv, req(range(100, 100 + num_tokens), "a"))
    hit = compute(kv, req(range(100, 100 + num_tokens), "b"))
    assert hit.num_tokens == want_hit == len(hit.block_ids) * 4


@pytest.mark.parametrize(("shared", "want_hit"), [(3, 0), (4, 4), (6, 4), (8, 8), (11, 8)])
def test_shared_prefix_ending_inside_a_block_hits_its_whole_blocks(shared, want_hit):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req(list(range(shared)) + [500 + i for i in range(9)], "a")
    compute(kv, a)
    b = req(list(range(shared)) + [900 + i for i in range(9)], "b")
    hit = compute(kv, b)
    assert hit.num_tokens == want_hit
    assert b.block_ids[: want_hit // 4] == a.block_ids[: want_hit // 4]
    assert all(kv.block_pool.ref_cnt(x) == 2 for x in hit.block_ids)
    assert b.cache_keys[: len(hit.cache_keys)] == hit.cache_keys
    kv.free(a)
    assert all(kv.block_pool.ref_cnt(x) == 1 for x in hit.block_ids)


def test_caching_off_never_hits_and_counts_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute(kv, req(range(9), "a"))
    assert compute(kv, req(range(9), "b")) == CacheHit()
    assert kv.block_pool.num_cached_blocks == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_queries_and_hits_count_tokens_of_admitted_requests():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    compute(kv, req(range(9), "a"))
    compute(kv, req(range(10), "b"))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (19, 8)


def test_admission_counts_revived_blocks_against_the_free_pool():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req(range(9), "a")
    compute(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free, block 2 plain
    b = req(range(13), "b")  # hits 2 blocks, needs 2 more: 4 > 3
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert not kv.allocate_slots(b, 5, hit)
    assert b.block_ids == [] and kv.num_free_blocks == 3 and kv.block_pool.num_cached_blocks == 2
    c = req(range(12), "c")  # hits 2 blocks, needs 1 more: fits exactly without evicting them
    hit = compute(kv, c)
    assert hit.num_tokens == 8 and c.block_ids[:2] == hit.block_ids
    assert kv.num_free_blocks == 0


def test_hash_collisions_never_give_a_false_hit(monkeypatch):
    """With a hash that maps every block to the same value, only exact prefixes hit."""
    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", lambda parent, tokens: b"same")
    kv = KVCacheManager(num_blocks=16, block_size=2)
    compute(kv, req([1, 2, 3, 4, 5], "a"))  # caches block [1, 2] under b"same"
    assert compute(kv, req([1, 3, 3, 4, 5], "b")).num_tokens == 0  # other tokens
    assert compute(kv, req([1, 2, 9, 9, 5], "c")).num_tokens == 2  # only the real block 0
    assert compute(kv, req([1, 2, 3, 4, 5], "d")).num_tokens == 2  # block 1 never cached
    pool = kv.block_pool
    assert pool.num_cached_blocks == 1


def test_a_child_of_an_evicted_parent_is_never_a_hit_and_is_replaced():
    """Tokens and hash alone do not identify a block: its parent (cache key) must be the block
    matched before it. An orphan (parent evicted) is replaced by the next request caching it."""
    kv = KVCacheManager(num_blocks=6, block_size=2)
    pool = kv.block_pool
    a = req([1, 2, 3, 4, 5], "a")
    compute(kv, a)
    parent, child = a.block_ids[:2]
    kv.free(a)
    pool.touch([child])
    others = pool.allocate(5)  # evicts the parent [1, 2], not the touched child [3, 4]
    assert parent in others and pool.lookup(a.block_hashes[0]) is None
    pool.free(others + [child])  # the child is a cached orphan in the free queue
    compute(kv, req([1, 2, 9], "c"))  # caches [1, 2] again, under a new key
    b = req([1, 2, 3, 4, 5], "b")
    assert compute(kv, b).num_tokens == 2  # the orphan [3, 4] is not a hit
    assert b.block_ids[1] != child
    assert pool.lookup(a.block_hashes[1]).block_id == b.block_ids[1]  # b's block replaced it
    assert pool.blocks[child].block_hash is None
    assert compute(kv, req([1, 2, 3, 4, 5], "d")).num_tokens == 4
