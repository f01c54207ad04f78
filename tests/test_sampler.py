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
from engine.logits_processors import (
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)
from engine.sampling_params import SamplingParams

# A fixed distribution: probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04.
PROBS = torch.tensor([[0.1, 0.4, 0.04, 0.25, 0.06, 0.15]])
SCORES = PROBS.log()


def _kept(scores: torch.Tensor) -> set[int]:
    return set(torch.nonzero(scores[0] > -float("inf")).flatten().tolist())


@pytest.mark.parametrize("k, expected", [(1, {1}), (3, {1, 3, 5}), (100, {0, 1, 2, 3, 4, 5})])
def test_top_k(k, expected):
    assert _kept(apply_top_k(SCORES.clone(), k)) == expected
    assert _kept(TopKLogitsWarper(top_k=k)(None, SCORES.clone())) == expected


@pytest.mark.parametrize(
    "p, expected",
    [(0.3, {1}), (0.6, {1, 3}), (0.62, {1, 3}), (0.66, {1, 3, 5}), (0.999, {0, 1, 2, 3, 4, 5})],
)
def test_top_p(p, expected):
    assert _kept(apply_top_p(SCORES.clone(), p)) == expected
    assert _kept(TopPLogitsWarper(top_p=p)(None, SCORES.clone())) == expected


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
