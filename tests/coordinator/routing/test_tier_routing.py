"""KV tiers in the routers' mirror: a demotion keeps a block the worker's (in its tier) until the
worker says the tier lost it, a snapshot carries the tiers' blocks, and a prefix in a tier counts
for what its load saves, as the worker measures it."""

from __future__ import annotations

import pytest

from coordinator.routing.cache_view import CacheView
from coordinator.routing.tier_weights import PRIOR_WEIGHT, tier_weights
from engine.kv_events import DEMOTED, DROPPED, REMOVED, STORED, KvEventLog, tier_kind
from engine.kv_tiers.file_tier import TierStats
from engine.outputs import EngineStats

H = [bytes([i]) * 16 for i in range(8)]
KEY = ("decode", 0)
WEIGHTS = {"host": 0.9, "disk": 0.4}


def _synced() -> tuple[KvEventLog, CacheView]:
    log, view = KvEventLog(b"root"), CacheView(ttl_s=600.0)
    view.apply(KEY, log.since(*view.cursor(KEY)))
    view.load(KEY, log.snapshot([]))
    return log, view


def _apply(log: KvEventLog, view: CacheView) -> None:
    assert not view.apply(KEY, log.since(*view.cursor(KEY)))


def test_a_demoted_block_stays_the_workers_in_its_tier_until_dropped():
    log, view = _synced()
    for h in H[:4]:
        log.record(STORED, h)
    log.record(tier_kind(DEMOTED, "host"), H[2])
    log.record(tier_kind(DEMOTED, "disk"), H[3])
    _apply(log, view)
    assert view.match_confirmed(KEY, H[:4]) == 2  # without weights a tier counts nothing
    assert view.match_confirmed(KEY, H[:4], WEIGHTS) == pytest.approx(2 + 0.9 + 0.4)
    log.record(tier_kind(DROPPED, "disk"), H[2])  # another tier's loss: H[2] is still in host
    log.record(tier_kind(DROPPED, "disk"), H[3])
    _apply(log, view)
    assert view.match_confirmed(KEY, H[:4], WEIGHTS) == pytest.approx(2.9)
    log.record(STORED, H[2])  # loaded back into the cache
    log.record(REMOVED, H[1])
    _apply(log, view)
    assert view.match_confirmed(KEY, H[:3], WEIGHTS) == 1  # the chain breaks at H[1]
    assert view.match_confirmed(KEY, H[2:3], WEIGHTS) == 1


def test_a_snapshot_carries_the_tiers_blocks():
    log, view = _synced()
    view.load(KEY, log.snapshot([H[0]], ((H[1], "host"), (H[2], "disk"))))
    assert view.match_confirmed(KEY, H[:3], WEIGHTS) == pytest.approx(2.3)


def test_a_tiers_weight_is_the_compute_its_loads_save():
    def stats(load_seconds: float, hits: int) -> EngineStats:
        tier = TierStats("disk", hits=hits, load_seconds=load_seconds)
        return EngineStats(kv_tiers=(tier,), prompt_token_seconds=0.001)

    assert tier_weights(stats(0.0, 0), 16) == {"disk": PRIOR_WEIGHT}  # nothing measured yet
    assert tier_weights(stats(0.004, 1), 16) == {"disk": pytest.approx(0.75)}  # 4 of 16 ms
    assert tier_weights(stats(0.1, 1), 16) == {"disk": 0.0}  # slower than computing
    assert tier_weights(EngineStats(), 16) == {}
