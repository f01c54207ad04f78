"""pdserve on an existing Ray cluster: submitted with ``ray job submit`` and deployed with
``serve run`` onto a head this module starts on 127.0.0.1 (and stops, alone, at the end)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.coordinator_process import free_port

pytestmark = pytest.mark.ray
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


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead()
    try:
        yield head
    finally:
        head.stop()
        time.sleep(1)
        assert head.processes() == [], "processes of the test's Ray head are left"


def _config(tmp_path: Path, model_dir: Path, ports: dict[str, int]) -> Path:
    backend = {
        "model_path": str(model_dir),
        "device": "cpu",
        "embedding_model_path": "",
        "cacheBlockSize": 4,
        "kvCacheMemoryMB": 4,
    }
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps({"http_config": ports, "backend_config": backend}))
    return path


def _assert_infers(url: str) -> None:
    """/infer answers with exactly the four tokens asked for."""
    parameters = {"max_new_tokens": 4, "ignore_eos": True, "details": True}
    response = httpx.post(
        f"{url}/infer", json={"inputs": "hello", "parameters": parameters}, timeout=60
    )
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert (details["generated_tokens"], details["finish_reason"]) == (4, "length")


def test_ray_job_submit_runs_the_coordinator(ray_head, tmp_path, tiny_model_dir):
    names = ("predict_port", "manage_port", "status_port", "external_port")
    ports = {name: free_port() for name in names}
    config = _config(tmp_path, tiny_model_dir, ports)
    submit = (
        "ray", "job", "submit", "--no-wait", "--working-dir", ".", "--submission-id",
        "pdserve-test", "--", "pdserve", "--ray-address", "auto", "--config", str(config),
    )  # fmt: skip
    submitted = ray_head.cli(*submit)
    deadline = time.monotonic() + 90
    while "No available agent" in submitted.stderr and time.monotonic() < deadline:
        time.sleep(2)  # the head answers before its job agent has registered
        submitted = ray_head.cli(*submit)
    assert submitted.returncode == 0, submitted.stderr
    try:
        status = f"http://127.0.0.1:{ports['status_port']}/v1/readiness"
        wait_for(lambda: httpx.get(status, timeout=2).status_code == 200, 240, "the job")
        _assert_infers(f"http://127.0.0.1:{ports['predict_port']}")
    finally:
        stopped = ray_head.cli("ray", "job", "stop", "pdserve-test")
    assert stopped.returncode == 0, stopped.stderr
    job = f"{ray_head.dashboard}/api/jobs/pdserve-test"
    wait_for(lambda: httpx.get(job).json()["status"] == "STOPPED", 60, "the job's stop")


def test_serve_run_deploys_the_ingress(ray_head, tmp_path, tiny_model_dir):
    port = free_port()
    config = _config(tmp_path, tiny_model_dir, {})
    serve_config = tmp_path / "serve.yaml"
    serve_config.write_text(
        yaml.safe_dump(
            {
                "http_options": {"host": "127.0.0.1", "port": port},
                "applications": [
                    {
                        "name": "pdserve",
                        "route_prefix": "/",
                        "import_path": "coordinator.serve_app:build",
                        # /metrics is off Serve's public port unless asked for
                        "args": {"config": str(config), "metrics": "on"},
                    }
                ],
            }
        )
    )
    deployed = ray_head.cli("serve", "run", "--non-blocking", str(serve_config))
    assert deployed.returncode == 0, deployed.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: httpx.get(f"{url}/v1/readiness", timeout=2).status_code == 200, 240, "Serve"
        )
        _assert_infers(url)
        parameters = {"max_new_tokens": 3, "ignore_eos": True}
        with httpx.stream(
            "POST",
            f"{url}/infer",
            json={"inputs": "hi", "stream": True, "parameters": parameters},
            timeout=60,
        ) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert len(events) == 3 and json.loads(events[-1][6:])["generated_text"] is not None
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        successes = re.findall(r"^request_success_total\{.*\} (\S+)$", metrics, re.M)
        assert [float(v) for v in successes] == [3.0]  # /infer, the stream, the chat
    finally:
        ray_head.cli("serve", "shutdown", "-y")
