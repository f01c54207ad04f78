"""The paged KV cache tensors and the block copies used by KV export and import.

Per layer, keys and values are ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. An exported
set of blocks is one contiguous tensor
``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (layout name
:data:`KV_LAYOUT`): pages, not tokens, cross the wire.
"""

from __future__ import annotations

import torch

from engine.model.llama import ModelShape

KV_LAYOUT = "layer,kv,block,slot,kv_head,head_dim"


def bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * itemsize


class KVCache:
    def __init__(
        self,
        shape: ModelShape,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        dims = (shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.data = torch.zeros(dims, device=device, dtype=dtype)
        self.layers = list(self.data.unbind(0))

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy the blocks into one contiguous CPU tensor in :data:`KV_LAYOUT`."""
        index = torch.tensor(block_ids, device=self.data.device)
        return self.data.index_select(2, index).cpu().contiguous()

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write exported blocks into our blocks ``block_ids`` (same order)."""
        index = torch.tensor(block_ids, device=self.data.device)
        # from pinned memory (KV tiers' staging) the copy to a GPU runs asynchronously, on the
        # stream the next kernel reading the cache waits on
        pinned = self.data.is_cuda and blocks.is_pinned()
        source = blocks.to(self.data.device, self.data.dtype, non_blocking=pinned)
        self.data.index_copy_(2, index, source)
