"""The contract between the model runner and the forward pass: one flattened step of tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class PrefillSeq:
    """A sequence whose step carries more than one token (a prompt or a prompt chunk)."""

    query_start: int  # offset of its first token in the flattened batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens in its KV after this step (earlier chunks + this one)
    block_table: torch.Tensor  # block ids covering context_len tokens


@dataclass
class ForwardBatch:
    """Tokens of one engine step, decode tokens first, then prefill sequences back to back.

    There is no padding in the flattened token dimension: prompts of different lengths are
    concatenated, and only the decode attention gathers a padded (per-block) context.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slot (block_id * block_size + offset) of each token
    num_decode_tokens: int  # the first tokens, one per decoding sequence
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks], padded with 0
    decode_context_lens: torch.Tensor  # [num_decode_tokens]
    decode_max_context_len: int
    prefill_seqs: list[PrefillSeq]
    logits_indices: torch.Tensor  # [S] token rows whose logits are sampled

    def prompt_chunks(self) -> ForwardBatch:
        """The step without its decode rows: its prompt chunks, their rows from 0."""
        skip = self.num_decode_tokens
        chunks = [replace(seq, query_start=seq.query_start - skip) for seq in self.prefill_seqs]
        return replace(
            self,
            input_ids=self.input_ids[skip:],
            positions=self.positions[skip:],
            slot_mapping=self.slot_mapping[skip:],
            num_decode_tokens=0,
            decode_block_tables=self.decode_block_tables[:0],
            decode_context_lens=self.decode_context_lens[:0],
            decode_max_context_len=0,
            prefill_seqs=chunks,
            logits_indices=self.logits_indices[:0],
        )
