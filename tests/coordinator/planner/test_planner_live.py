"""The role planner on a real pool (local Ray, tiny model, pd_separate): the lease claimed on the
first prefill worker, the workers' polled figures and the service's traffic in, a decision out,
and a second coordinator left waiting while the first renews."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ActorResources, ClusterConfig
from coordinator.planner import PlannerSettings
from coordinator.planner.loop import PlannerLoop
from coordinator.planner.traffic import TrafficWindow
from coordinator.router import Router
from engine.config import CacheConfig, EngineConfig
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest

pytestmark = pytest.mark.ray

ONE_CPU = ActorResources(num_cpus=1)


def test_one_coordinator_plans_on_the_live_figures(ray_session, tiny_model_dir):
    engine = EngineConfig(model_path=str(tiny_model_dir), device="cpu",
                          cache=CacheConfig(block_size=4, num_blocks=64))  # fmt: skip
    config = ClusterConfig(engine=engine, deploy_mode="pd_separate", prefill_resources=ONE_CPU,
                           decode_resources=ONE_CPU)  # fmt: skip
    cluster = Cluster(config)
    cluster.fleet.start()
    try:

        async def scenario():
            router = Router(cluster.fleet, poll_interval_s=0.2)
            request = GenerationRequest("r", list(range(20, 60)), SamplingParams(max_new_tokens=8))
            events = [e async for e in cluster.generate(request)]
            await router.view.refresh()
            settings = PlannerSettings(mode="advise", interval_ms=500)
            traffic = TrafficWindow()
            traffic.arrived(40)
            traffic.finished(8, ttft_s=0.05, itl_s=0.01)
            first = PlannerLoop(settings, router.view, cluster.fleet, traffic, (1, 1))
            other_fleet = type("F", (), {"actors": cluster.fleet.actors,
                                         "coordinator_id": "another"})()  # fmt: skip
            second = PlannerLoop(settings, router.view, other_fleet, TrafficWindow(), (1, 1))
            decision = await first.tick()
            waiting = await second.tick()
            return events, router, decision, waiting, first

        events, router, decision, waiting, first = asyncio.run(scenario())
    finally:
        cluster.fleet.shutdown()
    assert events[-1].error is None
    assert first.leader and decision is not None and waiting is None
    assert decision.kind == "none" and decision.reason  # targets met: nothing to move
    assert {w.stats.num_steps > 0 for w in [*router.view.prefills, *router.view.decodes]} == {True}
