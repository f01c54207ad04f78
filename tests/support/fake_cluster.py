"""A fake cluster under the real InferenceService: what the service and security tests share."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from coordinator.inference import InferenceService, Timeouts
from coordinator.metrics import Metrics
from coordinator.router import Router
from coordinator.routing.config import RoutingConfig
from coordinator.routing.worker_state import STALE_GRACE_S, WorkerState
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.support.fake_actors import reports_of
from tests.support.router_polls import NO_LOCAL_PREFILL, FakeClusterConfig
from workers.contracts import GenerationRequest, WorkerLoad

MAX_NEW = 6


@dataclass
class FakeCluster:
    """Two prefill and two decode workers running a model whose output token n is 100 + n. A
    pair in ``fail_after`` fails (cause ``cause``) once the attempt has yielded that many tokens."""

    fail_after: dict = field(default_factory=dict)
    cause: str = "worker_lost"
    fail_once: bool = False  # a pair fails on its first attempt only (an actor that restarted)
    retry_after_s: float = 0.0  # a failed attempt's decode worker expected room in this long
    delay_s: float = 0.0
    config: FakeClusterConfig = field(default_factory=FakeClusterConfig)
    prefills: list = field(default_factory=lambda: [0, 1])
    decodes: list = field(default_factory=lambda: [0, 1])
    calls: list = field(default_factory=list)  # (pair, request) per attempt
    closed: list = field(default_factory=list)  # attempt ids whose stream was closed
    pulls: list = field(default_factory=list)  # each attempt's planned prefix pull (or None)

    async def reports(self, cursors):
        return reports_of(await self.loads())

    async def loads(self):
        idle = EngineStats(num_free_blocks=10, num_total_blocks=10)
        return [WorkerLoad(role, i, 0, idle) for role in ("prefill", "decode") for i in (0, 1)]

    async def stream(self, run):
        """``Cluster.stream``: the events of the run's attempt on its route."""
        request, (prefill, decode) = run.attempt, run.route
        self.calls.append(((prefill, decode), request))
        self.pulls.append(run.pull)
        try:
            await asyncio.sleep(self.delay_s)
            pair = (prefill, decode)
            fail_after = (self.fail_after.pop if self.fail_once else self.fail_after.get)(
                pair, None
            )
            done = len(request.output_token_ids)
            for n in range(done, request.params.max_new_tokens):
                if fail_after is not None and n - done == fail_after:
                    run.retry_after_s = self.retry_after_s
                    yield TokenEvent.failure(request.request_id, "worker died", self.cause)
                    return
                last = n + 1 == request.params.max_new_tokens
                reason = FinishReason.LENGTH if last else None
                yield TokenEvent(
                    request.request_id, 100 + n, f"<{n}>", 3, n + 1, time.monotonic(), reason
                )
        finally:
            self.closed.append(request.request_id)


def _service(cluster, max_retry=5, timeouts=None, max_requests=10, metrics=None, routing=None):
    router = Router(cluster, routing=routing or RoutingConfig(**NO_LOCAL_PREFILL))
    asyncio.run(router.view.refresh())
    return InferenceService(
        cluster, router, max_requests, max_retry, timeouts or Timeouts(), metrics
    )


def _request(timeout_s: float = 600) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=MAX_NEW)
    return GenerationRequest("r", [1, 2, 3], params, 5, timeout_s)


async def _collect(service, timeout_s=600, into=None):
    events = into if into is not None else []
    async for event in service.generate(_request(timeout_s)):
        events.append(event)
    return events


def _gone(worker: WorkerState) -> None:
    """Silent for longer than the router waits for a stale worker."""
    worker.fresh, worker.last_seen = False, time.monotonic() - STALE_GRACE_S - 1


def _stale(worker: WorkerState) -> None:
    """Missed the last poll only."""
    worker.fresh = False


def _migrations(metrics: Metrics, cause: str) -> float:
    value = metrics.registry.get_sample_value(
        "request_migrations_total", {"model_name": "m", "reason": cause}
    )
    return value or 0.0


async def _losing_the_last_prefill(service):
    """The request's events while prefill worker 0, the last one left, goes away 50 ms in."""

    async def kill_the_rest():
        await asyncio.sleep(0.05)
        _gone(service.router.view.prefills[0])

    asyncio.ensure_future(kill_the_rest())
    return await _collect(service)
