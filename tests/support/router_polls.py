"""A router over a fake fleet and the polls that load it: what the routing tests share."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from coordinator.router import Router
from coordinator.routing.cache_view import CacheView
from coordinator.routing.config import RoutingConfig
from coordinator.routing.worker_state import WorkerKey
from engine.outputs import EngineStats
from engine.prefix_hash import block_hashes
from tests.support.fake_actors import reports_of
from workers.contracts import WorkerLoad

BLOCK = 4


IDLE = EngineStats(num_free_blocks=100, num_total_blocks=100, num_cached_blocks=1)


PROMPT_A = list(range(100, 117))


PROMPT_B = list(range(200, 217))


# no prompt is prefilled on its decode worker, unless a test says so
NO_LOCAL_PREFILL = {"local_prefill_tokens": 0, "local_prefill_queue_tokens": 0}


@dataclass
class FakeClusterConfig:
    deploy_mode: str = "pd_separate"


@dataclass
class FakeCluster:
    """Workers whose polled figures are ``stats`` (idle unless set) and ``pids``."""

    config: FakeClusterConfig = field(default_factory=FakeClusterConfig)
    prefills: list = field(default_factory=lambda: [0, 1])
    decodes: list = field(default_factory=lambda: [0, 1])
    colocated: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # (role, instance) -> EngineStats
    pids: dict = field(default_factory=dict)  # (role, instance) -> pid
    silent: set = field(default_factory=set)  # (role, instance) that do not answer
    by_owner: dict = field(default_factory=dict)  # (role, instance) -> requests by coordinator
    coordinator_id: str = "me"

    async def reports(self, cursors):
        return reports_of(await self.loads())

    async def loads(self) -> list[WorkerLoad]:
        single = self.config.deploy_mode == "single_node"
        roles = [("colocated", self.colocated)] if single else [("prefill", self.prefills)]
        roles += [] if single else [("decode", self.decodes)]
        return [
            WorkerLoad(
                role,
                i,
                self.pids.get((role, i), 1000 + i),
                self.stats.get((role, i), IDLE),
                requests_by_owner=self.by_owner.get((role, i), {}),
            )
            for role, workers in roles
            for i in range(len(workers))
            if (role, i) not in self.silent
        ]


def _router(cluster: FakeCluster | None = None, **routing) -> Router:
    routing = {**NO_LOCAL_PREFILL, **routing}
    router = Router(cluster or FakeCluster(), routing=RoutingConfig(block_size=BLOCK, **routing))
    asyncio.run(router.view.refresh())
    return router


def _poll(router: Router, **stats: EngineStats) -> None:
    """A poll where worker ``prefill_0`` / ``decode_1`` / ... reports ``stats``."""
    for name, value in stats.items():
        role, instance = name.rsplit("_", 1)
        router.view.fleet.stats[(role, int(instance))] = value
    asyncio.run(router.view.refresh())


def _queued(tokens: int) -> EngineStats:
    return replace(IDLE, num_waiting=1, num_prompt_tokens_to_compute=tokens)


def _running(count: int) -> EngineStats:
    return replace(IDLE, num_running=count)


def _cached_blocks(router: Router, role: str, instance: int, tokens: list[int]) -> int:
    return router.cache.match_dispatched(
        (role, instance), block_hashes(tokens, BLOCK), time.monotonic()
    )


def num_confirmed(cache: CacheView, worker: WorkerKey) -> int:
    """The block hashes ``worker``'s own events confirm in ``cache``."""
    held = cache._workers.get(worker)
    return len(held.hashes) if held is not None else 0
