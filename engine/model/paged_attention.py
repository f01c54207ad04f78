"""Attention over a paged KV cache, in plain torch so that it runs on CPU and CUDA alike.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.forward_batch import ForwardBatch, PrefillSeq


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store each token's key and value at its flat slot."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for this step's tokens. Returns [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    num_decode = batch.num_decode_tokens
    if num_decode and not batch.prefill_seqs:
        return _decode_attention(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = _decode_attention(q[:num_decode], k_cache, v_cache, batch, scale)
    for seq in batch.prefill_seqs:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seq, scale)
    return out


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: [length, KVH, D]."""
    return cache[block_table].flatten(0, 1)[:length]


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one prompt chunk over its earlier context and itself."""
    n, ctx = seq.query_len, seq.context_len
    mask = None
    if ctx != n:  # a later chunk: read earlier tokens from the cache
        k = _gather_context(k_cache, seq.block_table, ctx)
        v = _gather_context(v_cache, seq.block_table, ctx)
        rows = torch.arange(n, device=q.device).unsqueeze(1) + (ctx - n)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query token per sequence. Query heads that share a KV head become the query-length
    axis of one SDPA call, so grouped-query attention needs no repeated keys."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    length = batch.decode_max_context_len
    tables = batch.decode_block_tables
    keys = k_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2)  # [B, KVH, L, D]
    values = v_cache[tables].flatten(1, 2)[:, :length].transpose(1, 2)
    mask = None
    if num_seqs > 1:
        positions = torch.arange(length, device=q.device)
        mask = (positions.unsqueeze(0) < batch.decode_context_lens.unsqueeze(1)).view(
            num_seqs, 1, 1, length
        )
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, group, head_dim), keys, values, attn_mask=mask, scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)
