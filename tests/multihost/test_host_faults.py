"""Hosts failing under load (ZMQ, encrypted, across network namespaces): the decode host's cable
pulled mid-stream until Ray declares the node dead, then the host rebooted; the prefill host's
raylet killed, then the host rebooted. Clients on the head host send streaming and
non-streaming requests without pause. Every request must complete with exactly the text of an
undisturbed run (migrated once its pair came back) or end with an honest error, none past its
timeout, and a client error only where the coordinator counted the request failed with every
migration spent or with no pair to take it (``request_failed_total``: no timeout, nothing
refused otherwise); new requests are served again once the host is back, the coordinator lists the
restarted worker on its host, and once idle no worker holds anything.

Migrations are bounded by what the fault does: each request migrates at most ``max_retry``
times, and only one in flight between the fault and the recovery can; with the decode host's
cable out, every request in flight through the whole outage that still finished had lost its
decode worker, so it migrated at least once (a prefill host's loss touches only the requests it
is computing at that moment, which may be none: no lower bound)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

from testbed.netns import Host, enter_netns
from testbed.ray_hosts import HostedCoordinator, RayOnHosts
from tests.multihost.conftest import hosted
from tests.support.chaos_load import PROMPTS, Load, Outcome, request, text_key
from tests.support.chaos_load import reference_texts as chaos_reference

pytestmark = [pytest.mark.ray, pytest.mark.multihost, pytest.mark.chaos]
OUTAGE_S = 6  # the cable stays out past Ray's node-death detection (~3 s on the bed)
LOAD_BOUND_S = 120  # every request ends within this once the load stops
IDLE_FIELDS = ("num_used_blocks", "num_reserved", "num_held", "num_open_streams", "num_running")
TIMEOUTS = {"max_retry": 5, "schedule_timeout": 60, "first_token_timeout": 60, "infer_timeout": 90}


@pytest.fixture(scope="module")
def coordinator(ray_hosts, peaked_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("coordinator-faults")
    sections = {"exception_config": TIMEOUTS}
    yield from hosted(
        ray_hosts,
        workdir,
        peaked_model,
        sections,
        kv_transport="zmq",
        maxIterTimes=512,
        kv_transfer_timeout_s=2,
        kv_reservation_timeout_s=5,
    )


def reboot(ray: RayOnHosts, role: str) -> None:
    """Power ``role``'s host off and on: every process gone, a clean /tmp/ray, Ray started."""
    host = ray.bed[role]
    host.kill_all()
    for leftover in (host.root / "ray").iterdir():
        shutil.rmtree(leftover, ignore_errors=True)
    ray.start(role)


def pull_decode_cable(ray: RayOnHosts) -> None:
    ray.bed.link("decode", False)
    try:
        time.sleep(OUTAGE_S)
    finally:
        ray.bed.link("decode", True)
    reboot(ray, "decode")


def kill_prefill_raylet(ray: RayOnHosts) -> None:
    import os
    import signal

    os.kill(ray.raylet_pid("prefill"), signal.SIGKILL)
    time.sleep(3)  # the host is down a while before it comes back
    reboot(ray, "prefill")


FAULTS: dict[str, Callable[[RayOnHosts], None]] = {
    "decode cable pulled": pull_decode_cable,
    "prefill raylet killed": kill_prefill_raylet,
}


class HostedLoad:
    """``tests.support.chaos_load.Load`` run from ``host`` in a thread of its own."""

    def __init__(self, host: Host, base_url: str, model: str) -> None:
        self.load = Load(base_url, model, concurrency=6)
        self._host = host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hosted-load", daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        enter_netns(self._host.netns)
        self._loop = asyncio.new_event_loop()
        self._started.set()
        self._loop.run_until_complete(self.load.run())

    def stop(self, timeout_s: float) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.load.stop.set)
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"requests still running {timeout_s} s after the stop"


def model_name(coordinator: HostedCoordinator) -> str:
    return coordinator.request("GET", "predict_port", "/v1/models").json()["data"][0]["id"]


def reference_texts(coordinator: HostedCoordinator, model: str) -> dict[tuple[str, bool], str]:
    """Each prompt's texts from the undisturbed cluster (``chaos_load.reference_texts``)."""
    base_url = coordinator.url("predict_port", "")
    return coordinator.host.call(lambda: asyncio.run(chaos_reference(base_url, model)))


