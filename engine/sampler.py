"""Turns a step's logits into one token per sampling request.

Greedy rows are one batched argmax. Sampled rows draw from their request's own
``torch.Generator`` (seeded from ``SamplingParams.seed``), so a request's tokens depend only on
its seed, prompt and parameters, never on what else shares the batch.
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


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


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
    return int(torch.multinomial(probs, 1, generator=request.generator).item())
