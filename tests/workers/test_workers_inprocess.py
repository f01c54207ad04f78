"""Worker classes driven in-process (no Ray), their events read on their real token channels:
hand-off over the real transports, and the failure paths that must free blocks on both sides; a
request of a coordinator not attached to a worker's channel is not taken, nor is a request id
already in use."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import KVTransferConfig, SchedulerConfig
from engine.constraint import Constraint
from engine.outputs import CONSTRAINT_VIOLATED, EngineStats, TokenEvent
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.support.channel_reader import ChannelReader
from tests.support.inprocess_workers import (
    HANDOFFS,
    _assert_freed,
    _config,
    _decode_worker,
    _request,
    _stop,
    _used,
)
from workers.colocated import ColocatedWorker
from workers.contracts import HandoffResult, HandoffTarget, Reservation, Submitted, WorkerIdentity


@pytest.fixture(params=list(HANDOFFS))
def handoff(request) -> str:
    return request.param


@pytest.fixture
def pair(handoff, tiny_model_dir):
    (transport, shared_memory), _ = HANDOFFS[handoff]
    transfer = KVTransferConfig(
        transport, transfer_timeout_s=1.0, reservation_timeout_s=1.0, shared_memory=shared_memory
    )
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    reader = ChannelReader(prefill, decode)
    yield prefill, decode, reader
    reader.close()
    _stop(prefill, decode)


def test_handoff_then_decode(pair, handoff):
    prefill, decode, reader = pair
    reservation = decode.reserve(_request("r"))
    assert reservation.granted
    target = HandoffTarget.from_reservation(reservation, 6)
    assert prefill.prefill(_request("r"), target) == Submitted(
        True, channel=prefill.channel.endpoint
    )
    items = reader.items(prefill, "r")
    assert isinstance(items[0], TokenEvent) and items[0].token_id is not None
    assert isinstance(items[-1], HandoffResult) and items[-1].ok and items[-1].num_bytes > 0
    assert prefill.num_handoffs_by_path() == {HANDOFFS[handoff][1]: 1}
    events = reader.items(decode, "r")
    assert len(events) == 5 and events[-1].finish_reason == FinishReason.LENGTH
    _assert_freed(prefill)
    assert _used(decode) == 0


def test_transfer_to_a_dead_endpoint_frees_the_prefill_blocks(pair, handoff):
    prefill, _, reader = pair
    dead = {"zmq": "tcp://127.0.0.1:9", "grpc": "127.0.0.1:9", "inprocess": "inprocess://gone"}
    endpoint = dead[HANDOFFS[handoff][0][0]]
    start = time.monotonic()
    assert prefill.prefill(_request("r"), HandoffTarget(endpoint, 6)).accepted
    items = reader.items(prefill, "r")
    assert isinstance(items[-1], HandoffResult) and not items[-1].ok
    assert "KV hand-off failed" in items[-1].error
    assert time.monotonic() - start < 5
    _assert_freed(prefill)


def test_pages_that_never_arrive_free_the_reservation(pair):
    _, decode, reader = pair
    assert decode.reserve(_request("lost", 20)).granted
    assert _used(decode) > 0
    events = reader.items(decode, "lost")  # ends when the reservation expires (1 s here)
    assert events[-1].finish_reason == FinishReason.ERROR
    assert "did not arrive" in events[-1].error
    assert _used(decode) == 0


def test_abort_before_the_pages_arrive_refuses_them(pair):
    prefill, decode, reader = pair
    reservation = decode.reserve(_request("r"))
    assert reservation.granted
    decode.abort("r")
    assert len(decode.requests) == 0  # an aborted request's record is gone
    # its abort event may have gone out before the record went; nothing else does
    assert all(e.finish_reason == FinishReason.ABORT for e in reader.pending(decode))
    target = HandoffTarget.from_reservation(reservation, 6)
    assert prefill.prefill(_request("r"), target).accepted
    items = reader.items(prefill, "r")
    assert isinstance(items[-1], HandoffResult) and not items[-1].ok
    assert "no reservation" in items[-1].error
    _assert_freed(prefill)
    assert _used(decode) == 0


def test_full_decode_worker_grants_waiting_handoffs_by_priority(tiny_model_dir):
    decode = _decode_worker(tiny_model_dir)
    reader = ChannelReader(decode)
    try:
        assert decode.reserve(_request("hog", 12)).granted  # every block
        granted: list[str] = []

        def wait(request_id: str, priority: int) -> None:  # 5 + 1 tokens = 2 of the 4 blocks
            if decode.reserve(_request(request_id, 5, priority), wait_s=3).granted:
                granted.append(request_id)

        threads = []
        for request_id, priority in [("p5-first", 5), ("p5-second", 5), ("p1-late", 1)]:
            threads.append(threading.Thread(target=wait, args=(request_id, priority)))
            threads[-1].start()
            time.sleep(0.2)
        decode.abort("hog")  # frees 4 blocks: room for two of the three waiting hand-offs
        for thread in threads:
            thread.join(timeout=10)
        assert sorted(granted) == ["p1-late", "p5-first"]  # the later priority-5 one waits
    finally:
        reader.close()
        _stop(decode)


def test_refusal_reason_is_worked_out_on_the_engine_thread(tiny_model_dir):
    decode = _decode_worker(tiny_model_dir)
    threads: list[str] = []
    reason = decode.engine.importer.reservation_refusal

    def recording(num_prompt_tokens: int) -> str:
        threads.append(threading.current_thread().name)
        return reason(num_prompt_tokens)

    decode.engine.importer.reservation_refusal = recording
    reader = ChannelReader(decode)
    try:
        assert decode.reserve(_request("hog", 12)).granted
        refused = decode.reserve(_request("late", 5), wait_s=0.2)
        assert not refused.granted and refused.endpoint == ""
        assert refused.reason == "decode cache full: 0 of 4 blocks free, 2 needed"
        assert threads == ["engine-loop"]
        assert decode.abort("hog") and not decode.abort("late")
        assert _used(decode) == 0 and decode.load().num_open_streams == 0
    finally:
        reader.close()
        _stop(decode)


def test_pages_are_acknowledged_while_the_engine_thread_is_busy(tiny_model_dir):
    prefill = PrefillWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    decode = _decode_worker(tiny_model_dir, num_blocks=64)
    reader = ChannelReader(prefill, decode)
    go_on = threading.Event()
    try:
        reservation = decode.reserve(_request("r"))
        assert reservation.granted
        busy = threading.Event()
        decode.loop.call(lambda engine: busy.set() or go_on.wait(10))  # a long "decode step"
        assert busy.wait(5)
        target = HandoffTarget.from_reservation(reservation, 6)
        assert prefill.prefill(_request("r"), target).accepted
        items = reader.items(prefill, "r")
        assert items[-1].ok  # acknowledged: the pages are in the reserved blocks already
        assert decode.engine.requests["r"].status == RequestStatus.RECEIVING
        go_on.set()
        events = reader.items(decode, "r")
        assert len(events) == 5 and events[-1].finish_reason == FinishReason.LENGTH
        assert _used(decode) == 0
    finally:
        go_on.set()
        reader.close()
        _stop(decode, prefill)


def test_worker_load_is_typed_and_flattens_to_the_instances_json(tiny_model_dir):
    decode = _decode_worker(tiny_model_dir)
    reader = ChannelReader(decode)
    try:
        assert decode.reserve(_request("r")).granted
        load, identity = decode.load(), decode.ready()
        assert isinstance(load.stats, EngineStats) and load.stats.num_reserved == 1
        assert isinstance(identity, WorkerIdentity) and identity.pid == load.pid
        instance = load.to_dict(identity)
        assert list(instance) == [
            "role",
            "instance",
            "serving",
            "role_epoch",
            "switching",
            "num_waiting",
            "num_running",
            "num_held",
            "num_free_blocks",
            "num_total_blocks",
            "num_prompt_tokens_to_compute",
            "num_reserved",
            "num_cached_blocks",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "grammar_cache_size",
            "grammar_compiles",
            "grammar_masked_rows",
            "grammar_mask_seconds",
            "speculative_checks",
            "speculative_drafted",
            "speculative_accepted",
            "speculative_accepted_histogram",
            "kv_tiers",
            "kv_tier_demoted",
            "kv_tier_skipped",
            "kv_tier_promoted",
            "prompt_token_seconds",
            "decode_step_seconds",
            "decode_step_rows",
            "num_steps",
            "kv_pulled_blocks",
            "kv_pulls_failed",
            "kv_exported_blocks",
            "num_used_blocks",
            "num_open_streams",
            "pid",
            "node_ip",
            "weights",
            "kernels",
            "weight_formats",
            "kernel_isa",
            "token_channel",
            "num_leases_expired",
            "requests_by_owner",
            "num_dropped_events",
            "heap_in_use_bytes",
            "heap_free_bytes",
            "heap_trims",
            "heap_last_trim_ms",
        ]
        assert instance["role"] == "decode" and instance["num_free_blocks"] == 2
        assert instance["requests_by_owner"] == {reader.owner: 1}
        assert instance["num_open_streams"] == 1 and instance["num_dropped_events"] == 0
        assert identity.token_channel == decode.channel.endpoint
        decode.abort("r")
    finally:
        reader.close()
        _stop(decode)


def test_worker_identity_is_typed_and_names_weights_kernels_and_formats(tiny_model_dir):
    decode = _decode_worker(tiny_model_dir)
    try:
        identity = decode.ready()
        assert isinstance(identity, WorkerIdentity) and identity.role == "decode"
        assert set(identity.kernels.values()) <= {"cached", "built"}
        assert identity.weights.startswith("weights fp32: layers float32")
        formats = identity.weight_formats
        assert set(formats) == {"embedding", "qkv", "o_proj", "gate_up", "down", "lm_head"}
        assert set(formats.values()) == {"float32"}
        assert identity.kernel_isa in ("avx512", "avx2", "scalar", "")
        # what ``pdserve workers`` prints of it: the keys ``ready`` answered before it was typed
        assert list(identity.describe()) == ["role", "instance", "pid", "cpus", "model", "layout"]
    finally:
        _stop(decode)


@pytest.mark.parametrize("limit", [6, 9])
def test_migrated_request_one_token_short_of_its_limit_ends_on_prefill(tiny_model_dir, limit):
    """A request migrated with ``limit - 1`` outputs gets one more token, on the prefill worker,
    and finishes there at exactly its limit (none handed off for decode to overshoot), even when
    the limit is past the engine's own (a disaggregated ``maxIterTimes + 1``)."""
    config = replace(_config(tiny_model_dir), scheduler=SchedulerConfig(max_iter_times=8))
    prefill = PrefillWorker(config, KVTransferConfig("inprocess"))
    reader = ChannelReader(prefill)
    try:
        request = _request("r").continued("r-m1", range(20, 20 + limit - 1))
        assert prefill.prefill(request, HandoffTarget.nowhere(limit)).accepted
        items = reader.items(prefill, "r-m1")
        assert len(items) == 1 and isinstance(items[0], TokenEvent)
        assert items[0].finish_reason == FinishReason.LENGTH
        assert items[0].num_output_tokens == limit
        _assert_freed(prefill)
        assert len(prefill.requests) == 0  # its record went with its final event
    finally:
        reader.close()
        _stop(prefill)


