"""What a worker holds for a request goes when the request does: its record (however a
reservation ends, read or not; a coordinator that is gone has its requests aborted),
shared-memory mappings, blocks after any sender error; and no call blocks a Ray thread past its
bound (``reserve`` within ``wait_s``). Workers run in-process (no Ray), their events read on
their real token channels."""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.engine_loop import EngineLoop
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.transfer.payload import HandoffState, KVLayout, KVPayload
from engine.transfer.shared_memory import SharedPageBuffer
from engine.transfer.transports import create_receiver, create_sender
from prefill_worker.worker import PrefillWorker
from tests.support.channel_reader import OWNER, ChannelReader
from tests.support.inprocess_workers import _stop
from tests.support.worker_streams import wait_until as _wait_until
from workers.colocated import ColocatedWorker
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget, Submitted


def _config(model_dir, num_blocks: int = 64) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=num_blocks)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


def _request(request_id: str, num_prompt_tokens: int = 5, max_new_tokens: int = 6):
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    prompt = range(5, 5 + num_prompt_tokens)
    return GenerationRequest(request_id, prompt, params, owner=OWNER)


def _open_streams(worker: Any) -> int:
    """The requests ``worker`` holds, as its load reports them (and really)."""
    reported = worker.load().num_open_streams
    assert reported == len(worker.requests)
    return reported


def _used(worker: Any) -> int:
    return worker.load().stats.num_used_blocks


# ---- request records ---------------------------------------------------------------------------


def test_reserve_then_abort_a_thousand_times_leaves_no_record(tiny_model_dir):
    decode = DecodeWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    reader = ChannelReader(decode)
    try:
        for i in range(1000):  # e.g. requests that end on their first token
            assert decode.reserve(_request(f"r{i}")).granted
            assert decode.abort(f"r{i}")
        assert _open_streams(decode) == 0 and _used(decode) == 0
        assert decode.load().requests_by_owner == {}
    finally:
        reader.close()
        _stop(decode)


def test_an_expired_reservation_leaves_no_record_once_its_error_went_unread(tiny_model_dir):
    transfer = KVTransferConfig("inprocess", reservation_timeout_s=0.5)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    reader = ChannelReader(decode)
    try:
        assert decode.reserve(_request("lost")).granted  # its pages never come; nobody reads
        assert _wait_until(lambda: _used(decode) == 0, 3)  # expired
        # the record goes with the final event's send, read or not: no grace to wait out
        assert _wait_until(lambda: _open_streams(decode) == 0, 1.0)
        [event] = reader.items(decode, "lost")  # the coordinator still gets it, from its socket
        assert event.finish_reason == FinishReason.ERROR and "did not arrive" in event.error
        assert decode.channel.num_dropped_events == 0
    finally:
        reader.close()
        _stop(decode)


def test_a_request_that_finished_before_its_coordinator_read_is_still_delivered(tiny_model_dir):
    transfer = KVTransferConfig("inprocess", reservation_timeout_s=1.0)
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    reader = ChannelReader(prefill, decode)
    try:
        reservation = decode.reserve(_request("r", max_new_tokens=2))
        assert reservation.granted
        target = HandoffTarget.from_reservation(reservation, 2)
        assert prefill.prefill(_request("r", max_new_tokens=2), target).accepted
        items = reader.items(prefill, "r")
        assert isinstance(items[-1], HandoffResult) and items[-1].ok
        assert _wait_until(lambda: "r" not in decode.engine.requests, 3)  # done on its 1st step
        assert _open_streams(decode) == 0 and _used(decode) == 0  # held by nobody but the socket
        time.sleep(0.5)  # the coordinator is slow to read
        events = reader.items(decode, "r")
        assert [e.finish_reason for e in events] == [FinishReason.LENGTH]
        assert _open_streams(prefill) == 0
    finally:
        reader.close()
        _stop(prefill, decode)


