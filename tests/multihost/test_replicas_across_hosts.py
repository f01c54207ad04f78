"""Two coordinators on two hosts over one shared pool (docs/replicas.md), as the chart runs its
coordinator replicas: one on the head host, one on the prefill host, started at the same moment
with the same ``cluster_name`` and no ``pdserve workers`` before them, so they race to create the
pool and must end with one. Both serve; a prefix sent through one is a cache hit through the
other; SIGKILL of one under load costs the other's clients nothing, and the killed one's requests
are gone from every worker within the lease bound, with no block left in use."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.ray_hosts import HostedCoordinator, RayOnHosts, start_coordinator
from tests.multihost.conftest import MAX_ITER
from tests.multihost.test_host_faults import IDLE_FIELDS, HostedLoad, model_name
from tests.support.coordinator_servers import FIXED_SPLIT

pytestmark = [pytest.mark.ray, pytest.mark.multihost]
POOL = "bed-pool"
HOSTS = ("head", "prefill")  # where the two coordinators run
LEASE_BOUND_S = 10.0
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def _backend(model: Path) -> dict:
    return {
        "model_path": str(model),
        "device": "cpu",
        "cacheBlockSize": 4,
        "kvCacheMemoryMB": 16,
        "maxIterTimes": MAX_ITER,
        "cluster_name": POOL,
        **FIXED_SPLIT,
    }


def _stop_pool(ray: RayOnHosts, config: Path) -> str:
    """``pdserve workers --stop`` from the head host: the pool gone, whatever the test did."""
    args = [sys.executable, "-m", "coordinator", "workers", "--config", str(config)]
    args += ["--ray-address", ray.head_address, "--stop"]
    process = ray.bed["head"].popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray.env
    )
    return process.communicate(timeout=120)[0]


@pytest.fixture(scope="module")
def replicas(ray_hosts, peaked_model, tmp_path_factory) -> Iterator[list[HostedCoordinator]]:
    workdir = tmp_path_factory.mktemp("replicas")
    backend = _backend(peaked_model)
    started = [start_coordinator(ray_hosts, backend, workdir / host, host=host) for host in HOSTS]
    try:
        for coordinator in started:
            coordinator.wait_ready()
        yield started
    finally:
        for coordinator in started:
            if coordinator.process.poll() is None:
                coordinator.stop()
        print(_stop_pool(ray_hosts, workdir / "head" / "ms_coordinator.json")[-500:])


def _pids(coordinator: HostedCoordinator) -> dict[str, tuple[int, str]]:
    return {
        f"{i['role']}-{i['instance']}": (i["pid"], i["node_ip"]) for i in coordinator.instances()
    }


def _cached(coordinator: HostedCoordinator, prompt: str) -> tuple[int, int]:
    body = {"model": model_name(coordinator), "prompt": prompt, "max_tokens": 2}
    answer = coordinator.request("POST", "predict_port", "/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_two_hosts_coordinators_share_one_pool_and_its_cache(replicas, ray_hosts):
    first, second = replicas
    pool = _pids(first)
    assert _pids(second) == pool  # the race to create it made one pool
    homes = {
        "prefill-0": ray_hosts.bed["prefill"].address,
        "decode-0": ray_hosts.bed["decode"].address,
    }
    assert {name: ip for name, (_, ip) in pool.items()} == homes
    num_tokens, cached = _cached(first, PROMPT)
    assert cached == 0
    time.sleep(1.0)  # a few load polls: the other coordinator has the workers' events
    assert _cached(second, PROMPT + " And then?")[1] >= num_tokens - 4


def test_a_killed_coordinators_requests_go_and_the_others_are_served(replicas, ray_hosts):
    survivor, victim = replicas
    model = model_name(survivor)
    kept = HostedLoad(survivor.host, survivor.url("predict_port", ""), model)
    lost = HostedLoad(victim.host, victim.url("predict_port", ""), model)
    time.sleep(3.0)
    victim.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.process.wait(timeout=10)
    lost.stop(30)  # its clients' connections are gone with it
    expired = 0
    while time.monotonic() - killed_at < LEASE_BOUND_S + 5 and not expired:
        expired = sum(i["num_leases_expired"] for i in survivor.instances())
        time.sleep(0.2)
    freed_s = time.monotonic() - killed_at
    assert expired >= 1 and freed_s <= LEASE_BOUND_S, (expired, freed_s)
    time.sleep(2.0)
    kept.stop(120)
    outcomes = kept.load.outcomes
    assert outcomes and [(o.kind, o.status, o.detail) for o in outcomes if o.status != "ok"] == []
    deadline = time.monotonic() + 30
    while busy := [i for i in survivor.instances() if any(i.get(f, 1) for f in IDLE_FIELDS)]:
        assert time.monotonic() < deadline, busy  # the killed one's requests hold nothing
        time.sleep(0.5)
