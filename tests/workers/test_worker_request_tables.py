"""Once a request ends on a worker, however it ends, nothing on the worker still names it: no
table of the runtime, the engine, its importer, the reservation queue, the token channel or the
transports (the whole object graph is walked, so a table added later is checked too). Workers
run in-process, their events read (or left unread) on their real token channels."""

from __future__ import annotations

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.support.channel_reader import OWNER, ChannelReader
from tests.support.inprocess_workers import _stop
from tests.support.object_walk import paths_naming
from tests.support.worker_streams import wait_until
from workers.contracts import GenerationRequest, HandoffTarget


@pytest.fixture
def pair(tiny_model_dir):
    config = EngineConfig(
        model_path=str(tiny_model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=64)
    )
    transfer = KVTransferConfig("zmq", transfer_timeout_s=1.0, reservation_timeout_s=1.0)
    prefill, decode = PrefillWorker(config, transfer), DecodeWorker(config, transfer)
    reader = ChannelReader(prefill, decode)
    yield prefill, decode, reader
    reader.close()
    _stop(prefill, decode)


def _request(request_id: str, num_prompt_tokens: int = 9) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return GenerationRequest(request_id, range(5, 5 + num_prompt_tokens), params, owner=OWNER)


def _prefilled(prefill, reader, rid, target=None) -> None:
    """Prefill ``rid`` (handing it off to ``target``) and read it to its end there."""
    assert prefill.prefill(_request(rid), target).accepted
    reader.items(prefill, rid)


def _handed_off(prefill, decode, reader, request_id: str) -> None:
    reservation = decode.reserve(_request(request_id))
    _prefilled(prefill, reader, request_id, HandoffTarget.from_reservation(reservation, 6))


def _finished(prefill, decode, reader, rid):
    _handed_off(prefill, decode, reader, rid)
    reader.items(decode, rid)


def _aborted_while_decoding(prefill, decode, reader, rid):
    _handed_off(prefill, decode, reader, rid)
    decode.abort(rid)


def _aborted_before_the_pages(prefill, decode, reader, rid):
    reservation = decode.reserve(_request(rid))
    decode.abort(rid)
    _prefilled(prefill, reader, rid, HandoffTarget.from_reservation(reservation, 6))


def _pages_never_came(prefill, decode, reader, rid):
    decode.reserve(_request(rid))
    reader.items(decode, rid)  # ends when the reservation expires


def _ended_unread(prefill, decode, reader, rid):
    _handed_off(prefill, decode, reader, rid)  # decoded to its end, and nobody reads it


def _coordinator_gone(prefill, decode, reader, rid):
    reservation = decode.reserve(_request(rid))
    reader.detach(decode)  # its events cannot go: the worker aborts it
    _prefilled(prefill, reader, rid, HandoffTarget.from_reservation(reservation, 6))
    assert wait_until(lambda: rid not in decode.requests, 10)
    # the channel names it until a message to its coordinator gets through: it comes back
    reader.attach(decode)
    assert decode.generate(_request("next-one")).accepted
    reader.items(decode, "next-one")
    assert rid in reader.lost(decode)


def _handoff_to_a_dead_endpoint(prefill, decode, reader, rid):
    _prefilled(prefill, reader, rid, HandoffTarget("tcp://127.0.0.1:9", 6))


def _prefill_only(prefill, decode, reader, rid):
    _prefilled(prefill, reader, rid)  # no target: it ends on its first token


def _refused_as_a_duplicate(prefill, decode, reader, rid):
    assert decode.reserve(_request(rid)).granted
    assert not decode.reserve(_request(rid)).granted
    assert not decode.generate(_request(rid)).accepted
    decode.abort(rid)


ENDINGS = [
    _finished,
    _aborted_while_decoding,
    _aborted_before_the_pages,
    _pages_never_came,
    _ended_unread,
    _coordinator_gone,
    _handoff_to_a_dead_endpoint,
    _prefill_only,
    _refused_as_a_duplicate,
]


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__.strip("_"))
def test_no_table_names_a_request_once_it_ended(pair, ending):
    prefill, decode, reader = pair
    rid = f"req-{ending.__name__.strip('_')}"
    ending(prefill, decode, reader, rid)

    def forgotten() -> bool:  # prefill frees its blocks just after the hand-off's result
        return not paths_naming(prefill, rid) and not paths_naming(decode, rid)

    assert wait_until(forgotten, 10.0), {
        "prefill": paths_naming(prefill, rid),
        "decode": paths_naming(decode, rid),
    }


def test_the_walk_finds_a_request_in_a_table_it_was_not_told_of(pair):
    prefill, decode, _ = pair
    decode.reserve(_request("kept"))
    decode.some_new_table = {"x": ["kept"]}
    assert ".some_new_table['x'][0]" in paths_naming(decode, "kept")
    assert any(".requests." in path for path in paths_naming(decode, "kept"))
    decode.abort("kept")
