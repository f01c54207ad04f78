"""The engine's entry contract: one frozen ``NewRequest`` with its output limit, made into the
engine's ``Request`` whole (nothing patched afterwards), the limit worked out in one function."""

from __future__ import annotations

import dataclasses

import pytest

from engine.request import NewRequest, RequestStatus
from engine.sampling_params import SamplingParams
from engine.token_accounting import output_limit
from tests.support.block_checks import num_used


def test_the_output_limit_colocated_and_disaggregated():
    assert output_limit(10, 512) == 10 and output_limit(10, 512, disaggregated=True) == 10
    assert output_limit(600, 512) == 512  # capped at maxIterTimes
    assert output_limit(600, 512, disaggregated=True) == 513  # the first token, then 512


def test_a_new_request_is_frozen_and_holds_tuples():
    new = NewRequest("r", [1, 2], SamplingParams(), 4, output_token_ids=[3])
    assert new.prompt_token_ids == (1, 2) and new.output_token_ids == (3,)
    assert new.token_ids == [1, 2, 3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.max_output_tokens = 9  # type: ignore[misc]


def test_the_engines_request_is_made_whole_from_it(tiny_engine):
    params = SamplingParams(max_new_tokens=600)
    new = tiny_engine.request("r", [5, 6, 7], params, priority=2, tenant="t", arrival_time=1.5)
    assert new.max_output_tokens == tiny_engine.config.scheduler.max_iter_times
    tiny_engine.add_request(new)
    request = tiny_engine.requests["r"]
    assert (request.priority, request.tenant, request.arrival_time) == (2, "t", 1.5)
    assert request.max_output_tokens == new.max_output_tokens and not request.prefill_only
    tiny_engine.abort("r")
    held = tiny_engine.request("h", [5, 6, 7], params, prefill_only=True, output_token_ids=[8])
    tiny_engine.add_request(held)  # a prefill-only request stops at its next token
    assert tiny_engine.requests["h"].max_output_tokens == 2
    tiny_engine.abort("h")


def test_a_reservation_is_made_whole_with_its_state(tiny_engine):
    new = tiny_engine.request("d", [5] * 9, SamplingParams(max_new_tokens=4), disaggregated=True)
    reserved = tiny_engine.importer.reserve_import(new, timeout_s=3.0, token="secret")
    assert reserved.status == RequestStatus.RESERVED and reserved.reservation_token == "secret"
    assert reserved.deadline == new.arrival_time + 3.0 and reserved.max_output_tokens == 4
    assert tiny_engine.abort("d")
    tiny_engine.step()
    assert num_used(tiny_engine.blocks) == 0
