"""Attention over a paged KV cache, in plain torch so that it runs on CPU and CUDA alike.

Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys, values),
in the cache's own dtype (``kv_cache_dtype``): keys and values are rounded to it as they are
written and read back in the queries' dtype; a prompt attends to its own keys and values rounded
too, so a prompt computed anew (a migration, a later chunk) sees what decode saw.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.model.forward_batch import ForwardBatch, PrefillSeq


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    native: ModuleType | None = None,
) -> torch.Tensor:
    """q: ``[T, H, D]``; kv: ``[2, T, KVH, D]`` for this step's tokens. Returns ``[T, H, D]``.

    ``native`` is the compiled CPU kernel module; decode attention then reads the cache in place.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    stored = kv.to(kv_cache.dtype)
    kv_cache.view(2, -1, num_kv_heads, head_dim).index_copy_(1, batch.slot_mapping, stored)
    if stored.dtype != kv.dtype:  # prompts attend to the rounded keys and values, as decode does
        kv = stored.to(kv.dtype)
    num_decode = batch.num_decode_tokens
    decode = _decode_attention if native is None else functools.partial(_native_decode, native)
    if num_decode and not batch.prefill_seqs:
        return decode(q, kv_cache, batch, scale)
    out = q.new_empty(q.shape)
    if num_decode:
        out[:num_decode] = decode(q[:num_decode], kv_cache, batch, scale)
    for seq in batch.prefill_seqs:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = _prefill_attention(q[rows], kv[:, rows], kv_cache, seq, scale)
    return out


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Keys and values of the blocks in ``block_table`` (any shape): ``[2, *table, bs, KVH, D]``."""
    gathered = kv_cache.index_select(1, block_table.flatten())
    return gathered.view(2, *block_table.shape, *kv_cache.shape[2:])


def _prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    """Causal attention of one prompt chunk over its earlier context and itself."""
    n, ctx = seq.query_len, seq.context_len
    mask = None
    if ctx != n:  # a later chunk: read earlier tokens from the cache
        kv = _gather(kv_cache, seq.block_table).flatten(1, 2)[:, :ctx].to(q.dtype)
        rows = torch.arange(n, device=q.device).unsqueeze(1) + (ctx - n)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
    keys, values = kv.transpose(1, 2)  # [KVH, ctx, D] each
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query token per sequence. Query heads that share a KV head become the query-length
    axis of one SDPA call, so grouped-query attention needs no repeated keys."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    length = batch.decode_max_context_len
    pages = _gather(kv_cache, batch.decode_block_tables).flatten(2, 3)[:, :, :length]
    keys, values = pages.to(q.dtype).transpose(2, 3)
    mask = None
    if num_seqs > 1:
        positions = torch.arange(length, device=q.device)
        mask = (positions.unsqueeze(0) < batch.decode_context_lens.unsqueeze(1)).view(
            num_seqs, 1, 1, length
        )
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys,
        values,
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def _native_decode(
    native: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    return native.paged_decode_attention(
        q, kv_cache, batch.decode_block_tables, batch.decode_context_lens, scale
    )
