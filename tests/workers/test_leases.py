"""Coordinators' leases on a worker (``workers/leases.py``): when one coordinator stops renewing,
the worker aborts its requests (reservations and streams), freeing every block, and leaves the
other coordinators' requests alone."""

from __future__ import annotations

import threading
import time

from decode_worker.worker import DecodeWorker
from engine.config import KVTransferConfig
from engine.sampling_params import SamplingParams
from tests.support.tenant_cluster import _config
from workers.colocated import ColocatedWorker
from workers.contracts import GenerationRequest
from workers.leases import Leases

LEASE_S = 0.5


def _request(request_id: str, owner: str, max_new_tokens: int = 2) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return GenerationRequest(request_id, list(range(20, 40)), params, owner=owner)


def test_a_lease_lapses_only_without_renewal():
    leases = Leases(lease_s=5.0)
    leases.renew("a", now=0.0)
    leases.renew("b", now=0.0)
    leases.renew("", now=0.0)  # no owner: no lease
    leases.renew("b", now=4.0)
    assert sorted(leases.live(now=4.5)) == ["a", "b"]
    assert leases.take_expired(now=6.0) == ["a"] and leases.live(now=6.0) == ["b"]
    assert leases.take_expired(now=6.0) == [] and leases.num_expired == 1


def _renew_until(worker, owner: str, stop: threading.Event) -> threading.Thread:
    def renew() -> None:
        while not stop.is_set():
            worker.report(owner)
            time.sleep(0.05)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    return thread


def test_a_lapsed_coordinators_reservations_are_freed_and_the_others_kept(tiny_model_dir):
    decode = DecodeWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    decode.leases.lease_s = LEASE_S
    stop = threading.Event()
    try:
        free_before = decode.load().stats.num_free_blocks
        assert decode.reserve(_request("gone-1", "gone")).granted
        assert decode.reserve(_request("kept-1", "kept")).granted
        renewing = _renew_until(decode, "kept", stop)
        deadline = time.monotonic() + 10 * LEASE_S
        while decode.requests.owned_by("gone") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode.requests.owned_by("gone") == []
        assert decode.requests.owned_by("kept") == ["kept-1"]
        load = decode.load()
        assert load.num_leases_expired == 1 and load.stats.num_reserved == 1
        assert load.requests_by_owner == {"kept": 1}  # the lapsed one's are gone
        stop.set()
        renewing.join()
        decode.abort("kept-1")
        assert decode.load().stats.num_free_blocks == free_before
    finally:
        stop.set()
        decode.loop.stop()
        decode.receiver.close()


def test_a_lapsed_coordinators_stream_ends_as_aborted_mid_generation(tiny_model_dir, monkeypatch):
    worker = ColocatedWorker(_config(tiny_model_dir))
    worker.leases.lease_s = LEASE_S
    step = worker.engine.step

    def slow_step():  # 200 tokens take 2 s: longer than the lease lets them run
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(worker.engine, "step", slow_step)
    stop = threading.Event()
    try:
        renewing = _renew_until(worker, "kept", stop)
        events = list(worker.generate(_request("gone-1", "gone", max_new_tokens=200)))
        assert events[-1].finish_reason.value == "abort", events[-1]
        assert len(events) < 200
        kept = list(worker.generate(_request("kept-1", "kept")))
        assert kept[-1].finish_reason.value == "length"
        stop.set()
        renewing.join()
        stats = worker.load().stats
        assert stats.num_running == 0 and stats.num_used_blocks == 0
        assert worker.requests.owned_by("gone") == []
    finally:
        stop.set()
        worker.loop.stop()
