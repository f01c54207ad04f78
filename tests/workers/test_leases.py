"""Coordinators' leases on a worker (``workers/leases.py``): when one coordinator stops renewing,
the worker aborts its requests (reservations and generations), freeing every block, and leaves
the other coordinators' requests alone. Each coordinator attaches to the worker's real token
channel (a worker takes requests of attached coordinators only)."""

from __future__ import annotations

import threading
import time

from decode_worker.worker import DecodeWorker
from engine.config import KVTransferConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.support.channel_reader import ChannelReader
from tests.support.inprocess_workers import _stop
from tests.support.tenant_cluster import _config
from tests.support.worker_streams import wait_until as _wait_until
from workers.colocated import ColocatedWorker
from workers.contracts import GenerationRequest
from workers.leases import Leases
from workers.runtime import LEASES

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
    readers = [ChannelReader(decode, owner=owner) for owner in ("gone", "kept")]
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
        for reader in readers:
            reader.close()
        _stop(decode)


def _read_until_quiet(reader, worker, request_id: str, quiet_s: float = 1.0) -> list:
    """The events of ``request_id`` until its final one, or until none came for ``quiet_s``."""
    events: list = []
    while not events or not events[-1].finished:
        got = reader.take(worker, request_id, quiet_s)
        if not got:
            break
        events += got
    return events


def test_a_lapsed_coordinators_generation_is_aborted_mid_way(tiny_model_dir, monkeypatch):
    """Its lease lapsed (though it is attached and reading), so it is aborted: its events stop
    well short of its 200 tokens, its blocks are freed, and another coordinator's request still
    runs to its end."""
    worker = ColocatedWorker(_config(tiny_model_dir))
    worker.leases.lease_s = LEASE_S
    step = worker.engine.step

    def slow_step():  # 200 tokens take 2 s: longer than the lease lets them run
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(worker.engine, "step", slow_step)
    gone, kept = ChannelReader(worker, owner="gone"), ChannelReader(worker, owner="kept")
    stop = threading.Event()
    try:
        renewing = _renew_until(worker, "kept", stop)
        assert worker.generate(_request("gone-1", "gone", max_new_tokens=200)).accepted
        assert _wait_until(lambda: not worker.requests.owned_by("gone"), 20 * LEASE_S)
        # its record went with the abort: no event of it follows, bar (maybe) the abort's own
        events = _read_until_quiet(gone, worker, "gone-1")
        assert 0 < len(events) < 200
        assert not any(e.finished for e in events[:-1])
        assert events[-1].finish_reason in (None, FinishReason.ABORT), events[-1]
        assert worker.generate(_request("kept-1", "kept")).accepted
        assert kept.items(worker, "kept-1")[-1].finish_reason == FinishReason.LENGTH
        stop.set()
        renewing.join()
        stats = worker.load().stats
        assert stats.num_running == 0 and stats.num_used_blocks == 0
        assert worker.requests.owned_by("gone") == []
        assert worker.load().num_leases_expired == 1
    finally:
        stop.set()
        gone.close()
        kept.close()
        _stop(worker)


def test_every_call_naming_its_coordinator_renews_the_lease(tiny_model_dir):
    """An abort and a router's long poll renew their coordinator's lease, as a load poll and a
    request sent do: a coordinator busy with those is never taken for gone."""
    worker = ColocatedWorker(_config(tiny_model_dir))
    worker.leases.lease_s = LEASE_S
    try:
        worker.abort("no-such-request", owner="aborting")
        worker.kv_events("", -1, 0.0, owner="polling")
        worker.abort("no-such-request")  # no owner: no lease
        assert sorted(worker.leases.live()) == ["aborting", "polling"]
        time.sleep(LEASE_S * 1.5)  # no call since: both lapsed (housekeeping may take them)
        worker.leases.take_expired()
        assert worker.leases.live() == [] and worker.leases.num_expired == 2
    finally:
        _stop(worker)


def test_lease_renewals_run_on_a_thread_group_no_other_call_shares():
    """However many aborts, loads or snapshots wait on the control group, a report (the
    renewal) never queues behind them."""
    groups = {
        (cls.__name__, name): getattr(getattr(cls, name), "__ray_concurrency_group__", None)
        for cls in (ColocatedWorker, DecodeWorker, PrefillWorker)
        for name in dir(cls)
        if not name.startswith("_")
    }
    renewals = sorted({name for (_, name), group in groups.items() if group == LEASES})
    assert renewals == ["report"]
    assert all(groups[cls.__name__, "report"] == LEASES for cls in (ColocatedWorker, DecodeWorker))