def test_a_gone_coordinators_requests_are_aborted_and_it_is_told_on_return(
    tiny_model_dir, monkeypatch
):
    """A coordinator that disconnects mid-generation: the worker's next sends to it fail (counted
    drops, never a blocked engine thread), housekeeping aborts its requests (``take_lagging``),
    freeing their blocks; when it attaches again, its next message names the lost request."""
    worker = ColocatedWorker(_config(tiny_model_dir))
    step = worker.engine.step

    def slow_step():  # 200 tokens take 2 s: it is still generating when its coordinator goes
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(worker.engine, "step", slow_step)
    reader = ChannelReader(worker)
    try:
        assert worker.generate(_request("r", max_new_tokens=200)).accepted
        assert reader.take(worker, "r", 5)  # it is generating
        reader.detach(worker)
        assert _wait_until(lambda: _open_streams(worker) == 0, 3)  # aborted
        assert _wait_until(lambda: _used(worker) == 0, 1)
        assert "r" not in worker.engine.requests
        dropped = worker.channel.num_dropped_events
        assert 0 < dropped < 200 and worker.load().num_dropped_events == dropped
        assert OWNER not in worker.channel.attached  # unreachable: it must say hello again
        assert worker.generate(_request("r2", max_new_tokens=2)) == Submitted.unattached(
            worker.channel.endpoint
        )
        reader.attach(worker)
        assert worker.generate(_request("r2", max_new_tokens=2)).accepted
        assert reader.items(worker, "r2")[-1].finish_reason == FinishReason.LENGTH
        assert reader.lost(worker) == {"r"}  # its coordinator ends it at once
    finally:
        reader.close()
        _stop(worker)


# ---- reserve returns within wait_s -------------------------------------------------------------


def _block_engine_thread(worker: Any) -> threading.Event:
    """Keep the engine thread busy (a long step) until the returned event is set."""
    busy, release = threading.Event(), threading.Event()
    worker.loop.call(lambda engine: busy.set() or release.wait(30))
    assert busy.wait(5)
    return release


def _timed_reserve(worker: DecodeWorker, request: GenerationRequest, wait_s: float):
    outcome: list[Any] = []

    def reserve() -> None:
        start = time.monotonic()
        outcome.append(worker.reserve(request, wait_s))
        outcome.append(time.monotonic() - start)

    thread = threading.Thread(target=reserve, daemon=True)
    thread.start()
    return thread, outcome


def test_reserve_returns_within_wait_s_while_the_engine_thread_is_busy(tiny_model_dir):
    decode = DecodeWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    reader = ChannelReader(decode)
    release = _block_engine_thread(decode)
    try:
        thread, outcome = _timed_reserve(decode, _request("r"), wait_s=0.3)
        thread.join(3)
        assert not thread.is_alive()
        reservation, seconds = outcome
        assert not reservation.granted and "decode worker busy" in reservation.reason
        assert seconds < 0.3 + 0.25
    finally:
        release.set()
    assert _wait_until(lambda: _used(decode) == 0 and _open_streams(decode) == 0, 3)
    assert "r" not in decode.engine.requests  # the late "add" never reserved anything
    reader.close()
    _stop(decode)


def test_a_waiter_given_up_on_is_never_granted_later(tiny_model_dir):
    decode = DecodeWorker(_config(tiny_model_dir, num_blocks=4), KVTransferConfig("inprocess"))
    reader = ChannelReader(decode)
    try:
        assert decode.reserve(_request("hog", 12)).granted  # every block
        thread, outcome = _timed_reserve(decode, _request("late"), wait_s=0.5)
        time.sleep(0.2)  # "late" waits for blocks; now the engine thread gets stuck
        release = _block_engine_thread(decode)
        try:
            thread.join(3)
            assert not thread.is_alive()
            reservation, seconds = outcome
            assert not reservation.granted and seconds < 0.5 + 0.25
        finally:
            release.set()
        decode.abort("hog")  # room again: the given-up waiter must not take it
        time.sleep(0.3)
        assert "late" not in decode.engine.requests
        assert _used(decode) == 0 and _open_streams(decode) == 0
    finally:
        reader.close()
        _stop(decode)


# ---- the prefill side frees its blocks whatever the sender raises ------------------------------


class _Boom(Exception):
    pass


def test_a_sender_raising_anything_fails_the_handoff_and_frees_the_blocks(tiny_model_dir):
    transfer = KVTransferConfig("inprocess")
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)

    def send(endpoint: str, payload: KVPayload, timeout: float) -> None:
        raise _Boom("socket in a bad state")

    prefill.sender.send = send  # type: ignore[method-assign]
    reader = ChannelReader(prefill, decode)
    try:
        assert decode.reserve(_request("r")).granted
        assert prefill.prefill(_request("r"), HandoffTarget(decode.receiver.endpoint, 6)).accepted
        items = reader.items(prefill, "r")
        assert isinstance(items[-1], HandoffResult) and not items[-1].ok
        assert items[-1].error == "KV hand-off failed: _Boom: socket in a bad state"
        assert _wait_until(lambda: _used(prefill) == 0, 3)
        assert _open_streams(prefill) == 0
        decode.abort("r")
    finally:
        reader.close()
        _stop(prefill, decode)