# ---- who may send requests ---------------------------------------------------------------------


def test_a_coordinator_not_attached_is_told_the_channel_and_nothing_is_queued(tiny_model_dir):
    """``generate``/``prefill`` answer ``Submitted.unattached``, ``reserve`` a reservation naming
    the channel: nothing is held, no block used; once attached, the same call is taken."""
    prefill = PrefillWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    decode = _decode_worker(tiny_model_dir)
    colocated = ColocatedWorker(_config(tiny_model_dir))
    reader = ChannelReader()
    try:
        request = _request("r")
        for worker, answer in [
            (prefill, prefill.prefill(request)),
            (decode, decode.generate(request)),
            (colocated, colocated.generate(request)),
        ]:
            assert answer == Submitted.unattached(worker.channel.endpoint)
            assert not answer.accepted and answer.channel == worker.channel.endpoint
        refused = decode.reserve(request)
        assert refused == Reservation.unattached(decode.channel.endpoint)
        assert not refused.granted and refused.endpoint == "" and refused.token == ""
        for worker in (prefill, decode, colocated):
            assert len(worker.requests) == 0 and _used(worker) == 0
            assert worker.live_coordinators() == []  # an unattached call renews no lease

        stranger = ChannelReader(colocated, owner="another-coordinator")  # attached, not as us
        assert colocated.generate(request) == Submitted.unattached(colocated.channel.endpoint)
        reader.attach(colocated)
        assert colocated.generate(request).accepted
        events = reader.items(colocated, "r")
        assert events[-1].finish_reason == FinishReason.LENGTH
        assert stranger.pending(colocated) == []  # another coordinator's events never go there
        stranger.close()
    finally:
        reader.close()
        _stop(prefill, decode, colocated)


