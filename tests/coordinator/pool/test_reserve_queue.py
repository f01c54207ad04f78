"""A coordinator's queue of reserve calls beyond the places a decode worker lets wait
(coordinator/pool/reserve_queue.py): places in the worker's order, refusals by the pace of
grants, and nothing lost to a caller that goes away; each coordinator's share of a worker's
places."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ClusterConfig
from coordinator.pool.reserve_queue import (
    ADMIT_MARGIN,
    NO_ESTIMATE_RETRY_S,
    Late,
    ReserveQueue,
    share_of_places,
)
from engine.kv_events import KvEventBatch
from engine.outputs import EngineStats
from workers.contracts import WorkerLoad, WorkerReport
from workers.runtime import MAX_WAITING_RESERVATIONS

FAR = 3600.0  # seconds a test's waiter may wait: never reached


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _holder(queue: ReserveQueue, priority: int, deadline: float, log: list, name: str):
    """Take a place, note it, and hold it until cancelled."""
    async with queue.place(priority, deadline):
        log.append(name)
        await asyncio.Event().wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _paced(clock: Clock, log: list) -> tuple[ReserveQueue, list[asyncio.Future]]:
    """A queue of one place, taken, with one waiter behind it, that has seen one grant a second
    while waiters waited (three of them: the pace is known)."""
    queue = ReserveQueue(places=1, clock=clock)
    held = [asyncio.ensure_future(_holder(queue, 5, FAR, log, "first"))]
    await _settle()
    held.append(asyncio.ensure_future(_holder(queue, 5, FAR, log, "w")))
    await _settle()
    for second in (1.0, 2.0, 3.0):
        clock.now = second
        queue.answered(True)
    assert queue.pace.blocks_per_s(clock.now) == pytest.approx(1.0)
    return queue, held


async def _let_go(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_places_go_at_once_then_in_priority_and_arrival_order():
    async def scenario():
        queue, log = ReserveQueue(places=2), []
        deadline = time.monotonic() + FAR
        held = [asyncio.ensure_future(_holder(queue, 5, deadline, log, n)) for n in "ab"]
        await _settle()
        assert log == ["a", "b"] and queue.out == 2 and len(queue) == 0
        waiting = [
            asyncio.ensure_future(_holder(queue, p, deadline, log, n))
            for n, p in (("c", 5), ("d", 1), ("e", 5))
        ]
        await _settle()
        assert log == ["a", "b"] and len(queue) == 3
        held[0].cancel()
        await _settle()
        assert log == ["a", "b", "d"]  # priority 1 first, though it came later
        held[1].cancel()
        await _settle()
        assert log == ["a", "b", "d", "c"] and queue.out == 2 and len(queue) == 1
        for task in waiting:
            task.cancel()
        await asyncio.gather(*held, *waiting, return_exceptions=True)
        assert queue.out == 0 and len(queue) == 0

    asyncio.run(scenario())


def test_a_waiter_expected_too_late_is_refused_at_once_with_the_estimate():
    async def scenario():
        clock, log = Clock(), []
        queue, held = await _paced(clock, log)
        # one call out and one waiter ahead: a third is granted in ~3 s; 2 s is too little
        with pytest.raises(Late) as refused:
            async with queue.place(5, clock.now + 2.0):
                pass
        assert refused.value.retry_after_s == pytest.approx(3.0)
        assert "expected in 3 s" in str(refused.value) and queue.num_refused_early == 1
        # 3 s with the arrival's margin is enough: it waits
        enough = clock.now + 3.0 * ADMIT_MARGIN
        held.append(asyncio.ensure_future(_holder(queue, 5, enough, log, "enough")))
        await _settle()
        assert len(queue) == 2 and not held[-1].done()
        await _let_go(held)
        assert queue.out == 0 and len(queue) == 0

    asyncio.run(scenario())


def test_the_time_a_grant_takes_to_its_first_token_counts_in_the_estimate():
    async def scenario():
        clock, log = Clock(), []
        queue, held = await _paced(clock, log)
        for seconds in (0.5, 1.0, 4.0):
            queue.settled(seconds)
        assert queue.after_grant_s == 1.0  # the median
        # granted in ~3 s (with the margin 3.75), its first token ~1 s later: 4.5 s is too
        # little, 4.75 s enough
        with pytest.raises(Late) as refused:
            async with queue.place(5, clock.now + 4.5):
                pass
        assert "first token 1 s later" in str(refused.value)
        enough = clock.now + 3.0 * ADMIT_MARGIN + 1.0
        held.append(asyncio.ensure_future(_holder(queue, 5, enough, log, "enough")))
        await _settle()
        assert len(queue) == 2 and not held[-1].done()
        await _let_go(held)

    asyncio.run(scenario())


def test_a_waiter_let_in_is_refused_later_only_when_the_pace_fell_past_the_margin():
    async def scenario():
        clock, log = Clock(), []
        queue, held = await _paced(clock, log)
        # expected in 3 s at 1 grant/s, 3.75 s with the margin: 3.9 s lets it in
        held.append(asyncio.ensure_future(_holder(queue, 5, clock.now + 3.9, log, "x")))
        await _settle()
        assert len(queue) == 2 and not held[-1].done()
        # 0.2 s without a grant: the pace is 2 / 2.2 s, x expected in 3.3 s of the 3.7 s it has
        # left (3.6 s with the margin, which an arrival would need, but x is judged plainly)
        clock.now += 0.2
        held.append(asyncio.ensure_future(_holder(queue, 5, FAR, log, "later")))
        await _settle()
        assert len(queue) == 3 and not held[2].done() and queue.num_refused_early == 0
        # 1 s without a grant: 2 / 3 s, x expected in 4.5 s of the 2.9 s left: refused now
        clock.now += 0.8
        held.append(asyncio.ensure_future(_holder(queue, 5, FAR, log, "last")))
        await _settle()
        assert held[2].done() and isinstance(held[2].exception(), Late)
        assert queue.num_refused_early == 1 and len(queue) == 3
        await _let_go(held)
        assert queue.out == 0 and len(queue) == 0

    asyncio.run(scenario())


def test_a_waiter_whose_time_is_up_here_is_refused_and_loses_no_place():
    async def scenario():
        queue, log = ReserveQueue(places=1), []
        held = asyncio.ensure_future(_holder(queue, 5, time.monotonic() + FAR, log, "a"))
        await _settle()
        with pytest.raises(Late) as refused:
            async with queue.place(5, time.monotonic() + 0.05):
                pass
        assert refused.value.retry_after_s == NO_ESTIMATE_RETRY_S  # no pace yet
        assert queue.out == 1 and len(queue) == 0
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        assert queue.out == 0

    asyncio.run(scenario())


def test_a_place_given_as_its_caller_goes_away_passes_to_the_next():
    async def scenario():
        queue, log = ReserveQueue(places=1), []
        deadline = time.monotonic() + FAR
        held = asyncio.ensure_future(_holder(queue, 5, deadline, log, "a"))
        await _settle()
        gone = asyncio.ensure_future(_holder(queue, 5, deadline, log, "gone"))
        after = asyncio.ensure_future(_holder(queue, 5, deadline, log, "after"))
        await _settle()
        held.cancel()
        await asyncio.sleep(0)  # "gone" is given the place; cancelled before it runs
        gone.cancel()
        await _settle()
        assert log == ["a", "after"] and queue.out == 1
        after.cancel()
        await asyncio.gather(held, gone, after, return_exceptions=True)
        assert queue.out == 0 and len(queue) == 0

    asyncio.run(scenario())


def test_coordinators_sharing_a_worker_each_keep_out_their_share_of_its_places():
    assert [share_of_places(48, n) for n in (0, 1, 2, 3, 5, 48, 100)] == [48, 48, 24, 16, 9, 1, 1]


def test_a_queue_resized_down_lets_calls_out_end_and_up_hands_places_at_once():
    async def scenario():
        queue, log = ReserveQueue(places=3), []
        held = [
            asyncio.ensure_future(_holder(queue, 5, time.monotonic() + FAR, log, n))
            for n in "abcde"
        ]
        await _settle()
        assert log == ["a", "b", "c"] and len(queue) == 2
        queue.resize(1)  # another coordinator came: the calls out stay, none more goes
        held[0].cancel()
        await _settle()
        assert log == ["a", "b", "c"] and queue.out == 2
        queue.resize(4)  # it left: two places free now, taken at once
        await _settle()
        assert log == ["a", "b", "c", "d", "e"] and queue.out == 4 and len(queue) == 0
        await _let_go(held)
        assert queue.out == 0

    asyncio.run(scenario())


def test_the_cluster_resizes_each_decode_workers_queue_to_its_share_at_each_poll():
    cluster = Cluster(ClusterConfig(deploy_mode="pd_separate"))

    def report(role: str, instance: int, coordinators: int) -> WorkerReport:
        load = WorkerLoad(role, instance, pid=1, stats=EngineStats())
        return WorkerReport(load, KvEventBatch("e", b"", 0), num_coordinators=coordinators)

    cluster.share_places([report("prefill", 0, 4), report("decode", 0, 3), report("decode", 1, 1)])
    queues = cluster._reserve_queues
    assert set(queues) == {("decode", 0), ("decode", 1)}  # a prefill worker takes no reserve
    assert queues[("decode", 0)].places == MAX_WAITING_RESERVATIONS // 3
    assert queues[("decode", 1)].places == MAX_WAITING_RESERVATIONS
    cluster.share_places([report("decode", 0, 1)])  # the others went away
    assert queues[("decode", 0)].places == MAX_WAITING_RESERVATIONS
