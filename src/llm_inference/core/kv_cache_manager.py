"""Block tables of requests, over one BlockPool, and the position -> slot arithmetic.

A request's block table `block_ids` maps logical block i (token positions
`[i * block_size, (i + 1) * block_size)`) to a physical block. The token at position p
lives in slot `block_ids[p // block_size] * block_size + p % block_size` of the flat
cache `[num_blocks * block_size, ...]`.

`allocate_slots(request, n)` grows the table so that positions `[0, num_computed + n)` have
slots:

    |<---- num_computed_tokens ---->|<--- num_new_tokens --->|
    [ block 0 ][ block 1 ][ block 2 ][ block 3 ][ new block ]
    |<-- already in request.block_ids -------->|<- allocated ->|

With prefix caching, a request being admitted first looks up its longest cached prefix
(`get_computed_blocks`, whole full blocks, never its last token) and `allocate_slots` puts
those shared blocks (ref counts + 1, revived from the free queue when unreferenced) at the
head of its table, then new blocks of its own for the rest: computation starts at a block
edge, so nothing is ever written into a shared block. `cache_full_blocks` enters each block
into the cache once its tokens are computed (see core/prefix_cache.py).
"""

from __future__ import annotations

from llm_inference.config import cdiv
from llm_inference.core.block_pool import BlockPool
from llm_inference.core.prefix_cache import CacheHit, PrefixCache
from llm_inference.core.request import Request


def slot_for_position(block_ids: list[int], position: int, block_size: int) -> int:
    """Flat cache slot of the token at `position` (IndexError past the block table)."""
    if position < 0:
        raise IndexError(f"negative token position {position}")
    logical = position // block_size
    if logical >= len(block_ids):
        raise IndexError(
            f"position {position} needs logical block {logical}, but the block table has "
            f"{len(block_ids)} blocks"
        )
    return block_ids[logical] * block_size + position % block_size


def slot_mapping(
    block_ids: list[int], start_position: int, num_tokens: int, block_size: int
) -> list[int]:
    """Slots of positions `[start_position, start_position + num_tokens)`, block by block."""
    if num_tokens == 0:
        return []
    end = start_position + num_tokens
    slot_for_position(block_ids, end - 1, block_size)  # bounds check
    slots: list[int] = []
    pos = start_position
    while pos < end:
        offset = pos % block_size
        run = min(block_size - offset, end - pos)
        base = slot_for_position(block_ids, pos, block_size)
        slots.extend(range(base, base + run))
        pos += run
    return slots


class KVCacheManager:
    """Allocates and frees the blocks of requests; the only writer of `request.block_ids`.

    `prefix_cache_queries` / `prefix_cache_hits` count tokens of admitted requests: all of
    their tokens, and those found in the cache (as vLLM's metrics of the same names).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.prefix_cache = (
            PrefixCache(self.block_pool, block_size) if enable_prefix_caching else None
        )
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits in the whole pool (when nothing else runs)."""
        return self.blocks_for_tokens(num_tokens) <= self.block_pool.num_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks `request` needs to hold `num_computed_tokens + num_new_tokens` tokens."""
        total = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids))

    def get_computed_blocks(self, request: Request) -> CacheHit:
        """The longest cached prefix of a request that holds no blocks (empty when caching is
        off, and for a request that wants its prompt's logprobs: every prompt token must run);
        changes nothing. Pass it to `allocate_slots` to admit the request."""
        if (
            self.prefix_cache is None
            or request.block_ids
            or request.sampling_params.prompt_logprobs is not None
        ):
            return CacheHit()
        return self.prefix_cache.find_longest_hit(request)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: CacheHit | None = None
    ) -> bool:
        """Grow `request.block_ids` to cover its next `num_new_tokens` tokens; with `hit` (on
        admission: the request holds no blocks), after the hit's `num_tokens`, whose shared
        blocks head its table. The caller then sets `num_computed_tokens = hit.num_tokens`.

        Returns False, changing nothing, when the pool has too few free blocks (hit blocks
        nobody holds count: they leave the free queue).
        """
        pool = self.block_pool
        if hit is None or not hit.block_ids:
            needed = self.num_blocks_needed(request, num_new_tokens)
            if needed > pool.num_free_blocks:
                return False
            if needed:
                request.block_ids.extend(pool.allocate(needed))
        else:
            if request.block_ids or request.num_computed_tokens:
                raise ValueError(f"request {request.request_id!r} already has blocks")
            needed = self.blocks_for_tokens(hit.num_tokens + num_new_tokens) - len(hit.block_ids)
            revived = sum(1 for b in hit.block_ids if pool.ref_cnt(b) == 0)
            if needed + revived > pool.num_free_blocks:
                return False
            pool.touch(hit.block_ids)  # before allocate, which could evict them
            request.block_ids = list(hit.block_ids) + pool.allocate(needed)
            request.cache_keys = list(hit.cache_keys)
        if hit is not None and self.prefix_cache is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within its first `num_computed_tokens`
        tokens into the prefix cache (no-op when caching is off). Pass only tokens whose K/V
        are written: the step that computed them has finished."""
        if self.prefix_cache is not None:
            self.prefix_cache.cache_full_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so the tail is evicted first); cached
        ones stay cached in the free queue until evicted."""
        self.block_pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.cache_keys = []
