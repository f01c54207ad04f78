"""Once a request ends on a worker, however it ends, nothing on the worker still names it: no
table of the runtime, the engine, its importer, the reservation queue or the transports (the
whole object graph is walked, so a table added later is checked too). Workers run in-process."""

from __future__ import annotations

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
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
    decode.unclaimed_grace_s = 0.5
    yield prefill, decode
    for worker in (prefill, decode):
        worker.loop.stop()
    decode.receiver.close()
    prefill.sender.close()


def _request(request_id: str, num_prompt_tokens: int = 9) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return GenerationRequest(request_id, range(5, 5 + num_prompt_tokens), params)


def _handed_off(prefill, decode, request_id: str) -> None:
    reservation = decode.reserve(_request(request_id))
    list(prefill.prefill(_request(request_id), HandoffTarget.from_reservation(reservation, 6)))


def _finished(prefill, decode, rid):
    _handed_off(prefill, decode, rid)
    list(decode.stream(rid))


def _aborted_while_decoding(prefill, decode, rid):
    _handed_off(prefill, decode, rid)
    decode.abort(rid)


def _aborted_before_the_pages(prefill, decode, rid):
    reservation = decode.reserve(_request(rid))
    decode.abort(rid)
    list(prefill.prefill(_request(rid), HandoffTarget.from_reservation(reservation, 6)))


def _pages_never_came(prefill, decode, rid):
    decode.reserve(_request(rid))
    list(decode.stream(rid))  # ends when the reservation expires


def _ended_unread(prefill, decode, rid):
    _handed_off(prefill, decode, rid)  # decoded to its end, and nobody streams it


def _handoff_to_a_dead_endpoint(prefill, decode, rid):
    list(prefill.prefill(_request(rid), HandoffTarget("tcp://127.0.0.1:9", 6)))


def _prefill_only(prefill, decode, rid):
    list(prefill.prefill(_request(rid)))  # no target: it ends on its first token


ENDINGS = [
    _finished,
    _aborted_while_decoding,
    _aborted_before_the_pages,
    _pages_never_came,
    _ended_unread,
    _handoff_to_a_dead_endpoint,
    _prefill_only,
]


@pytest.mark.parametrize("ending", ENDINGS, ids=lambda f: f.__name__.strip("_"))
def test_no_table_names_a_request_once_it_ended(pair, ending):
    prefill, decode = pair
    rid = f"req-{ending.__name__.strip('_')}"
    ending(prefill, decode, rid)

    def forgotten() -> bool:  # prefill frees its blocks just after the hand-off's result
        return not paths_naming(prefill, rid) and not paths_naming(decode, rid)

    assert wait_until(forgotten, 3.0), {
        "prefill": paths_naming(prefill, rid),
        "decode": paths_naming(decode, rid),
    }


def test_the_walk_finds_a_request_in_a_table_it_was_not_told_of(pair):
    prefill, decode = pair
    decode.reserve(_request("kept"))
    decode.some_new_table = {"x": ["kept"]}
    assert ".some_new_table['x'][0]" in paths_naming(decode, "kept")
    assert any(".requests." in path for path in paths_naming(decode, "kept"))
    decode.abort("kept")
