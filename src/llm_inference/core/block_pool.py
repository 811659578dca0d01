"""A fixed pool of KV cache blocks: reference counts, an LRU free queue, and the prefix cache
index (block hash -> block).

States of a block (`ref_cnt` is the number of running requests whose block table holds it):

- used: `ref_cnt >= 1`, not in the free queue. Nothing is written into a cached used block:
  only full blocks (all tokens computed) are cached, and requests append into blocks of
  their own.
- free: `ref_cnt == 0`, in the free queue exactly once. A free block may still be cached
  (keep its `block_hash` and contents) and be revived by a cache hit (`touch`), until
  `allocate` reaches it at the head of the queue and evicts it (its hash is dropped).

`num_free_blocks + num_used_blocks == num_blocks` at all times; cached blocks are a subset of
the blocks, free or used, and the index maps each cached hash to exactly one block whose
`block_hash` is that hash.

The free queue is ordered least recently used first: `free` appends at the tail, `allocate`
takes from the head, `touch` removes from anywhere (an OrderedDict keyed by block id, so
every operation is O(1)). Requests free their blocks tail first, so the last blocks of a
sequence, the least likely to be shared, are evicted before its first ones.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """`allocate` asked for more blocks than are free."""


@dataclass
class KVCacheBlock:
    """One block's bookkeeping. The cache fields are set while it is cached, else empty."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # None: not in the prefix cache
    token_ids: bytes = b""  # its tokens (kv_cache_utils.pack_tokens), to confirm a hit against
    cache_key: int = 0  # unique per caching (never reused); 0 when not cached
    parent_key: int = 0  # cache_key of the previous block of its sequence; 0 for block 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, KVCacheBlock] = {}
        self._by_key: dict[int, KVCacheBlock] = {}
        self._next_cache_key = 1
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): all of them can be allocated."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to allocate) first (introspection and tests)."""
        return list(self._free_queue)

    def cached_block_ids(self) -> dict[bytes, int]:
        """The prefix cache index, hash -> block id (introspection and tests)."""
        return {h: b.block_id for h, b in self._cached.items()}

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, each with ref_cnt 1, evicting any
        that are cached."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_queue):
            raise NoFreeBlocksError(
                f"asked for {n} KV blocks but only {len(self._free_queue)} of "
                f"{self.num_blocks} are free"
            )
        ids = [self._free_queue.popitem(last=False)[0] for _ in range(n)]
        for block_id in ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add an owner to used blocks (for sharing); a free block cannot be shared."""
        ids = list(block_ids)
        for block_id in ids:
            if self._block(block_id).ref_cnt < 1:
                raise ValueError(f"block {block_id} is free; allocate it instead of sharing it")
        for block_id in ids:
            self.blocks[block_id].ref_cnt += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add an owner to cached blocks (a prefix cache hit), reviving free ones: they leave
        the free queue without being evicted. Checked before anything changes."""
        ids = list(block_ids)
        for block_id in ids:
            if self._block(block_id).block_hash is None:
                raise ValueError(f"block {block_id} is not cached; it cannot be a cache hit")
        for block_id in ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner per id (an id may repeat); blocks reaching 0 join the tail of the
        free queue, keeping their cache entry.

        Checked before anything changes: an unknown id or more drops than owners raises
        ValueError and leaves the pool as it was.
        """
        ids = list(block_ids)
        for block_id, count in Counter(ids).items():
            ref_cnt = self._block(block_id).ref_cnt
            if count > ref_cnt:
                raise ValueError(
                    f"double free of KV block {block_id}: ref_cnt {ref_cnt}, freed {count} times"
                )
        for block_id in ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block_id] = None

    # ---- prefix cache index ---------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        """The cached block with this hash, if any (the caller confirms its tokens)."""
        return self._cached.get(block_hash)

    def is_cached_key(self, cache_key: int) -> bool:
        """Whether the block cached under `cache_key` is still cached (0, the root, always is)."""
        return cache_key == 0 or cache_key in self._by_key

    def cache_block(
        self, block_id: int, block_hash: bytes, token_ids: bytes, parent_key: int
    ) -> int:
        """Enter a used, full, computed block into the cache; returns its new cache key.

        The hash must not be cached already (the caller looks it up first)."""
        block = self._block(block_id)
        if block.ref_cnt < 1 or block.block_hash is not None:
            raise ValueError(f"block {block_id} must be used and not yet cached to be cached")
        if block_hash in self._cached:
            raise ValueError(f"a block with this hash is already cached (block {block_id})")
        block.block_hash, block.token_ids, block.parent_key = block_hash, token_ids, parent_key
        block.cache_key = self._next_cache_key
        self._next_cache_key += 1
        self._cached[block_hash] = block
        self._by_key[block.cache_key] = block
        return block.cache_key

    def uncache(self, block_id: int) -> None:
        """Drop a block from the cache index (its owners, if any, keep it as a plain block)."""
        block = self._block(block_id)
        if block.block_hash is None:
            raise ValueError(f"block {block_id} is not cached")
        del self._cached[block.block_hash]
        del self._by_key[block.cache_key]
        block.block_hash, block.token_ids, block.cache_key, block.parent_key = None, b"", 0, 0

    def _evict(self, block: KVCacheBlock) -> None:
        self.uncache(block.block_id)
        self.num_evictions += 1

    def _block(self, block_id: int) -> KVCacheBlock:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"KV block id {block_id} is outside the pool of {self.num_blocks}")
        return self.blocks[block_id]
