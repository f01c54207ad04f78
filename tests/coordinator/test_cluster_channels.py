"""The real ``Cluster`` over in-process workers (``tests.support.fake_actors``) whose token
channels come and go: a request sent to a worker whose channel dropped (its actor restarted)
attaches to the new channel and runs there, its own stream untouched by the reattachment,
whether the fleet's identity already names the new channel (a poll asked ``ready``) or still
the old one (the worker's answer says where: a welcome wait lost at most)."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ClusterConfig
from coordinator.pool.token_streams import TokenChannelError
from engine.outputs import CONSTRAINT_VIOLATED
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.support.fake_actors import MAX_NEW, FakeWorker, close_fleet, install
from workers.contracts import GenerationRequest

KEY = ("colocated", 0)


@pytest.mark.parametrize("identity", ["polled", "stale"])
def test_a_request_after_a_restart_runs_on_the_new_channel(identity):
    cluster = Cluster(ClusterConfig(deploy_mode="single_node"))
    worker = FakeWorker(*KEY)
    install(cluster.fleet, colocated=[worker])

    async def scenario() -> list:
        fleet = cluster.fleet
        await fleet.reports({})  # a poll attaches
        assert fleet.streams.connected(KEY)
        worker.restart()  # a new process, a new channel: the old one drops
        if identity == "polled":
            fleet.identities[KEY] = worker.identity()  # what the next poll's ``ready`` tells
        deadline = time.monotonic() + 5
        while fleet.streams.connected(KEY):
            assert time.monotonic() < deadline, "the drop was never seen"
            await asyncio.sleep(0.01)
        request = GenerationRequest("r1", [1, 2], SamplingParams(max_new_tokens=MAX_NEW))
        return [event async for event in cluster.generate(request, None, 0)]

    try:
        events = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        close_fleet(cluster.fleet)
    assert [(e.token_id, e.error) for e in events] == [(100 + n, None) for n in range(MAX_NEW)]


def test_a_refusal_keeps_the_workers_cause():
    """A worker refusing a constraint it cannot compile: the attempt fails with that cause
    (constraint_violated, which the coordinator never migrates), not a generic engine error."""
    cluster = Cluster(ClusterConfig(deploy_mode="single_node"))
    install(cluster.fleet, colocated=[FakeWorker(*KEY, behaviour="refuse_constraint")])

    async def scenario() -> list:
        await cluster.fleet.reports({})
        request = GenerationRequest("r1", [1, 2], SamplingParams(max_new_tokens=MAX_NEW))
        return [event async for event in cluster.generate(request, None, 0)]

    try:
        events = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        close_fleet(cluster.fleet)
    (failure,) = events
    assert failure.finish_reason == FinishReason.ERROR and failure.cause == CONSTRAINT_VIOLATED
    assert failure.error == "the lark does not compile"


def test_requests_that_find_a_channel_down_share_one_attach():
    """While a worker restarts, every request that finds its channel down tries to attach where
    its stale identity says: they share one try (a welcome wait), never queue one each, which
    held the load poll behind them for as long as the restart took."""
    cluster = Cluster(ClusterConfig(deploy_mode="single_node"))
    worker = FakeWorker(*KEY)
    install(cluster.fleet, colocated=[worker])

    async def scenario() -> tuple[list, int]:
        fleet = cluster.fleet
        await fleet.reports({})
        worker.restart()  # the identity still names the old channel, which is gone
        while fleet.streams.connected(KEY):
            await asyncio.sleep(0.01)
        streams, tries = fleet.streams, []
        connect = streams.connect

        async def counted(*args, **kwargs):
            tries.append(args)
            await connect(*args, **{**kwargs, "timeout_s": 0.5})

        streams.connect = counted  # type: ignore[method-assign]
        outcomes = await asyncio.gather(
            *(fleet.attach(KEY) for _ in range(8)), return_exceptions=True
        )
        return outcomes, len(tries)

    try:
        outcomes, tries = asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        close_fleet(cluster.fleet)
    assert tries == 1
    assert all(isinstance(o, TokenChannelError) for o in outcomes), outcomes
