"""However a request ends — it finishes, is aborted by id, times out, fails once its migrations
are used up, finds no worker, or its client goes away (cancelled) — nothing on the coordinator
names it afterwards, and every worker was told to drop it.

The real ``InferenceService``, ``Router`` and ``Cluster`` run over in-process workers
(``tests.support.fake_actors``), in each deploy path: a hand-off, a decode worker prefilling
itself, and ``single_node``. Nothing is looked up by hand: every object of the coordinator's own
classes reachable from the service (the cluster, the router and their parts), through every dict,
list, tuple and set, and through every pending task's local variables, is searched for the request's
id or anything carrying it; so a table added later that keeps a request is caught too.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ClusterConfig
from coordinator.errors import GenerationFailed, NoWorkerError, RequestTimeout
from coordinator.inference import InferenceService, Timeouts
from coordinator.metrics import Metrics
from coordinator.request_run import RunPhase
from coordinator.router import Router
from coordinator.routing.config import RoutingConfig
from coordinator.routing.worker_state import STALE_GRACE_S
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.support.fake_actors import MAX_NEW, FakeWorker, close_fleet, install
from workers.contracts import GenerationRequest

REQUEST_ID = "req-leak-7f3a"
DECODE_SIDE = (["decode"], ["colocated"])
MODES = {  # deploy mode, routing
    "handoff": ("pd_separate", RoutingConfig()),
    "local_prefill": ("pd_separate", RoutingConfig(local_prefill_tokens=10_000)),
    "single_node": ("single_node", RoutingConfig()),
}


def references(root: Any, request_id: str) -> list[str]:
    """Paths from ``root`` to whatever names ``request_id``: a string holding it, or an object
    whose ``request_id`` holds it (its RequestRun, request, attempts, events)."""
    found: list[str] = []
    seen: set[int] = set()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, str):
            if request_id in value:
                found.append(path)
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        if request_id in str(getattr(value, "request_id", "") or ""):
            found.append(path)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                walk(key, f"{path}{{key {key!r}}}")
                walk(item, f"{path}[{key!r}]")
        elif isinstance(value, list | tuple | set | frozenset | deque):
            for i, item in enumerate(list(value)):
                walk(item, f"{path}[{i}]")
        elif isinstance(value, asyncio.Future):
            walk(_pending_locals(value), f"{path}<task locals>")
        elif type(value).__module__.startswith("coordinator."):
            for name, item in _fields(value).items():
                walk(item, f"{path}.{name}")

    walk(root, type(root).__name__)
    return found


def _pending_locals(future: asyncio.Future) -> dict[str, Any]:
    coroutine = future.get_coro() if isinstance(future, asyncio.Task) else None
    frame = getattr(coroutine, "cr_frame", None)
    return dict(frame.f_locals) if frame is not None and not future.done() else {}


def _fields(value: Any) -> dict[str, Any]:
    names = [n for cls in type(value).__mro__ for n in getattr(cls, "__slots__", ())]
    return {**getattr(value, "__dict__", {}), **{n: getattr(value, n, None) for n in names}}


def _service(mode: str, behaviour: str | None, **options: Any) -> InferenceService:
    deploy_mode, routing = MODES[mode]
    cluster = Cluster(ClusterConfig(deploy_mode=deploy_mode))
    if deploy_mode == "single_node":
        install(cluster.fleet, colocated=[FakeWorker("colocated", i, behaviour) for i in range(2)])
    else:
        prefills = [FakeWorker("prefill", i) for i in range(2)]
        install(cluster.fleet, prefills, [FakeWorker("decode", i, behaviour) for i in range(2)])
    router = Router(cluster.fleet, routing=routing)
    return InferenceService(cluster, router, 10, 2, Timeouts(**options), Metrics("m"))


def _events(service: InferenceService) -> Any:
    request = GenerationRequest(REQUEST_ID, [1, 2, 3], SamplingParams(max_new_tokens=MAX_NEW))
    return service.generate(request)


async def _collect(service: InferenceService) -> list:
    return [event async for event in _events(service)]


async def _first_token(service: InferenceService) -> None:
    """Wait until the request streamed a token and stalls, decoding on the worker it names;
    meanwhile the search finds its run (in the registry)."""
    deadline = time.monotonic() + 10
    while not _decoding(service):
        assert time.monotonic() < deadline, "not decoding after a first token within 10 s"
        await asyncio.sleep(0.001)
    run = service.runs[REQUEST_ID]
    assert run.phase == RunPhase.DECODING and [w.role for w in run.workers] in DECODE_SIDE
    assert any(".runs[" in path for path in references(service, REQUEST_ID))


def _decoding(service: InferenceService) -> bool:
    """Whether the request streamed a token and went on to decode (in ``pd_separate`` the
    prefill worker's hand-off result comes on its channel after that token: until it has been
    read the run is still handing off)."""
    run = service.runs.get(REQUEST_ID)
    return run is not None and bool(run.output_token_ids) and run.phase == RunPhase.DECODING


async def _finish(service: InferenceService) -> None:
    events = await _collect(service)
    assert [e.token_id for e in events] == [100 + n for n in range(MAX_NEW)]


async def _abort(service: InferenceService) -> None:
    task = asyncio.ensure_future(_collect(service))
    await _first_token(service)
    assert await service.abort(REQUEST_ID)
    assert (await task)[-1].finish_reason == FinishReason.ABORT


async def _timeout(service: InferenceService) -> None:
    task = asyncio.ensure_future(_collect(service))
    await _first_token(service)
    with pytest.raises(RequestTimeout):
        await task


async def _exhausted(service: InferenceService) -> None:
    with pytest.raises(GenerationFailed, match="after 2 migrations: worker_lost"):
        await _collect(service)


async def _unavailable(service: InferenceService) -> None:
    for worker in service.router.view.decodes:
        worker.fresh, worker.last_seen = False, time.monotonic() - STALE_GRACE_S - 1
    with pytest.raises(NoWorkerError):
        await _collect(service)


async def _cancelled(service: InferenceService) -> None:
    task = asyncio.ensure_future(_collect(service))
    await _first_token(service)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


ENDS = {  # how it ends: the driver, the decode-side workers' behaviour, timeouts, failure reason
    "finished": (_finish, None, {}, None),
    "aborted": (_abort, "stall", {}, "aborted"),
    "timed_out": (_timeout, "stall", {"infer": 0.3}, "timeout"),
    "migrations_exhausted": (_exhausted, "fail", {}, "error"),
    "no_worker": (_unavailable, None, {}, "unavailable"),
    "cancelled": (_cancelled, "stall", {}, "aborted"),
}


async def _settled(service: InferenceService) -> list[str]:
    """What still names the request once background aborts had a second to land."""
    deadline = time.monotonic() + 1
    while (found := references(service, REQUEST_ID)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return found


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("end", ENDS)
def test_an_ended_request_is_named_nowhere(end, mode):
    drive, behaviour, timeouts, reason = ENDS[end]

    async def scenario(service: InferenceService) -> None:
        await service.router.view.refresh()
        await drive(service)
        assert await _settled(service) == []

    service = _service(mode, behaviour, **timeouts)
    fleet = service.cluster.fleet
    try:
        asyncio.run(scenario(service))
    finally:
        close_fleet(fleet)
    assert all(not w.held for w in [*fleet.prefills, *fleet.decodes, *fleet.colocated])
    assert service.in_flight == 0 and not service.runs
    metrics = service.metrics
    assert _sample(metrics, "num_requests_waiting") == _sample(metrics, "num_requests_running") == 0
    assert _sample(metrics, "request_success_total") == (reason is None)
    if reason is not None:
        assert _sample(metrics, "request_failed_total", reason=reason) == 1


def test_the_search_sees_through_containers_objects_and_tasks():
    class Holder:  # not a coordinator class: found by its request_id, not searched into
        request_id = REQUEST_ID
        note = REQUEST_ID

    async def working_for(request_id: str) -> None:
        await asyncio.sleep(1)

    service = _service("handoff", None)

    async def search() -> list[str]:
        service.cluster._releases.add(asyncio.ensure_future(working_for(REQUEST_ID)))
        await asyncio.sleep(0)  # the task is under way
        service.router.cache.extra = [{"k": (f"{REQUEST_ID}-m1",)}, Holder()]  # type: ignore
        found = references(service, REQUEST_ID)
        for task in service.cluster._releases:
            task.cancel()
        return found

    try:
        found = asyncio.run(search())
    finally:
        close_fleet(service.cluster.fleet)
    assert found == [
        "InferenceService.cluster._releases[0]<task locals>['request_id']",
        "InferenceService.router.cache.extra[0]['k'][0]",
        "InferenceService.router.cache.extra[1]",
    ]
