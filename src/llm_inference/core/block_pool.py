"""A fixed pool of KV cache blocks with reference counts and a free queue.

Ownership invariants:

- Every block is in exactly one of two states: free (`ref_cnt == 0`, in the free queue once)
  or used (`ref_cnt >= 1`, not in the free queue). `num_free_blocks + num_used_blocks ==
  num_blocks` at all times.
- `allocate` hands out free blocks with `ref_cnt == 1`; `incref` adds an owner (a shared
  prefix block, later); `free` drops one owner per id and returns the block to the tail of
  the free queue when its count reaches zero. Dropping an owner a block does not have
  (double free) raises and changes nothing.
- The free queue is FIFO: `allocate` takes from the head. When prefix caching arrives, a
  freed block keeps its `block_hash` in the queue and is evicted (hash cleared) only when
  it is reallocated, so the head is the least recently freed block.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """`allocate` asked for more blocks than are free."""


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # reserved for prefix caching


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def free_block_ids(self) -> list[int]:
        """The free queue, head first (introspection and tests)."""
        return list(self._free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, each with ref_cnt 1."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_queue):
            raise NoFreeBlocksError(
                f"asked for {n} KV blocks but only {len(self._free_queue)} of "
                f"{self.num_blocks} are free"
            )
        ids = [self._free_queue.popleft() for _ in range(n)]
        for block_id in ids:
            block = self.blocks[block_id]
            block.ref_cnt = 1
            block.block_hash = None
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add an owner to used blocks (for sharing); a free block cannot be shared."""
        ids = list(block_ids)
        for block_id in ids:
            if self._block(block_id).ref_cnt < 1:
                raise ValueError(f"block {block_id} is free; allocate it instead of sharing it")
        for block_id in ids:
            self.blocks[block_id].ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner per id (an id may repeat); blocks reaching 0 join the free queue.

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
                self._free_queue.append(block_id)

    def _block(self, block_id: int) -> KVCacheBlock:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"KV block id {block_id} is outside the pool of {self.num_blocks}")
        return self.blocks[block_id]
