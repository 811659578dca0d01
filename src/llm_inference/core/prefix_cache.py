"""Prefix caching: find a request's longest cached prefix, and cache its full blocks.

A cached block stands for one exact token prefix: its own `token_ids` (packed) and the cached block
before it (`parent_key`, the parent's unique `cache_key`; 0 for a sequence's first block).
By induction a chain of blocks matched from block 0, each confirmed against the request's
own tokens and the key of the block matched before it, holds exactly the K/V of the
request's prefix, whatever the hashes do: the hash (core/kv_cache_utils.py) only finds the
candidate, so a collision costs a miss, never a wrong hit. Cache keys are never reused, so a
block evicted and cached again with other contents cannot pass as an old parent.

When a block is cached: once all its tokens are computed (`cache_full_blocks`, called after
each step that advanced the request), prompt and decode blocks alike. Blocks filled in a
step are therefore not hits for requests admitted in that same step; later ones hit. Two
requests computing the same prefix side by side both own a private copy; the first cached
wins and the other's copy stays uncached (it is reused plainly once freed).

Each request keeps `cache_keys`: for each of its first blocks, the key of the cached block
with the same contents (its own block, the one it hit, or an equal one cached first). A block
is cached only under a parent key that is still cached, in order, block by block. Should the
parent key of a request die (an equal block of another request it relied on was evicted),
the request stops caching; a cached block whose parent died can never be hit again, and is
dropped from the index when another request caches that hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_inference.core.block_pool import BlockPool
from llm_inference.core.kv_cache_utils import block_hashes, pack_tokens
from llm_inference.core.request import Request

ROOT_KEY = 0  # the parent key of a sequence's first block


@dataclass
class CacheHit:
    """A request's longest cached prefix: whole blocks, `num_tokens` of them computed."""

    block_ids: list[int] = field(default_factory=list)
    cache_keys: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PrefixCache:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size

    def find_longest_hit(self, request: Request) -> CacheHit:
        """The cached blocks of the request's longest cached prefix, changing nothing.

        The hit stops short of the last token, which is always computed for its logits: at
        most `(num_tokens - 1) // block_size` blocks, so a full-prompt hit recomputes the last
        block's tokens (or only the last token when the prompt ends one past a block edge).
        """
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = block_hashes(request, max_blocks, bs)
        hit = CacheHit()
        parent = ROOT_KEY
        for i in range(max_blocks):
            block = self.block_pool.lookup(hashes[i])
            if block is None or block.parent_key != parent:
                break
            if block.token_ids != pack_tokens(request.get_token_ids(i * bs, (i + 1) * bs)):
                break  # a hash collision: not our prefix
            hit.block_ids.append(block.block_id)
            hit.cache_keys.append(block.cache_key)
            parent = block.cache_key
        hit.num_tokens = len(hit.block_ids) * bs
        return hit

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's blocks full within its first `num_computed_tokens` (computed)
        tokens, in order from the first not yet keyed (the module docstring says when it
        stops)."""
        bs = self.block_size
        keys = request.cache_keys
        num_full = min(num_computed_tokens // bs, len(request.block_ids))
        if len(keys) >= num_full:
            return
        hashes = block_hashes(request, num_full, bs)
        pool = self.block_pool
        for i in range(len(keys), num_full):
            parent = keys[-1] if keys else ROOT_KEY
            if not pool.is_cached_key(parent):
                return
            tokens = pack_tokens(request.get_token_ids(i * bs, (i + 1) * bs))
            block = pool.lookup(hashes[i])
            if block is not None and block.parent_key == parent and block.token_ids == tokens:
                keys.append(block.cache_key)  # the same contents are cached already
                continue
            if block is not None:
                if pool.is_cached_key(block.parent_key):
                    return  # a hash collision with a block that can still be hit
                pool.uncache(block.block_id)  # an orphan: its parent was evicted
            keys.append(pool.cache_block(request.block_ids[i], hashes[i], tokens, parent))
