"""A step's grammar bitmasks applied to its logits (``engine.grammars.GrammarCache.apply_masks``):
a row allowing few tokens keeps just those, a row allowing many adds 0 / -inf biases looked up a
byte of the bitmask at a time."""

from __future__ import annotations

import numpy as np
import torch

FEW_WORDS = 1 / 8  # a row with at most this share of non-zero bitmask words keeps its tokens
BYTE_BIASES = torch.tensor(  # bitmask byte -> the biases of its 8 tokens: 0 allowed, -inf not
    [[0.0 if byte >> bit & 1 else -float("inf") for bit in range(8)] for byte in range(256)]
)


def keep_few(logits: torch.Tensor, row: int, words: np.ndarray) -> bool:
    """Row ``row`` keeps only the tokens ``words`` allows, when they are few; False: too many."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) > len(words) * FEW_WORDS:
        return False
    bits = np.unpackbits(words[nonzero].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    word_index, bit = np.nonzero(bits)
    ids = nonzero[word_index] * 32 + bit
    allowed = torch.from_numpy(ids[ids < logits.shape[-1]]).to(logits.device)
    line = logits[row]
    kept = line[allowed]
    line.fill_(-float("inf"))
    line[allowed] = kept
    return True


def add_biases(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Add each row's 0 / -inf biases, read off its bitmask bytes."""
    vocab = logits.shape[-1]
    table = BYTE_BIASES.to(logits.device)
    biases = table[bitmask.view(torch.uint8).to(torch.int32).to(logits.device)]
    biases = biases.view(len(rows), -1)
    if biases.shape[1] < vocab:  # logits wider than the vocabulary: the rest is refused
        pad = torch.full((len(rows), vocab - biases.shape[1]), -float("inf"), device=logits.device)
        biases = torch.cat([biases, pad], dim=1)
    index = torch.tensor(rows, device=logits.device)
    logits.index_add_(0, index, biases[:, :vocab])