# ---- shared memory -----------------------------------------------------------------------------

# pages of [2 layers, k/v, blocks, 64 slots, 4 heads, 32 dims] float32: 128 KiB a block
_LAYOUT = KVLayout("fp", "layer,kv,block,slot,kv_head,head_dim", "torch.float32", 64, 2, 4, 32)
_STATE = HandoffState("r", [1, 2, 3], 3, 3, SamplingParams(), 5, 2)


def _mapped_kv_files() -> set[str]:
    """The pdserve-kv files this process maps now."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[5] for line in maps if "pdserve-kv-" in line}


def test_a_closed_shared_page_buffer_is_unmapped_and_collectable():
    buffers = [SharedPageBuffer(2**20) for _ in range(5)]
    paths = {str(b.path) for b in buffers}
    assert paths <= _mapped_kv_files()
    refs = [weakref.ref(b) for b in buffers]
    for buffer in buffers:
        buffer.write(torch.ones(16))
        buffer.close()
    assert not paths & _mapped_kv_files()
    assert not any(Path(p).exists() for p in paths)
    del buffers, buffer
    assert all(ref() is None for ref in refs)  # nothing (atexit) keeps them alive


def test_a_dropped_shared_page_buffer_unlinks_its_file():
    buffer = SharedPageBuffer(4096)
    path = buffer.path
    del buffer
    assert not path.exists()


def test_replaced_shared_files_are_unmapped_on_both_sides():
    """Growing transfers replace the sender's file each time; the sender unmaps the old one and
    the receiver keeps only the newest file of this sender."""
    received: list[int] = []

    def handler(item: KVLayout | KVPayload) -> str | None:
        if isinstance(item, KVPayload):
            received.append(item.num_bytes)
        return None

    receiver, sender = create_receiver("zmq", handler), create_sender("zmq")
    try:
        before = _mapped_kv_files()
        for num_blocks in (4, 8, 16, 32):
            pages = torch.randn(2, 2, num_blocks, 64, 4, 32)
            sender.send(receiver.endpoint, KVPayload(_LAYOUT, _STATE, pages), timeout=10)
        assert sender.payloads_by_path.as_dict() == {"shared_memory": 4}
        assert len(_mapped_kv_files() - before) == 1
    finally:
        sender.close()
        receiver.close()
    assert len(received) == 4


# ---- the engine loop's housekeeping ------------------------------------------------------------


class _CountingEngine:
    """Just enough of an engine for an idle loop, counting expiry passes."""

    def __init__(self) -> None:
        self.expiry_passes = 0
        self.importer = self

    def has_work(self) -> bool:
        return False

    def expire_reservations(self, now: float | None = None) -> None:
        self.expiry_passes += 1

    def stats(self) -> EngineStats:
        return EngineStats()


class _NoHooks:
    def on_events(self, events: list[TokenEvent]) -> None:
        pass

    def on_housekeeping(self) -> None:
        pass


def test_reservation_expiry_runs_at_most_every_quarter_second():
    engine = _CountingEngine()
    start = time.monotonic()
    loop = EngineLoop(lambda: engine, _NoHooks())  # type: ignore[arg-type,return-value]
    try:
        for _ in range(200):  # many calls: many loop iterations
            loop.call(lambda e: None).result()
            time.sleep(0.005)
    finally:
        loop.stop()
    elapsed = time.monotonic() - start
    assert 1 <= engine.expiry_passes <= elapsed / 0.25 + 2


def test_an_event_hook_error_does_not_stop_the_engine_thread(tiny_model_dir):
    decode = DecodeWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    calls: list[int] = []

    def failing(events: list[TokenEvent]) -> None:
        calls.append(len(events))
        raise RuntimeError("hook bug")

    decode.on_events = failing  # type: ignore[method-assign]
    reader = ChannelReader(decode)
    try:
        assert decode.reserve(_request("r")).granted
        decode.abort("r")
        assert _wait_until(lambda: bool(calls), 3)
        assert decode.loop.call(lambda e: "alive").result(timeout=3) == "alive"
    finally:
        reader.close()
        _stop(decode)
