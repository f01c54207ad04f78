"""Turns a step's logits into one token per sampling request.

A row's OpenAI adjustments (presence and frequency penalties over its outputs so far, its logit
bias) come first; they depend on the request's own tokens only.

Greedy rows are one batched argmax. Sampled rows draw from their request's own
``torch.Generator``, re-seeded for every token from ``SamplingParams.seed`` and the token's
position in the output (:func:`position_seed`). So a request's tokens depend only on its seed,
prompt and parameters, never on what else shares the batch, nor on which engine draws them: a
request handed from prefill to decode, or migrated to another worker pair with its tokens so far,
draws its next token exactly as one engine running it from the start would.

A constrained row (``Request.grammar``) first has every token its grammar does not allow next
set to -inf (``GrammarCache.apply_masks``): its matcher replays the outputs it has not consumed
yet, so a request that arrived with outputs made elsewhere is masked from where it stands. The
engine starts the masks (:func:`start_masks`) before the model's forward, which they overlap.
Unconstrained rows are untouched, so a batch mixing both samples them exactly as a batch without
constraints.

A request asking for log probabilities (``SamplingParams.logprobs``) gets them from the scores
the draw used, after the mask, the penalties and the bias and before temperature (as OpenAI
defines them): :func:`token_logprobs`, one pass over the rows that ask.

No row sorts the whole vocabulary unless typical sampling asks for it: top-k takes the k best
scores; top-p alone takes the best few (growing ×4 from ``NUCLEUS_START``) until they hold the
nucleus' mass, which they then must contain; the draw is over those candidates only. The kept sets
equal transformers' ``TopKLogitsWarper`` then ``TopPLogitsWarper`` (``min_tokens_to_keep=1``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.grammars import GrammarCache, PendingMasks
from engine.logits_processors import apply_repetition_penalty, apply_typical_p
from engine.outputs import TokenLogprobs
from engine.request import Request

_MASK64 = 2**64 - 1
NUCLEUS_START = 64  # candidates first tried for top-p alone


def position_seed(seed: int, position: int) -> int:
    """The seed of output token ``position`` (0-based) of a request seeded ``seed``: splitmix64
    of ``seed + (position + 1) * golden ratio``, so neighbouring positions are unrelated."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample(
    logits: torch.Tensor,
    requests: list[Request],
    grammars: GrammarCache | None = None,
    masks: PendingMasks | None = None,
) -> list[int]:
    """``logits[i]`` belongs to ``requests[i]``; returns the chosen token ids. ``grammars``
    masks the constrained rows (needed when any request has a constraint): ``masks``, started
    by :func:`start_masks` before the logits were computed, else computed now."""
    if grammars is not None:
        masks = masks or start_masks(requests, grammars)
        if masks is not None:
            grammars.apply_masks(logits, masks)
    for row, request in enumerate(requests):
        if request.params.penalizes:
            logits[row] = apply_openai_adjustments(logits[row], request)
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


def token_logprobs(
    scores: torch.Tensor, requests: list[Request], chosen: list[int], native: Any = None
) -> list[TokenLogprobs | None]:
    """The log probabilities of ``chosen[i]`` in row ``i`` of ``scores`` (the logits as
    :func:`sample` left them) with the row's request's most likely alternatives, for the requests
    that ask (None for the others): each row's chosen score and its best scores, less the row's
    log-sum-exp. ``native`` (the CPU kernels' module, engine/kernels/token_logprobs.h) takes the
    rows in one pass each; torch takes a log-sum-exp, a gather and a top-k over them."""
    found: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [row for row, request in enumerate(requests) if request.params.logprobs >= 0]
    if not rows:
        return found
    asked = (scores if len(rows) == len(requests) else scores[rows]).float()
    wanted = min(max(requests[row].params.logprobs for row in rows), asked.shape[-1])
    picked = torch.tensor([chosen[row] for row in rows], device=asked.device)
    if native is not None and asked.device.type == "cpu":
        logprobs, values, ids = native.token_logprobs(asked.contiguous(), picked, wanted)
        top_values, top_ids = values.tolist(), ids.tolist()
        logprobs = logprobs.tolist()
    else:
        total = torch.logsumexp(asked, dim=-1, keepdim=True)
        logprobs = (asked.gather(1, picked.unsqueeze(1)) - total).squeeze(1).tolist()
        top_ids, top_values = [[] for _ in rows], [[] for _ in rows]
        if wanted:
            values, ids = torch.topk(asked, wanted, dim=-1)
            top_values, top_ids = (values - total).tolist(), ids.tolist()
    for index, row in enumerate(rows):
        count = requests[row].params.logprobs
        top = tuple(zip(top_ids[index][:count], top_values[index][:count], strict=True))
        found[row] = TokenLogprobs(logprobs[index], top)
    return found


