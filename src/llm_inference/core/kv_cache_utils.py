"""Block hashes for prefix caching: a stable, chained hash of each full block of tokens.

Block i of a sequence (token positions `[i * block_size, (i + 1) * block_size)`) is
identified by

    hash_i = sha256(hash_{i-1} || token ids of block i as little-endian int64)

with `hash_{-1} = ROOT_BLOCK_HASH`, so a block hash stands for the whole token prefix up to
the end of its block, not only its own tokens. The hash is stable across processes and runs
(never Python's salted `hash`). Only full blocks are hashed: a partial block has no hash.

Hashes only find candidates; the prefix cache confirms a hit against the stored (packed) token
ids and parent of the cached block (see core/prefix_cache.py), so a collision never gives a
false hit.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from llm_inference.core.request import Request

BlockHash = bytes

ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"llm_inference prefix cache root").digest()


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """A block's token ids as little-endian int64: what its hash covers, and what the prefix
    cache keeps to confirm a hit (bytes: compact, and never walked by the cyclic GC)."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block chained to its parent's hash (ROOT_BLOCK_HASH for block 0)."""
    return hashlib.sha256(parent_hash + pack_tokens(token_ids)).digest()


def block_hashes(request: Request, num_blocks: int, block_size: int) -> list[BlockHash]:
    """`request.block_hashes`, extended to hold at least its first `num_blocks` full blocks.

    `request.block_hashes` caches them (a request's tokens are append-only, so a hash once
    computed never changes, also across preemption). `num_blocks` must not exceed the number
    of full blocks of its known tokens.
    """
    hashes = request.block_hashes
    if num_blocks > request.num_tokens // block_size:
        raise ValueError(
            f"request {request.request_id!r} has {request.num_tokens} tokens: fewer than "
            f"{num_blocks} full blocks of {block_size}"
        )
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        hashes.append(
            hash_block_tokens(parent, request.get_token_ids(i * block_size, (i + 1) * block_size))
        )
    return hashes
