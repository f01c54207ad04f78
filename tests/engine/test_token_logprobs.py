"""Log probabilities (``SamplingParams.logprobs``): each output token's, with its most likely
alternatives, from the very scores the sampler drew from (after the penalties and the bias,
before temperature): equal within 1e-4 to a float64 recomputation of those scores; the same,
within 1e-4, for a request continued on another engine from its outputs so far (a migration)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import llm_engine
from engine.outputs import TokenEvent
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine

PROMPT = [5, 9, 13, 17, 21, 25, 29]


def _run(engine, request_id: str, params: SamplingParams, outputs=()) -> list[TokenEvent]:
    engine.add_request(engine.request(request_id, PROMPT, params, output_token_ids=list(outputs)))
    events = []
    while request_id in engine.requests:
        events += [e for e in engine.step() if e.request_id == request_id]
    return [e for e in events if e.token_id is not None]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, logprobs=5),
        SamplingParams(
            max_new_tokens=8,
            logprobs=3,
            do_sample=True,
            temperature=0.7,
            seed=11,
            presence_penalty=1.5,
            logit_bias=((7, 5.0),),
        ),  # fmt: skip
    ],
    ids=["greedy", "sampled-penalized"],
)
def test_logprobs_are_the_sampled_scores_log_softmax(tiny_loaded, monkeypatch, params):
    seen: list[torch.Tensor] = []
    real = llm_engine.token_logprobs

    def recording(scores, requests, chosen, native=None):
        seen.append(scores.detach().to(torch.float64).clone())
        return real(scores, requests, chosen, native)

    monkeypatch.setattr(llm_engine, "token_logprobs", recording)
    events = _run(make_engine(tiny_loaded), "r", params)
    assert len(events) == len(seen) == 8
    for event, scores in zip(events, seen, strict=True):
        exact = torch.log_softmax(scores[0], dim=-1)
        logprobs = event.logprobs
        assert logprobs is not None and len(logprobs.top) == params.logprobs
        assert logprobs.logprob == pytest.approx(float(exact[event.token_id]), abs=1e-4)
        ids = [token for token, _ in logprobs.top]
        assert ids == torch.topk(exact, params.logprobs).indices.tolist()
        for token, value in logprobs.top:
            assert value == pytest.approx(float(exact[token]), abs=1e-4)
        assert [v for _, v in logprobs.top] == sorted((v for _, v in logprobs.top), reverse=True)
        if not params.do_sample:  # greedy: the token is the best one
            assert ids[0] == event.token_id


def test_temperature_does_not_change_them(tiny_loaded):
    """OpenAI's log probabilities are those of the scores before temperature."""
    cold = SamplingParams(max_new_tokens=1, logprobs=2, do_sample=True, temperature=0.2, seed=3)
    hot = SamplingParams(max_new_tokens=1, logprobs=2, do_sample=True, temperature=1.8, seed=3)
    engine = make_engine(tiny_loaded)
    a, b = _run(engine, "cold", cold)[0].logprobs, _run(engine, "hot", hot)[0].logprobs
    assert a is not None and b is not None and a.top == b.top


def test_none_unless_asked_and_the_token_alone_at_zero(tiny_loaded):
    engine = make_engine(tiny_loaded)
    assert all(e.logprobs is None for e in _run(engine, "a", SamplingParams(max_new_tokens=3)))
    alone = _run(engine, "b", SamplingParams(max_new_tokens=3, logprobs=0))
    assert all(e.logprobs is not None and e.logprobs.top == () for e in alone)
    assert all(math.isfinite(e.logprobs.logprob) and e.logprobs.logprob <= 0 for e in alone)


def test_a_continued_request_reports_the_same_logprobs(tiny_loaded):
    """Migrated after its first token or after four (its prompt and outputs recomputed in one
    prefill elsewhere): the tokens after are the same and report what one engine running it from
    the start reported, within 1e-4 (the recomputed scores differ in their last bits)."""
    params = SamplingParams(max_new_tokens=8, logprobs=4, do_sample=True, seed=5)
    whole = _run(make_engine(tiny_loaded), "whole", params)
    tokens = [e.token_id for e in whole]
    for cut in (1, 4):
        rest = _run(make_engine(tiny_loaded), f"cut-{cut}", params, tokens[:cut])
        assert [e.token_id for e in rest] == tokens[cut:]
        for later, first in zip(rest, whole[cut:], strict=True):
            assert later.logprobs is not None and first.logprobs is not None
            assert later.logprobs.logprob == pytest.approx(first.logprobs.logprob, abs=1e-4)
            for (a, x), (b, y) in zip(later.logprobs.top, first.logprobs.top, strict=True):
                assert a == b and x == pytest.approx(y, abs=1e-4)


def test_more_than_twenty_alternatives_are_refused():
    with pytest.raises(Exception, match="logprobs must be"):
        SamplingParams(logprobs=21)
