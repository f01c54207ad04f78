"""InferenceService with an in-process fake cluster (unit level): retries on another pair,
the exception_config timeouts, and admission. The real cluster is covered end to end elsewhere."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from coordinator.errors import GenerationFailed, NoWorkerError, RequestTimeout, TooManyRequests
from coordinator.inference import InferenceService, Timeouts
from coordinator.router import Router
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.worker.contracts import GenerationRequest, WorkerLoad


@dataclass
class FakeClusterConfig:
    deploy_mode: str = "pd_separate"


@dataclass
class FakeCluster:
    """Two prefill and two decode workers; pairs in ``failing`` end with an error event."""

    failing: set = field(default_factory=set)
    delay_s: float = 0.0
    config: FakeClusterConfig = field(default_factory=FakeClusterConfig)
    prefills: list = field(default_factory=lambda: [0, 1])
    decodes: list = field(default_factory=lambda: [0, 1])
    calls: list = field(default_factory=list)

    async def loads(self):
        idle = EngineStats(num_free_blocks=10, num_total_blocks=10)
        return [WorkerLoad(role, i, 0, idle) for role in ("prefill", "decode") for i in (0, 1)]

    async def generate(self, request, prefill=0, decode=0):
        request_id, prompt = request.request_id, request.prompt_token_ids
        self.calls.append((prefill, decode))
        await asyncio.sleep(self.delay_s)
        now = time.monotonic()
        if (prefill, decode) in self.failing:
            yield TokenEvent(request_id, None, "", 0, 0, now, FinishReason.ERROR, "hand-off failed")
            return
        yield TokenEvent(request_id, 7, "a", len(prompt), 1, now)
        yield TokenEvent(request_id, 8, "b", len(prompt), 2, now, FinishReason.LENGTH)


def _service(cluster, max_retry=5, timeouts=None, max_requests=10) -> InferenceService:
    router = Router(cluster)
    asyncio.run(router.refresh())
    return InferenceService(cluster, router, max_requests, max_retry, timeouts or Timeouts())


async def _collect(service, timeout_s=600):
    return [
        e
        async for e in service.generate(
            GenerationRequest("r", [1, 2, 3], SamplingParams(), 5, timeout_s)
        )
    ]


def test_failed_handoff_is_retried_on_another_pair():
    cluster = FakeCluster(failing={(0, 0), (0, 1)})
    events = asyncio.run(_collect(_service(cluster)))
    assert [e.token_id for e in events] == [7, 8]
    assert cluster.calls[0] == (0, 0) and cluster.calls[-1][0] == 1
    assert len(set(cluster.calls)) == len(cluster.calls)  # never the same pair twice in a row


def test_retries_are_bounded_by_max_retry():
    cluster = FakeCluster(failing={(p, d) for p in (0, 1) for d in (0, 1)})
    with pytest.raises(GenerationFailed, match="after 3 attempts"):
        asyncio.run(_collect(_service(cluster, max_retry=2)))
    assert len(cluster.calls) == 3


@pytest.mark.parametrize(
    "timeouts, request_timeout, message",
    [
        (Timeouts(first_token=1), 600, "Request first token timeout"),
        (Timeouts(schedule=1), 600, "Request schedule timeout"),
        (Timeouts(infer=1), 600, "Request inference timeout"),
        (Timeouts(), 1, "Request inference timeout"),
    ],
)
def test_timeouts_answer_their_message(timeouts, request_timeout, message):
    service = _service(FakeCluster(delay_s=3), timeouts=timeouts)
    start = time.monotonic()
    with pytest.raises(RequestTimeout, match=message):
        asyncio.run(_collect(service, request_timeout))
    assert time.monotonic() - start < 2.5
    assert service.in_flight == 0


def test_zero_timeouts_are_off():
    service = _service(FakeCluster(delay_s=0.2), timeouts=Timeouts(0, 0, 0))
    assert len(asyncio.run(_collect(service))) == 2


def test_admission_and_draining():
    service = _service(FakeCluster(), max_requests=0)
    with pytest.raises(TooManyRequests):
        asyncio.run(_collect(service))
    service = _service(FakeCluster())
    service.draining = True
    with pytest.raises(NoWorkerError):
        asyncio.run(_collect(service))
