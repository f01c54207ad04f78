"""The native CPU decode kernel against the plain torch path, on random paged caches."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.model.forward_batch import ForwardBatch
from engine.model.paged_attention import _decode_attention, _native_decode


def _batch(context_lens: list[int], block_size: int, num_blocks: int) -> ForwardBatch:
    gen = torch.Generator().manual_seed(3)
    max_blocks = max(-(-n // block_size) for n in context_lens)
    tables = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks]
    return ForwardBatch(
        input_ids=torch.zeros(len(context_lens), dtype=torch.long),
        positions=torch.zeros(len(context_lens), dtype=torch.long),
        slot_mapping=torch.zeros(len(context_lens), dtype=torch.long),
        num_decode_tokens=len(context_lens),
        decode_block_tables=tables.view(len(context_lens), max_blocks),
        decode_context_lens=torch.tensor(context_lens),
        decode_max_context_len=max(context_lens),
        prefill_seqs=[],
        logits_indices=torch.arange(len(context_lens)),
    )


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 12)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_native_decode_matches_torch(heads, kv_heads, head_dim, block_size):
    native = cpu_kernels()
    if native is None:
        pytest.skip("no C++ compiler: the torch path is the one in use")
    context_lens = [1, 5, 17, 40, 3]
    batch = _batch(context_lens, block_size, num_blocks=256)
    cache = torch.randn(2, 256, block_size, kv_heads, head_dim)
    q = torch.randn(len(context_lens), heads, head_dim)
    expected = _decode_attention(q, cache, batch, head_dim**-0.5)
    got = _native_decode(native, q, cache, batch, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