def served_again(coordinator: HostedCoordinator, model: str, since: float) -> float:
    """Seconds from ``since`` until a new request is served (errors meanwhile are honest)."""

    async def poll() -> float:
        async with httpx.AsyncClient(base_url=coordinator.url("predict_port", ""), timeout=90) as c:
            while time.monotonic() - since < 150:
                outcome = await request(c, model, "mindie", PROMPTS[0])
                if outcome.status == "ok":
                    return time.monotonic() - since
                assert outcome.status == "error", outcome
                await asyncio.sleep(0.5)
        raise AssertionError("no request was served within 150 s of the fault")

    return coordinator.host.call(lambda: asyncio.run(poll()))


def until_idle(coordinator: HostedCoordinator, ray: RayOnHosts, timeout_s: float = 60) -> None:
    """Both workers answering on their hosts, holding nothing."""
    homes = {"prefill": ray.bed["prefill"].address, "decode": ray.bed["decode"].address}
    deadline = time.monotonic() + timeout_s
    while True:
        instances = coordinator.instances()
        busy = [i for i in instances if any(i.get(f, 1) != 0 for f in IDLE_FIELDS)]
        placed = {i["role"]: i["node_ip"] for i in instances} == homes
        placed = placed and all(i.get("status") == "answering" for i in instances)
        if placed and not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle {timeout_s} s after the load: {instances}")
        time.sleep(0.5)


def counters(coordinator: HostedCoordinator) -> Counter[str]:
    """``request_migrations_total`` (``migrations``) and ``request_failed_total`` by reason
    (``error``: every migration spent; ``unavailable``: no pair could take it) so far."""
    counted: Counter[str] = Counter()
    for line in coordinator.request("GET", "external_port", "/metrics").text.splitlines():
        if line.startswith("request_migrations_total{"):
            counted["migrations"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("request_failed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counted[reason] += float(line.rsplit(" ", 1)[1])
    return counted


@pytest.mark.parametrize("fault", list(FAULTS))
def test_requests_survive_a_host_failure_or_fail_honestly(coordinator, ray_hosts, fault):
    model = model_name(coordinator)
    reference = reference_texts(coordinator, model)
    load = HostedLoad(ray_hosts.bed["head"], coordinator.url("predict_port", ""), model)
    time.sleep(2)  # requests in every stage
    before = counters(coordinator)
    start = time.monotonic()
    FAULTS[fault](ray_hosts)
    recovered_s = served_again(coordinator, model, start)
    recovered = start + recovered_s
    time.sleep(1.5)
    load.stop(LOAD_BOUND_S)
    until_idle(coordinator, ray_hosts)
    outcomes = load.load.outcomes
    statuses = Counter(o.status for o in outcomes)
    counted = counters(coordinator)
    counted.subtract(before)
    report = {
        "fault": fault,
        "requests": len(outcomes),
        **statuses,
        "migrations": counted["migrations"],
        "spent": counted["error"],
        "unavailable": counted["unavailable"],
        "failed_otherwise": sum(
            n
            for reason, n in counted.items()
            if reason not in ("migrations", "error", "unavailable", "aborted")
        ),
        "in_flight": sum(o.in_flight_during(start, recovered) for o in outcomes),
        "through_outage": len(finished_through_outage(outcomes, start)),
        "recovered_s": round(recovered_s, 2),
        "slowest_s": round(max(o.seconds for o in outcomes), 2),
        "errors": sorted({o.detail[:120] for o in outcomes if o.status == "error"}),
    }
    print(f"host fault {report}")
    assert statuses["dishonest"] == 0, [o for o in outcomes if o.status == "dishonest"]
    wrong = [
        o for o in outcomes if o.status == "ok" and o.text != reference[text_key(o.prompt, o.kind)]
    ]
    assert not wrong, [(o, reference[text_key(o.prompt, o.kind)]) for o in wrong]
    assert statuses["ok"] > 0
    assert max(o.seconds for o in outcomes) <= TIMEOUTS["infer_timeout"] + 10
    assert report["migrations"] <= TIMEOUTS["max_retry"] * report["in_flight"], report
    # a client error only where the request spent every migration, or found no pair while its
    # host was down; none timed out, was refused for a full pool or otherwise
    assert statuses["error"] <= report["spent"] + report["unavailable"], report
    assert report["failed_otherwise"] == 0, report
    if fault == "decode cable pulled":
        # the fault really hit requests: some finished through the outage, or moved off the
        # lost host (its requests migrate once Ray declares the node dead, ~3 s, so they may
        # all be done before the cable is back)
        assert report["through_outage"] > 0 or report["migrations"] > 0, report
        assert report["migrations"] >= report["through_outage"], report


def finished_through_outage(outcomes: list[Outcome], start: float) -> list[Outcome]:
    """Requests sent before the cable was pulled that finished after it was back."""
    return [
        o
        for o in outcomes
        if o.status == "ok" and o.started < start and o.started + o.seconds > start + OUTAGE_S
    ]
