"""A worker's control plane never starves behind calls that wait: a full decode worker lets at
most ``MAX_WAITING_RESERVATIONS`` hand-offs wait for blocks and refuses one more at once as no
room (``Reservation.full``: the coordinator answers 429), and on a real Ray actor, with more
waiting hand-offs sent than a worker has threads, its load polls (lease renewals) and aborts
still answer at once, no lease lapses, and every block and record is free after."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ActorResources, ClusterConfig
from decode_worker.worker import MAX_WAITING_RESERVATIONS, DecodeWorker
from engine.config import KVTransferConfig
from tests.support.channel_reader import ChannelReader
from tests.support.inprocess_workers import _config, _request, _stop, _used
from workers.contracts import GenerationRequest
from workers.runtime import CONCURRENCY_GROUPS

BLOCKS = 16  # of 4 tokens: a 50-token prompt takes 13, leaving no room for a 20-token one
HOLD_S = 120.0  # the filling reservation's pages never come: it holds its blocks this long


def _filled_decode_worker(model_dir) -> tuple[DecodeWorker, ChannelReader]:
    transfer = KVTransferConfig("inprocess", reservation_timeout_s=HOLD_S)
    decode = DecodeWorker(_config(model_dir, BLOCKS), transfer)
    reader = ChannelReader(decode)
    assert decode.reserve(_request("fill", num_prompt_tokens=50)).granted
    return decode, reader


def test_one_hand_off_past_the_waiting_cap_is_refused_at_once_as_no_room(tiny_model_dir):
    decode, reader = _filled_decode_worker(tiny_model_dir)
    extra = 8
    try:
        with ThreadPoolExecutor(MAX_WAITING_RESERVATIONS + extra) as pool:
            calls = [
                pool.submit(decode.reserve, _request(f"r{i}", num_prompt_tokens=20), 2.0)
                for i in range(MAX_WAITING_RESERVATIONS + extra)
            ]
            time.sleep(1.0)
            answered_at_once = [call.result() for call in calls if call.done()]
            answers = [call.result() for call in calls]
        capped = [a for a in answered_at_once if "hand-offs already wait" in a.reason]
        waited = [a for a in answers if "decode cache full" in a.reason]
        assert len(capped) == extra
        assert len(waited) == MAX_WAITING_RESERVATIONS
        assert all(not a.granted and a.full for a in answers)
        assert decode.abort("fill")
        assert _used(decode) == 0 and len(decode.requests) == 0
    finally:
        reader.close()
        _stop(decode)


def test_a_refusal_for_what_the_request_is_is_not_no_room(tiny_model_dir):
    decode, reader = _filled_decode_worker(tiny_model_dir)
    try:
        taken = decode.reserve(_request("fill", num_prompt_tokens=5))
        assert not taken.granted and not taken.full and "already in use" in taken.reason
    finally:
        reader.close()
        _stop(decode)


def test_a_hand_off_the_grants_pace_cannot_serve_in_time_is_refused_at_arrival_with_it(
    tiny_model_dir,
):
    """Once three hand-offs that waited were granted blocks ~0.2 s apart (6 blocks in ~0.4 s of
    waiting: the idle time after counts nothing), a hand-off that may wait 0.1 s for 3 blocks,
    expected in ~0.2 s, is refused as no room when it arrives, with the estimate for its
    retry."""
    decode, reader = _filled_decode_worker(tiny_model_dir)  # 13 of 16 blocks taken
    try:
        assert decode.reserve(_request("a0", num_prompt_tokens=10)).granted  # the other 3
        with ThreadPoolExecutor(3) as pool:
            waiting = []
            for i in range(1, 4):
                request = _request(f"a{i}", num_prompt_tokens=10)
                waiting.append(pool.submit(decode.reserve, request, 30.0))
                time.sleep(0.05)  # queued in this order
            for i in range(3):  # a(i)'s blocks go to a(i + 1)
                time.sleep(0.2)
                assert decode.abort(f"a{i}")
                assert waiting[i].result(timeout=5).granted
        refused = decode.reserve(_request("c", num_prompt_tokens=10), 0.1)
        assert not refused.granted and refused.full and "expected in" in refused.reason
        assert 0.1 < refused.retry_after_s < 1.0
        assert decode.abort("a3") and decode.abort("fill")
        assert _used(decode) == 0 and len(decode.requests) == 0
    finally:
        reader.close()
        _stop(decode)


def test_the_waiting_cap_leaves_threads_of_the_hand_off_group_spare():
    assert 0 < MAX_WAITING_RESERVATIONS < CONCURRENCY_GROUPS["handoffs"]


def _on_a_small_pool(model_dir, scenario: Callable[[Cluster], Awaitable[None]]) -> None:
    """Run ``scenario`` on a real Ray pool of one prefill and one decode worker whose KV cache
    holds ``BLOCKS`` blocks and whose reservations hold theirs for ``HOLD_S``."""
    one_cpu = ActorResources(num_cpus=1)
    config = ClusterConfig(
        engine=_config(model_dir, BLOCKS),
        prefill_resources=one_cpu,
        decode_resources=one_cpu,
        kv=KVTransferConfig(reservation_timeout_s=HOLD_S),
    )
    cluster = Cluster(config)
    cluster.fleet.start()
    try:
        asyncio.run(scenario(cluster))
    finally:
        cluster.fleet.shutdown()


def _owned(owner: str, request_id: str, num_prompt_tokens: int) -> GenerationRequest:
    """A test request of ``num_prompt_tokens`` that coordinator ``owner`` sent."""
    base = _request(request_id, num_prompt_tokens)
    return GenerationRequest(request_id, base.prompt_token_ids, base.params, owner=owner)


@pytest.mark.ray
def test_more_waiting_hand_offs_than_threads_leave_polls_and_aborts_answering(
    ray_session, tiny_model_dir
):
    _on_a_small_pool(tiny_model_dir, _flood_and_poll)


async def _flood_and_poll(cluster: Cluster) -> None:
    fleet, key = cluster.fleet, ("decode", 0)
    await fleet.attach(key)
    decode, owner = fleet.worker(*key), fleet.coordinator_id
    request = functools.partial(_owned, owner)

    assert (await decode.reserve.remote(request("fill", 50), 5.0, 8)).granted
    flood = [decode.reserve.remote(request(f"r{i}", 20), 4.0, 8) for i in range(300)]
    latencies = []
    for _ in range(12):
        start = time.monotonic()
        report = await decode.report.remote(owner)
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.25)
    answers = await asyncio.gather(*flood)
    assert max(latencies) < 0.5, latencies
    assert report.load.num_leases_expired == 0
    assert all(not a.granted and a.full for a in answers)
    capped = sum("hand-offs already wait" in a.reason for a in answers)
    assert capped >= 300 - MAX_WAITING_RESERVATIONS
    assert await decode.abort.remote("fill")
    load = await decode.load.remote()
    assert load.stats.num_used_blocks == 0 and load.num_open_streams == 0
    assert owner in await decode.live_coordinators.remote()
    await fleet.aclose()


@pytest.mark.ray
def test_a_coordinator_queues_hand_offs_beyond_the_workers_waiting_places_instead_of_refusing(
    ray_session, tiny_model_dir
):
    """More reservations than a decode worker lets wait, sent through the coordinator while the
    worker is full: the coordinator queues those beyond the worker's places
    (``coordinator/pool/reserve_queue.py``), and as blocks free every one is granted in turn;
    none is refused for the worker's cap."""
    _on_a_small_pool(tiny_model_dir, _burst_through_the_coordinator)


async def _burst_through_the_coordinator(cluster: Cluster) -> None:
    count = MAX_WAITING_RESERVATIONS + 12
    fleet, key = cluster.fleet, ("decode", 0)
    await fleet.attach(key)
    decode, owner = fleet.worker(*key), fleet.coordinator_id
    request = functools.partial(_owned, owner)

    assert (await cluster._reserve(key, request("fill", 50), 8)).granted

    async def granted_then_dropped(request_id: str) -> bool:
        reservation = await cluster._reserve(key, request(request_id, 20), 8)
        if reservation.granted:  # its pages never come: free its blocks for the next
            assert await decode.abort.remote(request_id)
        return reservation.granted

    burst = [asyncio.ensure_future(granted_then_dropped(f"r{i}")) for i in range(count)]
    await asyncio.sleep(1.0)
    queue = cluster._reserve_queues[key]
    assert queue.out == MAX_WAITING_RESERVATIONS and len(queue) == count - queue.out
    assert await decode.abort.remote("fill")
    assert all(await asyncio.gather(*burst))
    assert queue.out == 0 and len(queue) == 0
    load = await decode.load.remote()
    assert load.stats.num_used_blocks == 0 and load.num_open_streams == 0
    await fleet.aclose()
