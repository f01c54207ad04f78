"""Sampling semantics against transformers' processors, and seeded reproducibility in batches."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from engine.errors import ConfigError
from engine.logits_processors import apply_repetition_penalty, apply_typical_p
from engine.sampler import _candidates
from engine.sampling_params import SamplingParams

# A fixed distribution: probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04.
PROBS = torch.tensor([[0.1, 0.4, 0.04, 0.25, 0.06, 0.15]])
SCORES = PROBS.log()


def _kept(scores: torch.Tensor) -> set[int]:
    return set(torch.nonzero(scores[0] > -float("inf")).flatten().tolist())


def _candidate_ids(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> set[int]:
    values, ids = _candidates(scores[0], top_k, top_p)
    assert ids is not None
    assert torch.equal(values, scores[0, ids])
    return set(ids.tolist())


@pytest.mark.parametrize("k, expected", [(1, {1}), (3, {1, 3, 5}), (100, {0, 1, 2, 3, 4, 5})])
def test_top_k(k, expected):
    assert _candidate_ids(SCORES.clone(), top_k=k) == expected
    assert _kept(TopKLogitsWarper(top_k=k)(None, SCORES.clone())) == expected


@pytest.mark.parametrize(
    "p, expected",
    [(0.3, {1}), (0.6, {1, 3}), (0.62, {1, 3}), (0.66, {1, 3, 5}), (0.999, {0, 1, 2, 3, 4, 5})],
)
def test_top_p(p, expected):
    assert _candidate_ids(SCORES.clone(), top_p=p) == expected
    assert _kept(TopPLogitsWarper(top_p=p)(None, SCORES.clone())) == expected


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "top_k, top_p", [(0, 0.5), (0, 0.9), (0, 0.999), (40, 1.0), (40, 0.8), (2000, 0.95)]
)
def test_candidates_over_a_real_vocabulary_match_transformers(seed, top_k, top_p):
    """49,152 tokens, peaked and flat distributions: the candidates (no full sort) are the tokens
    transformers' top-k then top-p warpers keep, however many that is. Float32 sums taken from
    the other end may disagree only on tokens whose mass above sits within 1e-5 of top_p (in a
    flat tail, a few tokens of ~1e-6 each)."""
    generator = torch.Generator().manual_seed(seed)
    spread = (0.5, 2.0, 6.0)[seed % 3]  # flat to peaked
    scores = torch.randn(1, 49152, generator=generator) * spread
    expected = scores.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k=top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p=top_p)(None, expected)
    ours, theirs = _candidate_ids(scores, top_k, top_p), _kept(expected)
    probs, order = torch.sort(torch.softmax(scores[0].double(), -1), descending=True)
    if top_k:
        probs, order = probs[:top_k] / probs[:top_k].sum(), order[:top_k]
    mass_above = dict(zip(order.tolist(), (torch.cumsum(probs, 0) - probs).tolist(), strict=True))
    assert len(ours ^ theirs) <= 10
    assert all(abs(mass_above[token] - top_p) < 1e-5 for token in ours ^ theirs)


def test_no_filter_draws_from_the_whole_vocabulary():
    values, ids = _candidates(SCORES[0], 0, 1.0)
    assert ids is None and torch.equal(values, SCORES[0])


# Typical sampling ranks tokens by |-log p - entropy| (entropy 1.526 nats here): 0.25, 0.15, 0.4,
# 0.1, 0.06, 0.04, with cumulative mass 0.25, 0.40, 0.80, 0.90, 0.96, 1.0, and keeps the shortest
# prefix of that ranking whose mass reaches ``mass``.
@pytest.mark.parametrize(
    "mass, expected",
    [
        (0.2, {3}),
        (0.3, {3, 5}),
        (0.5, {1, 3, 5}),
        (0.85, {0, 1, 3, 5}),
        (0.95, {0, 1, 3, 4, 5}),
    ],
)
def test_typical_p_matches_transformers(mass, expected):
    assert _kept(apply_typical_p(SCORES.clone(), mass)) == expected
    assert _kept(TypicalLogitsWarper(mass=mass)(None, SCORES.clone())) == expected


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    scores = torch.tensor([[1.5, -0.5, 0.2, -2.0, 3.0]])
    seen = torch.tensor([[0, 3, 3, 1]])
    ours = apply_repetition_penalty(scores.clone(), seen, penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty=penalty)(seen, scores.clone())
    torch.testing.assert_close(ours, ref)
    assert ours[0, 2] == scores[0, 2] and ours[0, 4] == scores[0, 4]


def _sampled(engine, prompt, params, others=()):
    prompts = [prompt, *[o[0] for o in others]]
    all_params = [params, *[o[1] for o in others]]
    return engine.generate(prompts, all_params)[0]


def test_same_seed_same_tokens_whatever_shares_the_batch(tiny_engine):
    params = SamplingParams(
        max_new_tokens=16,
        do_sample=True,
        temperature=1.5,
        top_k=50,
        top_p=0.95,
        seed=1234,
        ignore_eos=True,
    )
    alone = _sampled(tiny_engine, [5, 6, 7, 8], params)
    other = SamplingParams(max_new_tokens=9, do_sample=True, seed=99, ignore_eos=True)
    crowded = _sampled(
        tiny_engine,
        [5, 6, 7, 8],
        params,
        others=[
            ([9, 10], other),
            ([11] * 20, SamplingParams(max_new_tokens=5)),
            ([12, 13, 14], other),
        ],
    )
    assert alone == crowded
    different = _sampled(
        tiny_engine, [5, 6, 7, 8], SamplingParams(**{**params.to_dict(), "seed": 1235, "stop": ()})
    )
    assert different != alone


def test_greedy_ignores_seed(tiny_engine):
    prompt = [5, 6, 7, 8]
    a = _sampled(tiny_engine, prompt, SamplingParams(max_new_tokens=12, seed=1, ignore_eos=True))
    b = _sampled(tiny_engine, prompt, SamplingParams(max_new_tokens=12, seed=2, ignore_eos=True))
    assert a == b


def _first_repeat(prompt: list[int], output: list[int]) -> int:
    """Index of the first output token already seen in the prompt or earlier output."""
    seen = set(prompt)
    for index, token in enumerate(output):
        if token in seen:
            return index
        seen.add(token)
    raise AssertionError(f"no repeat in {output}")


def test_repetition_penalty_steers_greedy_away_from_repeats(tiny_engine):
    prompt = [100, 200, 300]  # greedy repeats itself within 12 tokens on the tiny model
    greedy = _sampled(tiny_engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    repeat_at = _first_repeat(prompt, greedy)
    penalised = _sampled(
        tiny_engine,
        prompt,
        SamplingParams(max_new_tokens=12, repetition_penalty=50.0, ignore_eos=True),
    )
    # The penalty only lowers seen tokens: greedy's choices stand until its first repeat, where
    # the penalty picks another token; a penalty of 50 forbids every repeat after that.
    assert penalised[:repeat_at] == greedy[:repeat_at]
    assert penalised[repeat_at] != greedy[repeat_at]
    assert len(set(penalised)) == len(penalised) and not set(penalised) & set(prompt)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("typical_p", 0.0),
        ("repetition_penalty", 0.0),
        ("seed", 2**64),
    ],
)
def test_invalid_params_are_rejected_with_the_name(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_draws_follow_the_distribution_and_never_take_a_removed_token():
    """20,000 seeded draws (one per output position) over PROBS with one token removed: each
    token's frequency within 0.015 of its renormalized probability; the removed one never."""
    from types import SimpleNamespace

    from engine.sampler import _draw

    scores = SCORES[0].clone()
    scores[2] = -float("inf")  # p = 0.04, removed
    request = SimpleNamespace(params=SamplingParams(do_sample=True, seed=5), num_output_tokens=0)
    request.generator = torch.Generator()
    counts = torch.zeros(6)
    draws = 20_000
    for position in range(draws):
        request.num_output_tokens = position
        counts[_draw(scores, None, request)] += 1
    expected = PROBS[0].clone()
    expected[2] = 0.0
    expected /= expected.sum()
    assert counts[2] == 0
    assert torch.allclose(counts / draws, expected, atol=0.015)
