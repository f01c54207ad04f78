"""``/v1/instances``: each worker's polled load with what the worker is (its ``ready`` answer),
asked once per worker process: again only when a poll shows another pid (Ray restarted the
actor). A real Coordinator (fleet, router, manage app) over in-process fake actors, without Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from coordinator.routing import worker_state
from coordinator.server import Coordinator
from tests.support.coordinator_configs import config_with, get
from tests.support.fake_actors import FakeWorker, close_fleet, install

STATUS = ("status", "seconds_since_report")


@pytest.fixture
def coordinator() -> Iterator[tuple[Coordinator, list[FakeWorker]]]:
    """A coordinator whose fleet is a prefill and a decode fake, each asked ``ready`` once (as
    at start); their token channels closed after the test."""
    coordinator = Coordinator(config_with())
    workers = [FakeWorker("prefill", 0), FakeWorker("decode", 0)]
    install(coordinator.fleet, prefills=[workers[0]], decodes=[workers[1]])
    yield coordinator, workers
    close_fleet(coordinator.fleet)


def _polled_instances(coordinator: Coordinator, polls: int = 1) -> list[dict]:
    for _ in range(polls):
        asyncio.run(coordinator.router.view.refresh())
    return get(coordinator.manage_app(), "/v1/instances").json()["instances"]


def _without(instance: dict, keys: tuple[str, ...]) -> dict:
    return {key: value for key, value in instance.items() if key not in keys}


def test_instances_carry_each_workers_identity_asked_once(coordinator):
    coordinator, workers = coordinator
    instances = _polled_instances(coordinator, polls=3)
    assert [(i["role"], i["pid"], i["node_ip"]) for i in instances] == [
        ("prefill", 1, "10.0.0.1"),
        ("decode", 1, "10.0.0.1"),
    ]
    assert all(i["kernels"] == {"attention_cpu": "built"} for i in instances)
    assert [worker.num_ready for worker in workers] == [1, 1]  # not once per poll


def test_instances_after_a_worker_restart_carry_the_new_process(coordinator):
    coordinator, (prefill, decode) = coordinator
    before = _polled_instances(coordinator)
    decode.restart()
    after = _polled_instances(coordinator, polls=2)
    assert _without(after[0], STATUS) == _without(before[0], STATUS)
    assert after[1]["pid"] == 2 and after[1]["kernels"] == {"attention_cpu": "cached"}
    process = ("pid", "kernels", "token_channel", *STATUS)  # what a new process has of its own
    assert _without(after[1], process) == _without(before[1], process)
    assert after[1]["token_channel"] == decode.sender.endpoint != before[1]["token_channel"]
    assert (prefill.num_ready, decode.num_ready) == (1, 2)
    assert coordinator.fleet.identity(coordinator.router.view.latest_loads[1]).pid == 2
    streams = coordinator.fleet._streams  # the last poll's loop's: attached to the new channel
    assert streams is not None and streams.endpoint_of(("decode", 0)) == decode.sender.endpoint


def test_instances_show_a_silent_worker_as_stale_with_its_last_load(coordinator, monkeypatch):
    coordinator, (prefill, _decode) = coordinator
    before = _polled_instances(coordinator)
    assert [i["status"] for i in before] == ["answering", "answering"]
    assert all(0 <= i["seconds_since_report"] < 1 for i in before)
    prefill.stop_answering()  # as in a long step: no answer within the poll's timeout
    after = _polled_instances(coordinator)
    assert [i["status"] for i in after] == ["stale", "answering"]
    assert after[0]["seconds_since_report"] > before[0]["seconds_since_report"]
    assert _without(after[0], STATUS) == _without(before[0], STATUS)  # its last load, kept
    monkeypatch.setattr(worker_state, "STALE_GRACE_S", 0.0)
    assert [i["status"] for i in _polled_instances(coordinator)] == ["lost", "answering"]


def test_instances_list_a_worker_never_heard_from(coordinator):
    coordinator, (prefill, _decode) = coordinator
    prefill.stop_answering()
    instances = _polled_instances(coordinator)
    assert instances[0] == {
        "role": "prefill",
        "instance": 0,
        "status": "stale",
        "seconds_since_report": None,
    }
    assert instances[1]["status"] == "answering"
