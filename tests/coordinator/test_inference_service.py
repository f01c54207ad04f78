"""InferenceService with an in-process fake cluster (unit level): migration of failed requests
(before and after tokens were streamed), honest failures, the exception_config timeouts, and
admission. The real cluster is covered end to end elsewhere (tests/coordinator/test_chaos.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.cluster import POOL_FULL, WORKER_RESTARTING
from coordinator.errors import (
    RETRY_BUSY_S,
    ConstraintViolated,
    GenerationFailed,
    NoWorkerError,
    RequestTimeout,
    TooManyRequests,
)
from coordinator.inference import Timeouts
from coordinator.metrics import Metrics
from coordinator.routing.config import RoutingConfig
from coordinator.routing.pull_cost import PullPlan
from engine.outputs import CONSTRAINT_VIOLATED, TokenEvent
from engine.request import FinishReason
from tests.support.fake_cluster import (
    MAX_NEW,
    FakeCluster,
    _collect,
    _gone,
    _losing_the_last_prefill,
    _migrations,
    _service,
    _stale,
)
from tests.support.router_polls import NO_LOCAL_PREFILL


def test_a_stale_worker_is_chosen_only_when_no_fresh_pair_is_left():
    service = _service(FakeCluster())
    router = service.router
    _stale(router.view.decodes[0])
    assert {router.choose([1, 2, 3])[1] for _ in range(4)} == {1}
    _stale(router.view.decodes[1])
    assert router.choose([1, 2, 3])[1] in (0, 1)  # slow, not failed: no 503
    _gone(router.view.decodes[0])
    _gone(router.view.decodes[1])
    with pytest.raises(NoWorkerError):
        router.choose([1, 2, 3])


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
    for worker in [*service.router.view.prefills[1:], *service.router.view.decodes[1:]]:
        _gone(worker)
    events = asyncio.run(_collect(service))
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]
    assert [pair for pair, _ in cluster.calls] == [(0, 0), (0, 0)]


def test_a_migration_waits_for_a_pair_within_the_request_timeout():
    cluster = FakeCluster(fail_after={(0, 0): 1})
    no_local = RoutingConfig(local_prefill_fallback=False, **NO_LOCAL_PREFILL)
    service = _service(cluster, timeouts=Timeouts(infer=1), routing=no_local)
    _gone(service.router.view.prefills[1])
    _gone(service.router.view.decodes[1])

    cluster.delay_s = 0.1
    start = time.monotonic()
    with pytest.raises(RequestTimeout, match="Request inference timeout"):
        asyncio.run(_losing_the_last_prefill(service))
    assert 0.9 < time.monotonic() - start < 2
    assert service.in_flight == 0


def test_with_no_prefill_worker_left_a_migration_completes_on_the_decode_worker():
    cluster = FakeCluster(fail_after={(0, 0): 1})
    service = _service(cluster)
    _gone(service.router.view.prefills[1])
    _gone(service.router.view.decodes[1])

    cluster.delay_s = 0.1
    events = asyncio.run(_losing_the_last_prefill(service))
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]
    assert [pair for pair, _ in cluster.calls] == [(0, 0), (None, 0)]


def test_no_pair_at_all_is_503_at_once():
    service = _service(FakeCluster())
    for worker in service.router.view.decodes:
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


def test_a_pool_with_no_room_is_429_at_once_never_migrated():
    """A decode worker with no room (every block taken as long as the request could wait, or its
    waiting hand-offs at their cap) is the pool being full: 429 now, not a retry elsewhere."""
    metrics = Metrics("m")
    cluster = FakeCluster(fail_after={(p, d): 0 for p in (0, 1) for d in (0, 1)}, cause=POOL_FULL)
    with pytest.raises(TooManyRequests, match="no room for the request in the pool now"):
        asyncio.run(_collect(_service(cluster, metrics=metrics)))
    assert len(cluster.calls) == 1
    assert not _migrations(metrics, POOL_FULL)
    refused = metrics.registry.get_sample_value(
        "request_failed_total", {"model_name": "m", "reason": "too_many_requests"}
    )
    assert refused == 1


def test_a_full_pool_says_when_a_retry_may_find_room_as_its_decode_worker_expects():
    """``Retry-After``: the decode worker's estimate in whole seconds (at least 1, at most
    ``MAX_RETRY_AFTER_S``); without one, ``RETRY_BUSY_S``."""
    pairs = {(p, d): 0 for p in (0, 1) for d in (0, 1)}
    for expected_s, retry_after_s in ((7.2, 8), (0.3, 1), (5000.0, 600), (0.0, RETRY_BUSY_S)):
        cluster = FakeCluster(fail_after=dict(pairs), cause=POOL_FULL, retry_after_s=expected_s)
        with pytest.raises(TooManyRequests) as refused:
            asyncio.run(_collect(_service(cluster)))
        assert refused.value.retry_after_s == retry_after_s


def test_an_attempt_that_found_its_worker_restarting_spends_no_retry():
    """With ``max_retry`` 0, a call that reached an actor Ray is restarting is tried again (after
    a pause) instead of failing the request."""
    metrics = Metrics("m")
    cluster = FakeCluster(
        fail_after={(p, d): 0 for p in (0, 1) for d in (0, 1)},
        cause=WORKER_RESTARTING,
        fail_once=True,
    )
    events = asyncio.run(_collect(_service(cluster, max_retry=0, metrics=metrics)))
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]
    assert len(cluster.calls) == 3  # the first pair, another that was restarting too, a third
    assert _migrations(metrics, WORKER_RESTARTING) == 1  # one run of restarting attempts, unspent


def test_a_new_request_finding_every_worker_at_its_cap_is_429_a_migrating_one_is_not():
    service = _service(FakeCluster(), routing=RoutingConfig(max_requests_per_worker=3))
    router = service.router
    for worker in router.view.decodes:
        worker.num_others_requests = 3  # other coordinators' requests, as polled
    with pytest.raises(TooManyRequests, match="every worker holds as many requests"):
        router.choose([1, 2, 3], holder="a")
    assert router.choose([1, 2, 3], {(0, 0)}, capped=False) != (0, 0)
    router.view.decodes[1].num_others_requests = 1
    assert router.choose([1, 2, 3], holder="a")[1] == 1
    assert router.choose([1, 2, 3], holder="b")[1] == 1
    with pytest.raises(TooManyRequests):  # its own two open requests count, exactly
        router.choose([1, 2, 3], holder="c")
    with pytest.raises(TooManyRequests):
        asyncio.run(_collect(service))
    router.release("a")  # a request ended: its place is free at once, not at the next poll
    assert router.choose([1, 2, 3], holder="c")[1] == 1
    router.release("a")  # released twice: counted once
    assert router.view.decodes[1].num_requests_held == 3


def test_a_migrating_request_moves_its_place_and_every_ended_request_frees_its_own():
    service = _service(FakeCluster(fail_after={(0, 0): 1}))
    router = service.router
    assert asyncio.run(_collect(service))[-1].finish_reason == FinishReason.LENGTH
    assert [w.num_own_requests for w in router.view.decodes] == [0, 0]
    assert router.choose([1, 2, 3], holder="m") == (0, 0)
    assert router.choose([1, 2, 3], {(0, 0)}, capped=False, holder="m")[1] == 1
    assert [w.num_own_requests for w in router.view.decodes] == [0, 1]
    router.release("m")
    assert [w.num_own_requests for w in router.view.decodes] == [0, 0]


def test_a_constraint_violation_fails_at_once_never_migrated():
    """A grammar the output cannot follow fails the same on any pair: the failure is raised
    after the tokens so far (no finish), naming the cause, counted once, with no migration."""
    metrics = Metrics("m")
    cluster = FakeCluster(
        fail_after={(p, d): 2 for p in (0, 1) for d in (0, 1)}, cause=CONSTRAINT_VIOLATED
    )
    events: list[TokenEvent] = []
    with pytest.raises(ConstraintViolated, match="r failed: constraint_violated: worker died"):
        asyncio.run(_collect(_service(cluster, max_retry=3, metrics=metrics), into=events))
    assert len(cluster.calls) == 1 and cluster.closed == ["r"]
    assert [e.token_id for e in events] == [100, 101]
    assert all(not e.finished for e in events)
    assert not _migrations(metrics, CONSTRAINT_VIOLATED)
    failed = metrics.registry.get_sample_value(
        "request_failed_total", {"model_name": "m", "reason": "error"}
    )
    assert failed == 1
    assert ConstraintViolated.status == 422 and issubclass(ConstraintViolated, GenerationFailed)


def test_each_attempt_carries_the_pull_its_router_planned():
    service = _service(FakeCluster(fail_after={(0, 0): 1}))
    plans = iter([PullPlan(("decode", 1), 3), None])
    service.router.take_pull = lambda holder: next(plans)
    asyncio.run(_collect(service))
    assert service.cluster.pulls == [PullPlan(("decode", 1), 3), None]  # the migration: none
