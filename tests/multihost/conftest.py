"""The multi-host test bed: three hosts in network namespaces (head, prefill, decode) on one
bridge, a Ray cluster across them laid out as the Helm chart lays it out, and a pdserve
coordinator on the head host (``testbed/netns.py``, ``testbed/ray_hosts.py``).

One bed and one Ray cluster serve the whole test session; each transport's coordinator is
started once per module that asks for it. Everything is removed at the end, and what an
interrupted run left behind is removed at the start. Where namespaces cannot be made (not
root) the tests skip locally and fail in CI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.netns import TestBed, available, sweep
from testbed.ray_hosts import HOSTS, HostedCoordinator, RayOnHosts, start_coordinator
from testbed.tiny_model import build_tiny_model
from tests.support.coordinator_servers import FIXED_SPLIT
from tests.support.prerequisites import require

MAX_ITER = 64


@pytest.fixture(scope="session")
def peaked_model(tmp_path_factory) -> Path:
    """Greedy choices far from ties: a migrated request's recomputation cannot flip one."""
    return build_tiny_model(tmp_path_factory.mktemp("multihost-model"), initializer_range=1.0)


@pytest.fixture(scope="session")
def ray_hosts(tmp_path_factory) -> Iterator[RayOnHosts]:
    why = available()
    require(why is None, f"a multi-host test bed ({why})")
    sweep()
    with TestBed(HOSTS, tmp_path_factory.mktemp("bed")) as bed:
        ray = RayOnHosts(bed)
        ray.start_all()
        yield ray


def hosted(
    ray: RayOnHosts,
    workdir: Path,
    model: Path,
    sections: dict[str, dict] | None = None,
    **backend: object,
) -> Iterator[HostedCoordinator]:
    """A coordinator on the head host serving ``model`` with ``backend`` (and other config
    ``sections``) on top; stopped after."""
    config = {
        "model_path": str(model),
        "device": "cpu",
        "cacheBlockSize": 4,
        "kvCacheMemoryMB": 16,
        "maxIterTimes": MAX_ITER,
        **FIXED_SPLIT,  # every prompt handed off across the bridge, whatever the defaults
        **backend,
    }
    coordinator = start_coordinator(ray, config, workdir, sections)
    try:
        coordinator.wait_ready()
        yield coordinator
    finally:
        coordinator.stop()
