"""A coordinator whose cluster fails to start (Ray unreachable, an actor that dies in its
constructor) logs why and ends with exit status 1, rather than serving 503 on its readiness probe
forever: a supervisor (systemd, the kubelet) sees the exit and restarts it."""

from __future__ import annotations

import asyncio
import logging

from coordinator.server import Coordinator
from testbed.coordinator_process import free_port
from tests.support.coordinator_configs import config_with


def test_a_cluster_that_fails_to_start_ends_serve_with_status_1(monkeypatch, caplog):
    ports = {name: free_port() for name in ("predict", "manage", "status", "external")}
    coordinator = Coordinator(config_with(**{f"{k}_port": v for k, v in ports.items()}))

    def no_cluster() -> None:
        raise RuntimeError("no Ray cluster at ray://10.9.9.9:10001")

    monkeypatch.setattr(coordinator, "start_cluster", no_cluster)
    with caplog.at_level(logging.ERROR, logger="coordinator.server"):
        status = asyncio.run(asyncio.wait_for(coordinator.serve(), timeout=30))
    assert status == 1
    assert not coordinator.ready
    assert "the cluster did not start: no Ray cluster at ray://10.9.9.9:10001" in caplog.text
