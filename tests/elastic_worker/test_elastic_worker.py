"""Elastic workers driven in-process (no Ray) on their real token channels and KV plane: a
switch away from decode hands the requests decoding there on (cause ``role_switch``), refuses
hand-offs waiting for blocks, lets a hand-off on its way land first, and frees every block; a
switch away from prefill lets the prompts admitted finish; stale epochs and the other role's
calls are refused; the engine (and its prefix cache) stays."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from coordinator.pool.token_streams import counterpart
from elastic_worker.worker import ElasticWorker
from engine.config import KVTransferConfig
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.transfer.security import generate_credentials
from tests.support.channel_reader import ChannelReader
from tests.support.inprocess_workers import _config, _request, _used
from workers.contracts import ROLE_SWITCH, HandoffResult, HandoffTarget
from workers.role_gate import DECODE, PREFILL


def _long(request_id: str, max_new_tokens: int = 400):
    request = _request(request_id)
    return replace(request, params=replace(request.params, max_new_tokens=max_new_tokens))


@pytest.fixture
def elastic(tiny_model_dir):
    transfer = KVTransferConfig("zmq", transfer_timeout_s=2.0, reservation_timeout_s=2.0)
    config = _config(tiny_model_dir, num_blocks=256)
    prefill = ElasticWorker(config, transfer, serving=PREFILL)
    decode = ElasticWorker(config, transfer, serving=DECODE, instance=1)
    reader = ChannelReader(prefill, decode)
    yield prefill, decode, reader
    reader.close()
    for worker in (prefill, decode):
        worker.close()
        worker.receiver.close()
        worker.sender.close()


def _hand_off(prefill, decode, request):
    reservation = decode.reserve(request, epoch=decode.gate.epoch)
    assert reservation.granted, reservation
    target = HandoffTarget.from_reservation(reservation, request.params.max_new_tokens)
    assert prefill.prefill(request, target, epoch=prefill.gate.epoch).accepted


def test_each_role_takes_only_its_calls(elastic):
    prefill, decode, reader = elastic
    refused = decode.prefill(_request("p"))
    assert not refused.accepted and refused.cause == ROLE_SWITCH
    assert "serves decode now" in refused.error
    reservation = prefill.reserve(_request("r"))
    assert not reservation.granted and reservation.cause == ROLE_SWITCH
    assert prefill.generate(_request("g")).cause == ROLE_SWITCH
    stale = prefill.prefill(_request("s"), epoch=4)
    assert stale.cause == ROLE_SWITCH and "stale role epoch 4" in stale.error
    _hand_off(prefill, decode, _request("ok"))
    assert isinstance(reader.items(prefill, "ok")[-1], HandoffResult)
    events = reader.items(decode, "ok")
    assert events[-1].finish_reason == FinishReason.LENGTH
    load = decode.load()
    assert load.role == "elastic" and load.serving == DECODE
    assert (load.role_state.epoch, load.role_state.switching) == (0, False)


def test_switching_away_from_decode_hands_its_requests_on(elastic):
    prefill, decode, reader = elastic
    _hand_off(prefill, decode, _long("a"))
    reader.items(prefill, "a")
    first = reader.take(decode, "a")  # it decodes there
    assert first and first[0].token_id is not None
    refusal, state = decode.switch_role(PREFILL, 0, wait_s=10)
    assert refusal == "" and (state.serving, state.epoch, state.switching) == (PREFILL, 1, False)
    last = reader.items(decode, "a")[-1]
    assert isinstance(last, TokenEvent) and last.finish_reason == FinishReason.ERROR
    assert last.cause == ROLE_SWITCH and "switched from decode to prefill" in last.error
    assert _used(decode) == 0 or decode.load().stats.num_running == 0
    assert decode.num_switch_migrations == 1
    assert decode.load().role_state.steps_in_role == 0
    # now a prefill worker: it prefills at its new epoch, the old one is stale
    assert decode.prefill(_request("b"), epoch=0).cause == ROLE_SWITCH
    assert decode.reserve(_request("c")).cause == ROLE_SWITCH
    assert "stale" in decode.switch_role(DECODE, 0)[0]


def test_switching_away_from_prefill_lets_its_prompts_finish(elastic):
    prefill, decode, reader = elastic
    _hand_off(prefill, decode, _request("a"))
    refusal, state = prefill.switch_role(DECODE, 0, wait_s=10)
    assert refusal == "" and state.serving == DECODE and state.epoch == 1
    handoff = reader.items(prefill, "a")[-1]
    assert isinstance(handoff, HandoffResult) and handoff.ok  # the prompt ended its hand-off
    assert reader.items(decode, "a")[-1].finish_reason == FinishReason.LENGTH
    assert _used(prefill) == 0 or prefill.load().stats.num_held == 0
    # the other way round now: the first worker decodes what the second prefills
    decode.switch_role(PREFILL, 0, wait_s=10)
    _hand_off(decode, prefill, _request("b"))
    assert reader.items(prefill, "b")[-1].finish_reason == FinishReason.LENGTH


def test_a_hand_off_waiting_for_blocks_is_refused_as_moved(tiny_model_dir):
    transfer = KVTransferConfig("inprocess", reservation_timeout_s=1.5)
    worker = ElasticWorker(_config(tiny_model_dir, num_blocks=4), transfer, serving=DECODE)
    reader = ChannelReader(worker)
    try:
        assert worker.reserve(_request("hog", 12)).granted  # every block, pages never sent
        answers = []
        waiting = threading.Thread(
            target=lambda: answers.append(worker.reserve(_request("late"), wait_s=5))
        )
        waiting.start()
        while not len(worker._waiting):
            threading.Event().wait(0.01)
        refusal, state = worker.switch_role(PREFILL, 0, wait_s=0)
        assert refusal == "" and state.switching
        waiting.join(5)
        assert answers and not answers[0].granted and answers[0].cause == ROLE_SWITCH
        # the reservation whose pages are "on their way" is let land until it expires
        assert worker.gate.wait_past(0, 10)
        assert _used(worker) == 0
        last = reader.items(worker, "hog")[-1]
        assert last.finish_reason == FinishReason.ERROR
    finally:
        reader.close()
        worker.close()
        worker.receiver.close()
        worker.sender.close()


def test_an_encrypted_plane_carries_hand_offs_both_ways_across_switches(tiny_model_dir):
    keys = generate_credentials()
    transfer = KVTransferConfig("zmq", encryption="on", shared_memory=False)
    shares = {"credentials": keys.receiver, "send_credentials": keys.sender}
    first = ElasticWorker(_config(tiny_model_dir), transfer, serving=PREFILL, **shares)
    second = ElasticWorker(_config(tiny_model_dir), transfer, serving=DECODE, instance=1, **shares)
    reader = ChannelReader(first, second, credentials=counterpart(keys, keys.receiver))
    try:
        _hand_off(first, second, _request("there"))
        assert reader.items(first, "there")[-1].ok
        assert reader.items(second, "there")[-1].finish_reason == FinishReason.LENGTH
        assert first.switch_role(DECODE, 0, wait_s=10)[0] == ""
        assert second.switch_role(PREFILL, 0, wait_s=10)[0] == ""
        _hand_off(second, first, _request("back"))
        assert reader.items(second, "back")[-1].ok
        assert reader.items(first, "back")[-1].finish_reason == FinishReason.LENGTH
    finally:
        reader.close()
        for worker in (first, second):
            worker.close()
            worker.receiver.close()
            worker.sender.close()
