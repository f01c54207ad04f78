"""Workers' prefix-cache events (``engine.kv_events``) and the routers' mirror of them
(``coordinator.kv_index``): numbered, replayed after a short gap, resynchronised from a snapshot
after a long one or a restart; two routers that never saw each other's requests route a shared
prefix to the same worker, which reports it cached."""

from __future__ import annotations

import asyncio
import threading
import time

from coordinator.router import Router
from coordinator.routing.cache_view import CacheView
from coordinator.routing.config import RoutingConfig
from coordinator.routing.worker_view import FOLLOW_BATCH_S
from engine.block_manager import BlockManager
from engine.kv_events import REMOVED, STORED, KvEventBatch, KvEventLog
from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams
from tests.support.channel_reader import ChannelReader
from tests.support.router_polls import num_confirmed
from tests.support.tenant_cluster import InProcessCluster, _config
from workers.colocated import ColocatedWorker
from workers.contracts import GenerationRequest
from workers.leases import LEASE_S

H = [bytes([i]) * 16 for i in range(10)]


def test_the_log_replays_what_a_reader_missed_in_order():
    log = KvEventLog(b"root")
    for h in H[:3]:
        log.record(STORED, h)
    first = log.since(log.epoch, 0)
    assert [e[0] for e in first.events] == [1, 2, 3] and first.last_seq == 3 and not first.gap
    log.record(REMOVED, H[0])
    again = log.since(log.epoch, first.last_seq)
    assert again.events == ((4, REMOVED, H[0]),) and again.root == b"root"
    assert log.since(log.epoch, 4).events == ()


def test_a_reader_too_far_behind_or_of_another_epoch_is_told_to_resync():
    log = KvEventLog(capacity=4)
    for h in H[:6]:
        log.record(STORED, h)
    assert log.since(log.epoch, 1).gap  # events 2 and 3 are gone from the replay buffer
    assert not log.since(log.epoch, 2).gap  # 3..6 are all there
    assert log.since("another-epoch", 5).gap
    assert log.since(log.epoch, -1).gap  # a first poll starts from a snapshot
    assert log.since(log.epoch, 99).gap  # a cursor from the future is never trusted


def test_a_long_poll_returns_at_the_next_event_or_its_timeout():
    log = KvEventLog()
    start = time.monotonic()
    assert log.wait_since(log.epoch, 0, 0.2).events == ()  # none came: after the timeout
    assert time.monotonic() - start >= 0.2
    threading.Timer(0.05, log.record, (STORED, H[0])).start()
    start = time.monotonic()
    woke = log.wait_since(log.epoch, 0, 5.0)
    assert woke.events == ((1, STORED, H[0]),) and time.monotonic() - start < 1.0
    start = time.monotonic()
    assert log.wait_since("another-epoch", 1, 5.0).gap  # at once: a resync is due
    assert log.wait_since(log.epoch, 0, 5.0).events  # at once: there is one already
    assert time.monotonic() - start < 1.0


def test_an_event_that_arrives_twice_applies_once():
    """A load poll and a long poll may bring the same events: no resync, no double count."""
    log, index, key = KvEventLog(b"root"), CacheView(ttl_s=600.0), ("prefill", 0)
    index.apply(key, log.since(*index.cursor(key)))
    index.load(key, log.snapshot([]))
    cursor = index.cursor(key)
    for h in H[:3]:
        log.record(STORED, h)
    assert not index.apply(key, log.since(*cursor))
    log.record(REMOVED, H[0])
    assert not index.apply(key, log.since(*cursor))  # 1-3 again, then 4
    assert index.num_events == 4 and index.num_resyncs == 1
    assert index.match_confirmed(key, H[:3]) == 0 and index.match_confirmed(key, H[1:3]) == 2


def test_the_block_manager_records_stores_and_evictions():
    blocks = BlockManager(2, 4, enabled=True, root=b"r")
    tokens = list(range(8))
    hashes = block_hashes(tokens, 4, b"r")
    ids = blocks.allocate(2)
    blocks.register(ids, hashes, tokens, 0)
    blocks.free(ids)
    assert [(kind, h) for _, kind, h in blocks.events.since(blocks.events.epoch, 0).events] == [
        (STORED, hashes[0]),
        (STORED, hashes[1]),
    ]
    snapshot = blocks.kv_snapshot()
    assert set(snapshot.hashes) == set(hashes) and snapshot.seq == 2
    blocks.allocate(1)  # evicts the oldest cached block: the tail went free first
    removed = blocks.events.since(blocks.events.epoch, 2).events
    assert [kind for _, kind, _ in removed] == [REMOVED] and removed[0][2] in hashes


def test_the_index_resyncs_after_a_gap_a_restart_or_an_overflow_never_guessing():
    log = KvEventLog(b"root", capacity=3)
    index = CacheView(ttl_s=600.0)
    key = ("decode", 0)
    assert index.apply(key, log.since(*index.cursor(key)))  # first poll: a snapshot is due
    index.load(key, log.snapshot([]))
    log.record(STORED, H[1])
    assert not index.apply(key, log.since(*index.cursor(key)))
    assert index.match_confirmed(key, [H[1], H[2]]) == 1
    for h in H[2:8]:  # more than the replay buffer holds
        log.record(STORED, h)
    assert index.apply(key, log.since(*index.cursor(key)))
    assert index.match_confirmed(key, [H[1]]) == 0  # nothing is trusted until the snapshot
    index.load(key, log.snapshot(H[1:8]))
    assert index.match_confirmed(key, H[1:8]) == 7 and index.num_resyncs == 2
    out_of_order = KvEventBatch(log.epoch, b"root", 12, ((12, REMOVED, H[1]),))
    assert index.apply(key, out_of_order) and index.match_confirmed(key, [H[2]]) == 0
    index.load(key, log.snapshot(H[1:8]))
    restarted = KvEventLog(b"root")
    assert index.apply(key, restarted.since(*index.cursor(key)))  # another epoch
    index.load(key, restarted.snapshot([]))
    for h in H[:3]:
        restarted.record(STORED, h)
    assert index.apply(key, restarted.since(*index.cursor(key)), capacity=2)  # over its blocks


