"""A Ray cluster and a pdserve coordinator on the hosts of a
:class:`~testbed.netns.TestBed`, laid out as the Helm chart lays out a KubeRay
deployment: a head host (the Ray head, no CPUs for actors, and the coordinator as a Ray driver) and
one host per worker group, whose raylet offers the group's custom resource (``pdserve_prefill`` /
``pdserve_decode``), with the chart's fixed Ray ports and its Ray token authentication. The
coordinator's configuration takes the chart's ``kv_host: auto`` (each decode worker advertises its
node's address) and ``kv_encryption: on``. ``tests/multihost/test_chart_agreement.py`` checks these
against what the chart renders.

Additions of the test bed's own (``BED_START_PARAMS``): one CPU per worker host (the machine
has two cores), a small object store, no dashboard, and faster node-failure detection.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from testbed.netns import Host, TestBed

HOSTS = ("head", "prefill", "decode")
GCS_PORT = 6379
# rayStartParams the chart renders for every Ray node (values.yaml ray.ports)
CHART_PORTS = {
    "node-manager-port": "6380",
    "object-manager-port": "6381",
    "metrics-export-port": "8080",
    "dashboard-agent-listen-port": "8266",
    "dashboard-agent-grpc-port": "8267",
    "runtime-env-agent-port": "8268",
    "min-worker-port": "10002",
    "max-worker-port": "19999",
}
CHART_HEAD_PARAMS = {**CHART_PORTS, "num-cpus": "0", "dashboard-host": "127.0.0.1"}
ROLE_RESOURCES = {"prefill": "pdserve_prefill", "decode": "pdserve_decode"}
CHART_GROUP_RESOURCE_AMOUNT = 1000  # rayStartParams.resources of a worker group
CHART_BACKEND = {"kv_host": "auto", "kv_encryption": "on"}  # what the chart's config sets
# the test bed's own additions, for two cores and quick tests
BED_START_PARAMS = {
    "head": {"include-dashboard": "false", "object-store-memory": str(80 * 2**20)},
    "worker": {"num-cpus": "1", "object-store-memory": str(80 * 2**20)},
}
BED_RAY_ENV = {
    # a node that stops answering is declared dead after about 3 s (Ray's default: ~15-30 s)
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "5",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def worker_params(role: str) -> dict[str, str]:
    """A worker group's rayStartParams as the chart renders them."""
    resources = json.dumps({ROLE_RESOURCES[role]: CHART_GROUP_RESOURCE_AMOUNT})
    return {**CHART_PORTS, "resources": resources}


def start_args(role: str, host: Host, head_address: str) -> list[str]:
    """``ray start`` on ``host`` for ``role`` (head, prefill, decode), in the foreground."""
    if role == "head":
        params = {**CHART_HEAD_PARAMS, **BED_START_PARAMS["head"], "port": str(GCS_PORT)}
        first = ["--head"]
    else:
        params = {**worker_params(role), **BED_START_PARAMS["worker"]}
        first = [f"--address={head_address}"]
    flags = [f"--{key}={value}" for key, value in params.items()]
    return [_ray_cli(), "start", *first, f"--node-ip-address={host.address}", *flags, "--block"]


@dataclass
class RayOnHosts:
    """The Ray processes of each host (``ray start --block``: it ends when its node ends)."""

    bed: TestBed
    token: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def head_address(self) -> str:
        return f"{self.bed['head'].address}:{GCS_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """Environment of every Ray process and driver: the chart's token authentication."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, **BED_RAY_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def start(self, role: str) -> None:
        host = self.bed[role]
        log = open(host.root / f"ray-start-{int(time.time())}.log", "w")  # noqa: SIM115
        self.processes[role] = host.popen(
            start_args(role, host, self.head_address),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )

    def start_all(self) -> None:
        self.start("head")
        self._wait_for_gcs()
        for role in HOSTS[1:]:
            self.start(role)

    def _wait_for_gcs(self, timeout_s: float = 120) -> None:
        head = self.bed["head"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.processes["head"].poll() is not None:
                raise RuntimeError(f"the Ray head exited: {self.log_tail('head')}")
            if head.call(lambda: _port_open(head.address, GCS_PORT)):
                return
            time.sleep(0.5)
        raise TimeoutError(f"no Ray head in {timeout_s} s: {self.log_tail('head')}")

    def raylet_pid(self, role: str) -> int:
        """The raylet process of ``role``'s host."""
        for pid in self.bed[role].pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmdline and cmdline[0].endswith(b"/raylet"):
                return pid
        raise LookupError(f"no raylet on {role}")

    def log_tail(self, role: str, chars: int = 3000) -> str:
        logs = sorted(self.bed[role].root.glob("ray-start-*.log"))
        return logs[-1].read_text()[-chars:] if logs else ""


@dataclass
class HostedCoordinator:
    """A pdserve coordinator on one host of the bed, reached from there (``host.call``)."""

    host: Host
    process: subprocess.Popen
    log_path: Path
    ports: dict[str, int]

    def url(self, port: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}{path}"

    def request(self, method: str, port: str, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request from the head host."""

        def send() -> httpx.Response:
            with httpx.Client(timeout=kwargs.pop("timeout", 120)) as client:
                response = client.request(method, self.url(port, path), **kwargs)
                response.read()
                return response

        return self.host.call(send)

    def instances(self) -> list[dict]:
        return self.request("GET", "manage_port", "/v1/instances").json()["instances"]

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"coordinator exited: {self.log_path.read_text()[-3000:]}")
            try:
                readiness = self.request("GET", "status_port", "/v1/readiness", timeout=2)
                if readiness.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready in {timeout_s} s: {self.log_path.read_text()[-3000:]}")

    def stop(self, timeout_s: float = 60) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()


PORTS = {"predict_port": 1025, "manage_port": 1026, "status_port": 1029, "external_port": 1028}


def start_coordinator(
    ray: RayOnHosts,
    backend: dict[str, Any],
    workdir: Path,
    sections: dict[str, dict] | None = None,
    host: str = "head",
) -> HostedCoordinator:
    """``pdserve --ray-address <head>`` on ``host`` (the head host unless named: a driver needs
    the raylet every host runs), with the chart's KV settings and one prefill and one decode
    actor, each on its group's hosts; ``backend`` on top, and other ``sections`` of the
    configuration (``exception_config``, ...)."""
    config = {
        **(sections or {}),
        "http_config": dict(PORTS),
        "backend_config": {
            **CHART_BACKEND,
            "embedding_model_path": "",
            "prefill_resources": {"num_cpus": 1, "resources": {ROLE_RESOURCES["prefill"]: 1}},
            "decode_resources": {"num_cpus": 1, "resources": {ROLE_RESOURCES["decode"]: 1}},
            **backend,
        },
    }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "ms_coordinator.json"
    path.write_text(json.dumps(config))
    log_path = workdir / "coordinator.log"
    args = [sys.executable, "-m", "coordinator", "--config", str(path)]
    args += ["--ray-address", ray.head_address]
    with open(log_path, "w") as log:
        process = ray.bed[host].popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**ray.env, "PYTHONUNBUFFERED": "1"},
            cwd=Path(__file__).resolve().parents[2],
        )
    return HostedCoordinator(ray.bed[host], process, log_path, dict(PORTS))


def _port_open(address: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _ray_cli() -> str:
    found = Path(sys.executable).with_name("ray")
    return str(found) if found.exists() else shutil.which("ray") or "ray"
