"""OpenAI's presence and frequency penalties and logit bias in the engine: the exact logits
OpenAI's formula gives, a bias that forces or forbids a token, bounds refused, and a request
handed off or continued after outputs made elsewhere goes on exactly (the penalties depend on
the request's own outputs only)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import ConfigError
from engine.request import Request
from engine.sampler import apply_openai_adjustments
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from tests.conftest import make_engine

PROMPT = [5, 6, 7, 8, 9]


def test_the_adjusted_logits_are_openais_formula():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 2.0),))
    request = Request("r", [1, 2, 4, 4, 4, 1], 2, params, 10, detokenizer=None)  # type: ignore[arg-type]
    scores = torch.zeros(6)
    scores[5] = -float("inf")  # masked: stays masked
    adjusted = apply_openai_adjustments(scores, request)
    # outputs [4, 4, 4, 1]: token 4 three times, token 1 once
    expected = torch.tensor([0.0, -0.75, 0.0, 2.0, -1.25, -float("inf")])
    assert torch.equal(adjusted, expected)
    assert torch.equal(scores[:5], torch.zeros(5))  # the input is left alone


def test_a_logit_bias_forces_and_forbids_tokens(tiny_engine):
    forced = SamplingParams(max_new_tokens=6, ignore_eos=True, logit_bias=((42, 100.0),))
    assert tiny_engine.generate([PROMPT], forced)[0] == [42] * 6
    free = tiny_engine.generate([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    banned = SamplingParams(
        max_new_tokens=6, ignore_eos=True, logit_bias=tuple((t, -100.0) for t in set(free))
    )
    assert not set(tiny_engine.generate([PROMPT], banned)[0]) & set(free)


def test_a_frequency_penalty_changes_a_repetitive_greedy_run(tiny_engine):
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    free = tiny_engine.generate([PROMPT], greedy)[0]
    penalized = SamplingParams(
        max_new_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0
    )
    out = tiny_engine.generate([PROMPT], penalized)[0]
    assert out != free
    assert max(out.count(t) for t in set(out)) <= max(free.count(t) for t in set(free))


@pytest.mark.parametrize("sampled", [False, True])
def test_a_continued_penalized_request_matches_an_undisturbed_run(tiny_loaded, sampled):
    params = SamplingParams(
        max_new_tokens=16,
        ignore_eos=True,
        do_sample=sampled,
        seed=3,
        temperature=1.2,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logit_bias=((7, 3.0),),
    )
    full = make_engine(tiny_loaded).generate([PROMPT], params)[0]
    engine = make_engine(tiny_loaded)
    engine.add_request(engine.request("c", PROMPT, params, output_token_ids=full[:5]))
    rest = []
    while "c" in engine.requests:
        rest += [
            e.token_id for e in engine.step() if e.request_id == "c" and e.token_id is not None
        ]
    assert [*full[:5], *rest] == full


@pytest.mark.parametrize(
    "options, name",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))}, "logit_bias"),
    ],
)
def test_out_of_range_adjustments_are_refused_naming_them(options, name):
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**options)


def test_adjustments_survive_the_wire_dict():
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=-1.0, logit_bias=((3, 2.0), (9, -5.0))
    )
    again = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert again == params
