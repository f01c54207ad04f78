"""InferenceService with an in-process fake cluster (unit level): migration of failed requests
(before and after tokens were streamed), honest failures, the exception_config timeouts, and
admission. The real cluster is covered end to end elsewhere (tests/test_chaos.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from coordinator.errors import GenerationFailed, NoWorkerError, RequestTimeout, TooManyRequests
from coordinator.inference import InferenceService, Timeouts
from coordinator.metrics import Metrics
from coordinator.router import Router
from coordinator.routing.config import RoutingConfig
from coordinator.routing.worker_state import STALE_GRACE_S, WorkerState
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.fake_actors import reports_of
from workers.contracts import GenerationRequest, WorkerLoad

MAX_NEW = 6
# every request is handed off: no prompt is prefilled on its decode worker
NO_LOCAL_PREFILL = {"local_prefill_tokens": 0, "local_prefill_queue_tokens": 0}


@dataclass
class FakeClusterConfig:
    deploy_mode: str = "pd_separate"


@dataclass
class FakeCluster:
    """Two prefill and two decode workers running a model whose output token n is 100 + n. A
    pair in ``fail_after`` fails (cause ``cause``) once the attempt has yielded that many tokens."""

    fail_after: dict = field(default_factory=dict)
    cause: str = "worker_lost"
    fail_once: bool = False  # a pair fails on its first attempt only (an actor that restarted)
    delay_s: float = 0.0
    config: FakeClusterConfig = field(default_factory=FakeClusterConfig)
    prefills: list = field(default_factory=lambda: [0, 1])
    decodes: list = field(default_factory=lambda: [0, 1])
    calls: list = field(default_factory=list)  # (pair, request) per attempt
    closed: list = field(default_factory=list)  # attempt ids whose stream was closed

    async def reports(self, cursors):
        return reports_of(await self.loads())

    async def loads(self):
        idle = EngineStats(num_free_blocks=10, num_total_blocks=10)
        return [WorkerLoad(role, i, 0, idle) for role in ("prefill", "decode") for i in (0, 1)]

    async def stream(self, run):
        """``Cluster.stream``: the events of the run's attempt on its route."""
        request, (prefill, decode) = run.attempt, run.route
        self.calls.append(((prefill, decode), request))
        try:
            await asyncio.sleep(self.delay_s)
            pair = (prefill, decode)
            fail_after = (self.fail_after.pop if self.fail_once else self.fail_after.get)(
                pair, None
            )
            done = len(request.output_token_ids)
            for n in range(done, request.params.max_new_tokens):
                if fail_after is not None and n - done == fail_after:
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
    asyncio.run(router.refresh())
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


def test_a_stale_worker_is_chosen_only_when_no_fresh_pair_is_left():
    service = _service(FakeCluster())
    router = service.router
    _stale(router.decodes[0])
    assert {router.choose([1, 2, 3])[1] for _ in range(4)} == {1}
    _stale(router.decodes[1])
    assert router.choose([1, 2, 3])[1] in (0, 1)  # slow, not failed: no 503
    _gone(router.decodes[0])
    _gone(router.decodes[1])
    with pytest.raises(NoWorkerError):
        router.choose([1, 2, 3])


def _migrations(metrics: Metrics, cause: str) -> float:
    value = metrics.registry.get_sample_value(
        "request_migrations_total", {"model_name": "m", "reason": cause}
    )
    return value or 0.0


@pytest.mark.parametrize("fail_after", [0, 1, 4])
def test_a_failed_pair_migrates_and_the_stream_goes_on_unchanged(fail_after):
    """Before or after tokens were streamed: the same tokens, texts and counts as a run that
    never failed, under the client's request id, and the next pair is another one."""
    metrics = Metrics("m")
    cluster = FakeCluster(fail_after={(0, 0): fail_after})
    events = asyncio.run(_collect(_service(cluster, metrics=metrics)))
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]
    assert [e.num_output_tokens for e in events] == list(range(1, MAX_NEW + 1))
    assert "".join(e.text for e in events) == "".join(f"<{n}>" for n in range(MAX_NEW))
    assert {e.request_id for e in events} == {"r"}
    assert events[-1].finish_reason == FinishReason.LENGTH
    (first, request), (second, migrated) = cluster.calls
    assert first == (0, 0) and second != (0, 0)
    assert request.output_token_ids == ()
    assert migrated.request_id == "r-m1"
    assert migrated.output_token_ids == tuple(100 + n for n in range(fail_after))
    assert migrated.prompt_token_ids == (1, 2, 3)
    assert cluster.closed[0] == "r"  # the failed attempt was released before the next began
    assert _migrations(metrics, "worker_lost") == 1


