"""A Ray head started on 127.0.0.1 for one test module or benchmark, and stopped alone at the
end (its processes found by the temp dir it was given)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from testbed.coordinator_process import free_port

ROOT = Path(__file__).resolve().parent.parent

# The cluster binds to 127.0.0.1 and runs without token auth (docs/deploy.md documents both).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


class RayHead:
    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")  # short: socket paths
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        # Ports Ray would otherwise take fixed (52365 for the job agent, 10001, ...): another Ray
        # on this machine (the test session's own) may hold them.
        own_ports = [
            f"--{name}={free_port()}"
            for name in (
                "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port",
                "ray-client-server-port",
                "metrics-export-port",
                "runtime-env-agent-port",
            )
        ]
        self.env = {**os.environ, **RAY_ENV}
        self.env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            [
                "ray", "start", "--head", "--block", "--disable-usage-stats",
                "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
                "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                "--dashboard-port", str(self.dashboard_port), "--num-cpus", "4",
                "--temp-dir", self.temp_dir, *own_ports,
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it touches no other Ray
        )  # fmt: skip
        wait_for(lambda: self.cli("ray", "job", "list").returncode == 0, 120, "Ray head")

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``ray job ...`` / ``serve ...`` against this head (the address goes before ``--``)."""
        uses_dashboard = args[:2] in (("ray", "job"), ("serve", "shutdown"))
        address = self.dashboard if uses_dashboard else f"127.0.0.1:{self.gcs_port}"
        words = 3 if args[0] == "ray" else 2
        command = [*args[:words], "--address", address, *args[words:]]
        return subprocess.run(
            command, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def processes(self) -> list[int]:
        found = subprocess.run(["pgrep", "-f", self.temp_dir], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)  # what is left after is killed below
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def wait_for(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} not ready in {timeout_s} s")
