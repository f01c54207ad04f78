"""Turns a step's logits into one token per sampling request.

Greedy rows are one batched argmax. Sampled rows draw from their request's own
``torch.Generator``, re-seeded for every token from ``SamplingParams.seed`` and the token's
position in the output (:func:`position_seed`). So a request's tokens depend only on its seed,
prompt and parameters, never on what else shares the batch, nor on which engine draws them: a
request handed from prefill to decode, or migrated to another worker pair with its tokens so far,
draws its next token exactly as one engine running it from the start would.
"""

from __future__ import annotations

import torch

from engine.logits_processors import (
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)
from engine.request import Request

_MASK64 = 2**64 - 1


def make_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)


def position_seed(seed: int, position: int) -> int:
    """The seed of output token ``position`` (0-based) of a request seeded ``seed``: splitmix64
    of ``seed + (position + 1) * golden ratio``, so neighbouring positions are unrelated."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """``logits[i]`` belongs to ``requests[i]``; returns the chosen token ids."""
    for row, request in enumerate(requests):
        if request.params.repetition_penalty != 1.0:
            ids = torch.tensor(request.token_ids, device=logits.device).unsqueeze(0)
            logits[row : row + 1] = apply_repetition_penalty(
                logits[row : row + 1], ids, request.params.repetition_penalty
            )
    chosen = logits.argmax(dim=-1).tolist()
    for row, request in enumerate(requests):
        if request.params.do_sample:
            chosen[row] = _sample_row(logits[row : row + 1], request)
    return chosen


def _sample_row(scores: torch.Tensor, request: Request) -> int:
    params = request.params
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        scores = apply_top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = apply_top_p(scores, params.top_p)
    if params.typical_p < 1.0:
        scores = apply_typical_p(scores, params.typical_p)
    probs = torch.softmax(scores, dim=-1)
    request.generator.manual_seed(position_seed(params.seed, request.num_output_tokens))
    return int(torch.multinomial(probs, 1, generator=request.generator).item())
