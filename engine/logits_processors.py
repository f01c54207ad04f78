"""Logits processors with the semantics of transformers' (``min_tokens_to_keep=1``).

Each takes ``scores`` of shape ``[rows, vocab]`` and returns filtered scores (-inf where removed).
"""

from __future__ import annotations

import torch

_FILTERED = -float("inf")


def apply_repetition_penalty(
    scores: torch.Tensor, token_ids: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Scores of tokens already in ``token_ids`` shrink (penalty > 1) or grow (< 1)."""
    seen = scores.gather(-1, token_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(-1, token_ids, seen)


def apply_typical_p(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy."""
    normalized = torch.log_softmax(scores, dim=-1)
    entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
    shifted = torch.abs(-normalized - entropy)
    sorted_shifted, sorted_indices = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1).clamp(max=scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(-1, last.view(-1, 1))
    remove[..., :1] = False
    return scores.masked_fill(remove.scatter(-1, sorted_indices, remove), _FILTERED)