def test_migrations_are_bounded_and_the_failure_is_raised_not_finished():
    metrics = Metrics("m")
    cluster = FakeCluster(fail_after={(p, d): 1 for p in (0, 1) for d in (0, 1)})
    events: list[TokenEvent] = []
    with pytest.raises(GenerationFailed, match="r failed after 2 migrations: worker_lost$"):
        asyncio.run(_collect(_service(cluster, max_retry=2, metrics=metrics), into=events))
    assert len(cluster.calls) == 3
    assert [e.token_id for e in events] == [100, 101, 102]  # one per attempt, none repeated
    assert all(not e.finished for e in events)  # no finish for a failed request
    assert _migrations(metrics, "worker_lost") == 2
    failed = metrics.registry.get_sample_value(
        "request_failed_total", {"model_name": "m", "reason": "error"}
    )
    assert failed == 1
    assert metrics.registry.get_sample_value("request_success_total", {"model_name": "m"}) is None


def test_max_retry_zero_fails_on_the_first_failure():
    cluster = FakeCluster(fail_after={(0, 0): 2}, cause="handoff_failed")
    with pytest.raises(GenerationFailed, match="after 0 migrations: handoff_failed"):
        asyncio.run(_collect(_service(cluster, max_retry=0)))
    assert len(cluster.calls) == 1


def test_a_lone_failed_pair_is_tried_again():
    """With every other pair gone, a migration goes back to the same pair (a restarted actor)."""
    cluster = FakeCluster(fail_after={(0, 0): 2}, fail_once=True)
    service = _service(cluster)
    for worker in [*service.router.prefills[1:], *service.router.decodes[1:]]:
        _gone(worker)
    events = asyncio.run(_collect(service))
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]
    assert [pair for pair, _ in cluster.calls] == [(0, 0), (0, 0)]


async def _losing_the_last_prefill(service):
    """The request's events while prefill worker 0, the last one left, goes away 50 ms in."""

    async def kill_the_rest():
        await asyncio.sleep(0.05)
        _gone(service.router.prefills[0])

    asyncio.ensure_future(kill_the_rest())
    return await _collect(service)


def test_a_migration_waits_for_a_pair_within_the_request_timeout():
    cluster = FakeCluster(fail_after={(0, 0): 1})
    no_local = RoutingConfig(local_prefill_fallback=False, **NO_LOCAL_PREFILL)
    service = _service(cluster, timeouts=Timeouts(infer=1), routing=no_local)
    _gone(service.router.prefills[1])
    _gone(service.router.decodes[1])

    cluster.delay_s = 0.1
    start = time.monotonic()
    with pytest.raises(RequestTimeout, match="Request inference timeout"):
        asyncio.run(_losing_the_last_prefill(service))
    assert 0.9 < time.monotonic() - start < 2
    assert service.in_flight == 0


def test_with_no_prefill_worker_left_a_migration_completes_on_the_decode_worker():
    cluster = FakeCluster(fail_after={(0, 0): 1})
    service = _service(cluster)
    _gone(service.router.prefills[1])
    _gone(service.router.decodes[1])

    cluster.delay_s = 0.1
    events = asyncio.run(_losing_the_last_prefill(service))
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]
    assert [pair for pair, _ in cluster.calls] == [(0, 0), (None, 0)]


def test_no_pair_at_all_is_503_at_once():
    service = _service(FakeCluster())
    for worker in service.router.decodes:
        _gone(worker)
    with pytest.raises(NoWorkerError):
        asyncio.run(_collect(service))


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
    cluster = FakeCluster(delay_s=3)
    service = _service(cluster, timeouts=timeouts)
    start = time.monotonic()
    with pytest.raises(RequestTimeout, match=message):
        asyncio.run(_collect(service, request_timeout))
    assert time.monotonic() - start < 2.5
    assert service.in_flight == 0
    assert cluster.closed == ["r"]  # the attempt was closed: its workers were told to drop it


def test_zero_timeouts_are_off():
    service = _service(FakeCluster(delay_s=0.2), timeouts=Timeouts(0, 0, 0))
    assert len(asyncio.run(_collect(service))) == MAX_NEW


def test_admission_and_draining():
    service = _service(FakeCluster(), max_requests=0)
    with pytest.raises(TooManyRequests):
        asyncio.run(_collect(service))
    service = _service(FakeCluster())
    service.draining = True
    with pytest.raises(NoWorkerError):
        asyncio.run(_collect(service))
