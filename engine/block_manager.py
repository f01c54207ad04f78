"""Owns the KV cache's block ids: a free list, with double-free detection."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        self._used.update(block_ids)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Return the blocks to the free list and empty ``block_ids`` (the owner's list)."""
        for block_id in block_ids:
            if block_id not in self._used:
                raise RuntimeError(f"block {block_id} freed twice or never allocated")
            self._used.remove(block_id)
            self._free.append(block_id)
        block_ids.clear()