def test_a_request_id_in_use_is_refused_and_the_first_goes_on(tiny_model_dir):
    decode = _decode_worker(tiny_model_dir, num_blocks=64)
    colocated = ColocatedWorker(_config(tiny_model_dir))
    reader = ChannelReader(decode, colocated)
    try:
        assert decode.reserve(_request("r")).granted
        again = decode.reserve(_request("r"))
        assert not again.granted and again.reason == "request id 'r' is already in use"
        assert decode.generate(_request("r")) == Submitted(
            False, "request id 'r' is already in use"
        )
        assert decode.load().requests_by_owner == {reader.owner: 1}
        assert decode.abort("r") and len(decode.requests) == 0

        long = replace(_request("c"), params=SamplingParams(max_new_tokens=64, ignore_eos=True))
        assert colocated.generate(long).accepted  # still running when the second one comes
        assert colocated.generate(_request("c")) == Submitted(
            False, "request id 'c' is already in use"
        )
        events = reader.items(colocated, "c")  # the first one's stream, whole and alone
        assert len(events) == 64 and events[-1].finish_reason == FinishReason.LENGTH
        assert reader.pending(colocated) == []
        assert len(colocated.requests) == 0 and len(decode.requests) == 0
    finally:
        reader.close()
        _stop(decode, colocated)


def test_a_constraint_the_worker_cannot_compile_is_refused_as_constraint_violated(tiny_model_dir):
    """Refused the same on every worker: the cause tells the coordinator not to migrate it."""
    colocated = ColocatedWorker(_config(tiny_model_dir))
    reader = ChannelReader(colocated)
    try:
        request = _request("g")
        params = replace(request.params, constraint=Constraint("lark", "start: undefined_rule"))
        answer = colocated.generate(replace(request, params=params))
        assert not answer.accepted and answer.cause == CONSTRAINT_VIOLATED
        assert "undefined_rule" in answer.error
        assert len(colocated.requests) == 0
        assert colocated.generate(_request("c")).accepted  # the worker goes on
        assert reader.items(colocated, "c")[-1].finish_reason == FinishReason.LENGTH
    finally:
        reader.close()
        _stop(colocated)
