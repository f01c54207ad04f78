"""pdserve on an existing Ray cluster: submitted with ``ray job submit`` and deployed with
``serve run`` onto a head this module starts on 127.0.0.1 (and stops, alone, at the end)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from testbed.coordinator_process import free_port
from testbed.ray_head import RayHead, wait_for

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


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


def _serve_config(tmp_path: Path, config: Path, port: int) -> Path:
    """A Serve config deploying pdserve's ingress on 127.0.0.1:``port``, /metrics on."""
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
    return serve_config


def _assert_streams(url: str) -> None:
    """A streamed /infer sends the three tokens asked for, the last event with the text."""
    parameters = {"max_new_tokens": 3, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{url}/infer",
        json={"inputs": "hi", "stream": True, "parameters": parameters},
        timeout=60,
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3 and json.loads(events[-1][6:])["generated_text"] is not None


def _assert_chats(url: str) -> None:
    """/v1/chat/completions answers with the two tokens asked for."""
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


def test_serve_run_deploys_the_ingress(ray_head, tmp_path, tiny_model_dir):
    port = free_port()
    config = _config(tmp_path, tiny_model_dir, {})
    serve_config = _serve_config(tmp_path, config, port)
    deployed = ray_head.cli("serve", "run", "--non-blocking", str(serve_config))
    assert deployed.returncode == 0, deployed.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: httpx.get(f"{url}/v1/readiness", timeout=2).status_code == 200, 240, "Serve"
        )
        _assert_infers(url)
        _assert_streams(url)
        _assert_chats(url)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        successes = re.findall(r"^request_success_total\{.*\} (\S+)$", metrics, re.M)
        assert [float(v) for v in successes] == [3.0]  # /infer, the stream, the chat
    finally:
        ray_head.cli("serve", "shutdown", "-y")