def _request(request_id: str, prompt: list[int]) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    return GenerationRequest(request_id, prompt, params, owner=COORDINATOR_A)


COORDINATOR_A = "coordinator-a"  # sends requests to the workers the routers never saw


def _generate(reader: ChannelReader, worker: ColocatedWorker, request: GenerationRequest) -> list:
    """Run ``request`` on ``worker`` to its end, as ``reader``'s coordinator: its events."""
    assert worker.generate(request).accepted
    return reader.items(worker, request.request_id)


def _stop(cluster: InProcessCluster, reader: ChannelReader) -> None:
    reader.close()
    cluster.reader.close()
    for worker in cluster.colocated:
        worker.close()


def test_two_routers_send_a_shared_prefix_to_the_worker_that_holds_it(tiny_model_dir):
    """A prompt runs on worker 1 (where no router sent it); a router that never saw it learns
    from the workers' events where it is cached and sends the next turn there, a cache hit."""
    workers = [ColocatedWorker(_config(tiny_model_dir), i) for i in range(2)]
    routing = RoutingConfig(block_size=4, local_prefill_tokens=0, local_prefill_queue_tokens=0)
    cluster = InProcessCluster(workers)
    reader = ChannelReader(*workers, owner=COORDINATOR_A)
    try:
        first, second = Router(cluster, routing=routing), Router(cluster, routing=routing)
        prompt = list(range(20, 60))
        asyncio.run(first.view.refresh())
        asyncio.run(second.view.refresh())
        chosen = 1  # where the first router would not send it (both idle: the first one)
        assert first.choose(prompt) == (0, 0)
        _generate(reader, workers[chosen], _request("turn-1", prompt))
        asyncio.run(second.view.refresh())
        assert num_confirmed(second.cache, ("colocated", chosen)) >= 9
        assert num_confirmed(second.cache, ("colocated", 1 - chosen)) == 0
        follow_up = [*prompt, 7, 8, 9, 10]
        assert second.choose(follow_up) == (0, chosen)
        events = _generate(reader, workers[chosen], _request("turn-2", follow_up))
        assert max(e.num_cached_tokens for e in events) == 40
    finally:
        _stop(cluster, reader)


async def _seconds_until_a_shared_router_learns_the_prefix(
    cluster, workers, routing, prompt, reader
) -> float:
    """With another coordinator sharing the workers, a router's long polls bring worker 1's stored
    prompt and the router sends its next turn there; how long after generating it learned."""
    router = Router(cluster, poll_interval_s=30.0, routing=routing)
    for worker in workers:  # another coordinator shares them
        worker.report("another-coordinator")
    await router.view.refresh()  # in sync: the long polls take over from here
    router.view.start()
    try:
        await asyncio.sleep(0.1)
        await asyncio.to_thread(_generate, reader, workers[1], _request("t", prompt))
        generated = time.monotonic()
        while num_confirmed(router.cache, ("colocated", 1)) < 9:
            assert time.monotonic() - generated < 2.0, "the long poll brought nothing"
            await asyncio.sleep(0.005)
        assert router.choose([*prompt, 1, 2, 3]) == (0, 1)
        return time.monotonic() - generated
    finally:
        await router.view.stop()


async def _blocks_a_lone_router_confirms_without_a_load_poll(
    cluster, workers, routing, prompt, reader
) -> int:
    """A router alone in front of the workers (not shared): the blocks of worker 0 it confirms
    half a second after worker 0 stored a longer prompt, its load poll 30 s away."""
    router = Router(cluster, poll_interval_s=30.0, routing=routing)
    await router.view.refresh()
    router.view.start()
    try:
        assert not router.view.shared()
        more = [*prompt, *range(100, 140)]
        await asyncio.to_thread(_generate, reader, workers[0], _request("u", more))
        await asyncio.sleep(0.5)
        return num_confirmed(router.cache, ("colocated", 0))
    finally:
        await router.view.stop()


def test_a_router_learns_of_another_routers_prefix_at_once_from_its_long_poll(tiny_model_dir):
    """With load polls far apart, a router sharing the workers with another coordinator still
    knows within a batching period that a worker stored a prompt it never routed: each worker's
    events are long-polled. Alone in front of them, it leaves the events to its load polls."""
    workers = [ColocatedWorker(_config(tiny_model_dir), i) for i in range(2)]
    routing = RoutingConfig(block_size=4, local_prefill_tokens=0, local_prefill_queue_tokens=0)
    cluster = InProcessCluster(workers)
    prompt = list(range(20, 60))
    reader = ChannelReader(*workers, owner=COORDINATOR_A)
    scenario = (cluster, workers, routing, prompt, reader)
    try:
        learned_s = asyncio.run(_seconds_until_a_shared_router_learns_the_prefix(*scenario))
        assert learned_s < 0.5 + FOLLOW_BATCH_S  # not at the next load poll, 30 s away
        for worker in workers:  # the other coordinator's lease lapses (so does the router's,
            worker.leases.take_expired(time.monotonic() + LEASE_S + 1)  # renewed at its poll)
        # not followed: its next load poll brings them
        assert asyncio.run(_blocks_a_lone_router_confirms_without_a_load_poll(*scenario)) == 0
    finally:
        _stop(cluster, reader)