def start_masks(requests: list[Request], grammars: GrammarCache) -> PendingMasks | None:
    """Start computing the masks of the constrained ``requests`` (the rows of the logits to
    come), each having consumed its outputs so far (None: no row to mask). A request whose
    outputs its grammar refuses is not masked: its next token fails it."""
    rows, states = [], []
    for row, request in enumerate(requests):
        state = request.grammar
        if state is not None and state.catch_up(request.output_token_ids):
            rows.append(row)
            states.append(state)
    return grammars.start_masks(rows, states) if rows else None


def apply_openai_adjustments(scores: torch.Tensor, request: Request) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the request's outputs so far, and its
    logit bias, on one row of logits (a masked token stays at -inf)."""
    params = request.params
    scores = scores.clone()
    outputs = request.output_token_ids
    if outputs and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(outputs, device=scores.device)
        counts = torch.bincount(ids, minlength=scores.shape[-1])[: scores.shape[-1]].to(
            scores.dtype
        )
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token_id, bias in params.logit_bias:
        if token_id < scores.shape[-1]:
            scores[token_id] += bias
    return scores


def _sample_row(scores: torch.Tensor, request: Request) -> int:
    params = request.params
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.typical_p < 1.0:  # ranks by distance from the entropy: needs every token
        return _draw(apply_typical_p(_filtered(scores, params), params.typical_p), None, request)
    values, candidates = _candidates(scores[0], params.top_k, params.top_p)
    return _draw(values, candidates, request)


def _filtered(scores: torch.Tensor, params) -> torch.Tensor:
    """``scores`` with every token outside the top-k / top-p candidates at -inf."""
    if not params.top_k and params.top_p >= 1.0:
        return scores
    values, candidates = _candidates(scores[0], params.top_k, params.top_p)
    kept = torch.full_like(scores, -float("inf"))
    kept[0, candidates] = values
    return kept


def _candidates(
    scores: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores and token ids a draw chooses among (ids None: the whole vocabulary)."""
    vocab = scores.shape[-1]
    if top_k:
        values, ids = torch.topk(scores, min(top_k, vocab))  # best first
        probs = torch.softmax(values, dim=-1)  # top-p then applies to the top-k distribution
    elif top_p < 1.0:
        full = torch.softmax(scores, dim=-1)
        size = min(NUCLEUS_START, vocab)
        probs, ids = torch.topk(full, size)
        while float(probs.sum()) < top_p and size < vocab:
            size = min(size * 4, vocab)
            probs, ids = torch.topk(full, size)
        values = scores[ids]
    else:
        return scores, None
    if top_p < 1.0:
        # keep a token when the mass strictly above it is below top_p (the best always stays)
        keep = int(((torch.cumsum(probs, dim=-1) - probs) < top_p).sum())
        values, ids = values[: max(keep, 1)], ids[: max(keep, 1)]
    return values, ids


def _draw(values: torch.Tensor, ids: torch.Tensor | None, request: Request) -> int:
    """Inverse-CDF draw: one uniform number from the request's generator against the
    cumulative probabilities (``torch.multinomial`` costs ~20x more over a whole vocabulary)."""
    cumulative = torch.cumsum(torch.softmax(values.reshape(-1), dim=-1), dim=0)
    request.generator.manual_seed(position_seed(request.params.seed, request.num_output_tokens))
    point = torch.rand(1, generator=request.generator) * cumulative[-1]
    pick = min(int(torch.searchsorted(cumulative, point, right=True)), cumulative.numel() - 1)
    return pick if ids is None else int(ids[pick])
