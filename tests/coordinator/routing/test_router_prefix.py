"""Cache-aware routing (unit level): the router's prefix index and pair cost with a fake cluster
whose polled loads each test sets. Block size 4: a 17-token prompt has 4 full blocks."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from coordinator.errors import NoWorkerError
from coordinator.routing.cache_view import CacheView
from coordinator.routing.worker_state import STALE_GRACE_S
from engine.prefix_hash import block_hashes
from tests.support.router_polls import (
    BLOCK,
    IDLE,
    PROMPT_A,
    PROMPT_B,
    FakeCluster,
    FakeClusterConfig,
    _cached_blocks,
    _poll,
    _queued,
    _router,
    _running,
)


def test_a_request_goes_to_the_workers_holding_its_prefix():
    router = _router()
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))  # busier, within the knobs
    assert router.choose(PROMPT_B) == (1, 1)  # no cached prefix: the least loaded
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))
    # a continuation of A: 10 queued + 5 to compute beats 0 queued + 21 to compute
    assert router.choose([*PROMPT_A, 1, 2, 3, 4]) == (0, 0)
    # now 20 of its 21 tokens are cached there, but 21 queued + 1 > 0 queued + 21
    _poll(router, prefill_0=_queued(21), decode_0=_running(2))
    assert router.choose([*PROMPT_A, 1, 2, 3, 4])[0] == 1


def test_pending_tokens_count_only_the_tokens_to_compute():
    router = _router()
    router.choose(PROMPT_A)
    _poll(router)
    router.choose(PROMPT_A)
    # 16 of 17 tokens are cached (4 blocks); the engine always computes the last one
    assert router.view.prefills[0].pending_tokens == 1
    router.choose(PROMPT_B)
    assert router.view.prefills[1].pending_tokens == len(PROMPT_B)


def test_an_overloaded_holder_loses_to_the_least_loaded():
    router = _router(max_prefill_imbalance=50, max_decode_imbalance=1)
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, prefill_0=_queued(51), decode_0=_running(2))
    assert router.choose(PROMPT_A) == (1, 1)
    # now both pairs hold A: the least loaded of them takes it
    _poll(router, prefill_1=_queued(10), decode_1=_running(1))
    assert router.choose(PROMPT_A) == (1, 1)


def test_within_the_knob_a_decode_holder_wins_over_load_and_beyond_it_loses():
    router = _router(max_decode_imbalance=3)
    router.choose(PROMPT_A)
    _poll(router, decode_0=_running(3))
    assert router.choose(PROMPT_A)[1] == 0
    _poll(router, decode_0=_running(4))
    assert router.choose(PROMPT_A)[1] == 1


def test_entries_expire_unless_routed_again(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("coordinator.router.time.monotonic", lambda: now[0])
    router = _router(prefix_ttl_s=60)
    router.choose(PROMPT_A)
    now[0] += 50
    _poll(router, prefill_0=_queued(10))
    assert router.choose(PROMPT_A) == (0, 0)  # refreshed at 1050
    now[0] += 50
    _poll(router, prefill_0=_queued(10))
    assert router.choose(PROMPT_A) == (0, 0)
    now[0] += 61
    _poll(router, prefill_0=_queued(10))
    assert _cached_blocks(router, "prefill", 0, PROMPT_A) == 0
    assert router.choose(PROMPT_A)[0] == 1


def test_the_index_is_bounded_by_the_workers_blocks_least_recently_used_first():
    cluster = FakeCluster(prefills=[0], decodes=[0])
    cluster.stats[("prefill", 0)] = replace(IDLE, num_total_blocks=6)
    router = _router(cluster)
    router.choose(PROMPT_A)
    router.choose(PROMPT_B)  # 8 blocks routed, room for 6: A's two last blocks go
    assert router.cache.num_dispatched(("prefill", 0)) == 6
    assert _cached_blocks(router, "prefill", 0, PROMPT_B) == 4
    assert _cached_blocks(router, "prefill", 0, PROMPT_A) == 2  # its prefix outlives its end
    assert router.cache.num_dispatched(("decode", 0)) == 8  # decode: 100 blocks


def test_the_dispatches_keep_a_chain_root_longest_and_expires_by_last_use():
    index = CacheView(ttl_s=10)
    a, b = block_hashes(PROMPT_A, BLOCK), block_hashes(PROMPT_B, BLOCK)
    index.dispatched(("prefill", 0), a, now=0, capacity=5)
    index.dispatched(("prefill", 0), b, now=5, capacity=5)
    assert index.match_dispatched(("prefill", 0), a, now=5) == 1
    assert index.match_dispatched(("prefill", 0), b, now=5) == 4
    assert index.match_dispatched(("prefill", 0), b, now=16) == 0
    index.dispatched(("prefill", 0), a, now=20)  # capacity 0: the default
    assert index.match_dispatched(("prefill", 0), a, now=29) == 4
    index.drop(("prefill", 0))
    assert index.num_dispatched(("prefill", 0)) == 0


def test_prefix_routing_off_routes_by_load_alone():
    router = _router(prefix_routing=False)
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, prefill_0=_queued(1), decode_0=_running(1))
    assert router.choose(PROMPT_A) == (1, 1)
    assert router.view.prefills[1].pending_tokens == len(PROMPT_A)
    assert router.cache.num_dispatched(("prefill", 0)) == 0


def test_a_migration_never_gets_its_failed_pair_back():
    router = _router()
    router.choose(PROMPT_A)
    _poll(router)
    assert router.choose(PROMPT_A, {(0, 0)}) == (0, 1)  # the prefill holder, another decode
    with pytest.raises(NoWorkerError):
        router.choose(PROMPT_A, {(0, 0), (0, 1), (1, 0), (1, 1)})


def test_a_restarted_worker_loses_its_entries():
    router = _router()
    router.choose(PROMPT_A)
    router.view.fleet.pids[("prefill", 0)] = 4242
    _poll(router)
    assert router.cache.num_dispatched(("prefill", 0)) == 0
    assert router.cache.num_dispatched(("decode", 0)) == 4
    assert router.view.prefills[0].pid == 4242


def test_a_lost_worker_loses_its_entries(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("coordinator.router.time.monotonic", lambda: now[0])
    router = _router()
    router.choose(PROMPT_A)
    router.view.fleet.silent.add(("decode", 0))
    _poll(router)
    assert router.cache.num_dispatched(("decode", 0)) == 4  # stale only: its cache may be there
    now[0] += STALE_GRACE_S + 1
    _poll(router)
    assert router.cache.num_dispatched(("decode", 0)) == 0
    assert router.cache.num_dispatched(("prefill", 0)) == 4


def test_an_idle_worker_without_cached_blocks_loses_its_entries():
    router = _router()
    router.choose(PROMPT_A)
    empty = replace(IDLE, num_cached_blocks=0)
    _poll(router, prefill_0=empty)  # sent since the last poll: maybe not there yet
    assert router.cache.num_dispatched(("prefill", 0)) == 4
    _poll(router, prefill_0=replace(empty, num_running=1))  # busy: its blocks may come
    assert router.cache.num_dispatched(("prefill", 0)) == 4
    _poll(router, prefill_0=empty)
    assert router.cache.num_dispatched(("prefill", 0)) == 0


def test_single_node_prefers_the_colocated_worker_holding_the_prefix():
    cluster = FakeCluster(
        config=FakeClusterConfig("single_node"), prefills=[], decodes=[], colocated=[0, 1]
    )
    router = _router(cluster, max_decode_imbalance=2)
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, colocated_0=_running(2))
    assert router.choose(PROMPT_B) == (0, 1)
    _poll(router, colocated_0=_running(2))
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, colocated_0=_running(3))
    assert router.choose(PROMPT_A) == (0, 1)


def test_short_prompts_are_prefilled_on_the_decode_worker():
    router = _router(local_prefill_tokens=8)
    assert router.choose(list(range(30, 38))) == (None, 0)  # 8 tokens to compute: local
    prefill, holder = router.choose(PROMPT_A)  # 17: handed off (decode 0 had one pending)
    assert prefill is not None and holder == 1
    _poll(router)
    # 20 tokens, 16 of them cached on the holder: 4 to compute there, locally
    assert router.choose([*PROMPT_A, 1, 2, 3]) == (None, holder)


def test_a_long_prefill_queue_sends_shorter_prompts_to_the_decode_worker():
    router = _router(local_prefill_queue_tokens=1000)
    _poll(router, prefill_0=_queued(1500), prefill_1=_queued(1200))
    assert router.choose(PROMPT_B) == (None, 0)  # 17 tokens to compute beat a 1,200 queue
    _poll(router, prefill_0=_queued(500), prefill_1=_queued(1200))
    assert router.choose(PROMPT_B) == (0, 0)  # below the threshold: handed off
    _poll(router, prefill_0=_queued(1500), prefill_1=_queued(1200))
    assert router.choose(list(range(3, 1300)))[0] == 1  # longer than the queue: handed off


def test_requests_are_prefilled_locally_while_no_prefill_worker_answers():
    cluster = FakeCluster(silent={("prefill", 0), ("prefill", 1)})
    router = _router(cluster)
    assert router.choose(PROMPT_A) in {(None, 0), (None, 1)}
    assert router.choose(PROMPT_A, exclude={(None, 0)}) == (None, 1)
    off = _router(
        FakeCluster(silent={("prefill", 0), ("prefill", 1)}), local_prefill_fallback=False
    )
    assert off.choose(PROMPT_A)[0] in {0, 1}  # a stale prefill worker, within its grace
    cluster.silent.clear()
    asyncio.run(router.view.refresh())
    assert router.choose(PROMPT_A)[0] is not None  # back: hand-offs again


def test_single_node_never_routes_locally_by_another_name():
    cluster = FakeCluster(config=FakeClusterConfig("single_node"), prefills=[], colocated=[0])
    router = _router(cluster, local_prefill_tokens=100)
    assert router.choose(PROMPT_A) == (0, 0)


def test_a_migration_off_a_local_route_never_returns_to_it():
    router = _router(local_prefill_tokens=100)
    route = router.choose(PROMPT_A)
    assert route[0] is None
    _poll(router)
    again = router.choose(PROMPT_A, {route})
    assert again != route and again[1] != route[1]


def test_a_decode_worker_busy_prefilling_hands_short_prompts_off():
    router = _router(FakeCluster(prefills=[0], decodes=[0]), local_prefill_tokens=8)
    assert router.choose(list(range(30, 38))) == (None, 0)  # 8 to compute, nothing queued
    # the first one is still to compute there: 16 would exceed the limit, so hand off
    assert router.choose(list(range(40, 48))) == (0, 0)
    _poll(router, decode_0=_queued(6), prefill_0=_queued(100))
    assert router.choose(list(range(50, 58))) == (None, 0)  # 14 queued there < 100 on prefill


def test_the_queue_rule_counts_the_decode_workers_own_backlog():
    router = _router(FakeCluster(prefills=[0], decodes=[0]), local_prefill_queue_tokens=1000)
    _poll(router, prefill_0=_queued(1500), decode_0=_queued(1490))
    assert router.choose(PROMPT_B) == (0, 0)  # 1,490 + 17 there is no shorter than 1,500
    _poll(router, prefill_0=_queued(1500), decode_0=_queued(100))
    assert router.choose(PROMPT_B) == (None, 0)
