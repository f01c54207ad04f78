"""White-box looks at a :class:`~engine.block_manager.BlockManager`'s bookkeeping."""

from __future__ import annotations

from engine.block_manager import BlockManager


def check_consistent(blocks: BlockManager) -> None:
    """Raise AssertionError unless the free lists, counts and cache agree."""
    empty, evictable = set(blocks._empty), set(blocks._evictable) | set(blocks._kept)
    assert not set(blocks._evictable) & set(blocks._kept), "a block is kept and evictable"
    assert len(empty) == len(blocks._empty), "a block is twice on the empty list"
    assert not empty & evictable, "a block is both empty and cached"
    for block_id, refs in enumerate(blocks._refs):
        free = block_id in empty or block_id in evictable
        assert refs >= 0 and free == (refs == 0), f"block {block_id}: {refs} users, free={free}"
        assert (block_id in evictable) <= (block_id in blocks._hash_of), block_id
        assert (block_id in empty) <= (block_id not in blocks._hash_of), block_id
    assert {e.block_id: h for h, e in blocks._cached.items()} == blocks._hash_of


def ref_count(blocks: BlockManager, block_id: int) -> int:
    """How many requests hold ``block_id``."""
    return blocks._refs[block_id]


def num_used(blocks: BlockManager) -> int:
    """Blocks some request holds (neither empty nor cached and free)."""
    return blocks.num_blocks - blocks.num_free_blocks
