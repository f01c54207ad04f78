"""Three real coordinator processes shared by the end-to-end tests (one test session):
``zmq`` (pd_separate over ZMQ, peer pulls on), ``grpc`` (pd_separate over gRPC), ``single``
(single_node over HTTPS, a slower model, max_requests 3, maxBatchSize 1, fullTextEnabled)."""

from __future__ import annotations

import os
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trustme

from testbed.coordinator_process import CoordinatorProcess, start_coordinator
from testbed.tiny_model import build_tiny_model

MAX_ITER = 8
API_KEY = "test-key"  # the grpc server requires it


def infer(server: CoordinatorProcess, body, **kwargs) -> httpx.Response:
    with server.client() as client:
        return client.post(server.url("predict_port", "/infer"), json=body, **kwargs)


def first_answer(server: CoordinatorProcess) -> tuple[httpx.Response, int]:
    """What /infer and /v1/readiness say while the cluster is still starting."""
    for _ in range(600):
        try:
            response = infer(server, {"inputs": "hello"})
            return response, httpx.get(server.url("status_port", "/v1/readiness")).status_code
        except httpx.TransportError:
            time.sleep(0.1)
    raise TimeoutError("the predict port never opened")


# pd_separate as a fixed split, whatever the routing defaults: every prompt is handed off, so
# the hand-off path is what these tests exercise (the adaptive keys have tests of their own)
FIXED_SPLIT = {
    "local_prefill_tokens": 0,
    "local_prefill_queue_tokens": 0,
    "stepTargetMs": 0,
}


def backend(model_dir, fixed_split: bool = True, **extra) -> dict:
    """A tiny engine's ``backend_config``; ``fixed_split`` False: the shipping routing and core
    defaults (local prefill of short prompts, ``stepTargetMs``)."""
    return {
        "model_path": str(model_dir),
        "device": "cpu",
        "cacheBlockSize": 4,
        "kvCacheMemoryMB": 4,
        "maxIterTimes": MAX_ITER,
        **(FIXED_SPLIT if fixed_split else {}),
        **extra,
    }


def _slow_model(tmp_path_factory) -> Path:
    """A tiny model deeper and wider than the shared one: slower steps for ``single``."""
    return build_tiny_model(
        tmp_path_factory.mktemp("slow-model"),
        num_layers=6,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        initializer_range=0.3,
    )


def _certificates(tmp_path_factory) -> Path:
    """A folder with a test CA's ``ca.pem`` and a ``cert.pem``/``key.pem`` for 127.0.0.1."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certs = tmp_path_factory.mktemp("certs")
    cert.private_key_pem.write_to_path(certs / "key.pem")
    cert.cert_chain_pems[0].write_to_path(certs / "cert.pem")
    ca.cert_pem.write_to_path(certs / "ca.pem")
    return certs


def _zmq_config(model_dir) -> tuple[dict, tuple[str, ...]]:
    """``zmq``: pd_separate over ZMQ (peer pulls on) with a 1 MB body limit; its config and
    arguments."""
    return (
        {
            "request_limit": {"body_limit": 1},
            "backend_config": backend(model_dir, kv_transport="zmq", kv_peer_pull=True),
        },
        (),
    )


def _grpc_config(model_dir) -> tuple[dict, tuple[str, ...]]:
    """``grpc``: pd_separate over gRPC with an API key and content safety on, on uvloop; config,
    arguments."""
    return (
        {
            "http_config": {"api_keys": [API_KEY], "event_loop": "uvloop"},
            "content_safety": {
                "enabled": True,
                "categories": {"test": {"terms": ["forbidden"], "patterns": [r"\bsecret-\d+\b"]}},
            },
            "backend_config": backend(model_dir),
        },
        ("--kv-transport", "grpc"),
    )


def _single_config(slow_model, certs: Path) -> tuple[dict, tuple[str, ...]]:
    """``single``: single_node over HTTPS, max_requests 3, maxBatchSize 1, fullTextEnabled."""
    return (
        {
            "digs_scheduler_config": {"deploy_mode": "single_node"},
            "request_limit": {"max_requests": 3},
            "tls_config": {
                "request_server_tls_enable": True,
                "tls_cert": str(certs / "cert.pem"),
                "tls_key": str(certs / "key.pem"),
            },
            "backend_config": backend(
                slow_model,
                maxIterTimes=512,
                maxBatchSize=1,
                kvCacheMemoryMB=64,
                fullTextEnabled=True,
            ),
        },
        (),
    )


def _assert_unavailable_until_ready(started: dict[str, CoordinatorProcess]) -> None:
    """While starting, ``zmq`` answers /infer and /v1/readiness 503; then every one gets ready."""
    not_ready = first_answer(started["zmq"])
    for server in started.values():
        server.wait_ready()
    assert not_ready[0].status_code == 503, not_ready[0].text
    assert not_ready[0].json()["error_type"] == "Service Unavailable"
    assert not_ready[1] == 503


def _assert_all_stop_cleanly(started: dict[str, CoordinatorProcess], raylets_before) -> None:
    """Every coordinator stops with exit code 0 (a hung one killed) and leaves no Ray running."""
    codes = {}
    for name, server in started.items():
        try:
            codes[name] = server.stop()
        except subprocess.TimeoutExpired:
            server.process.kill()
            codes[name] = "hung"
    assert codes == {name: 0 for name in started}, codes
    time.sleep(2)
    assert raylets() <= raylets_before, "a coordinator left its Ray running"


@pytest.fixture(scope="session")
def servers(tmp_path_factory, tiny_model_dir):
    """The three coordinators, started and ready; stopped cleanly at the session's end."""
    slow_model = _slow_model(tmp_path_factory)
    certs = _certificates(tmp_path_factory)
    configs = {
        "zmq": _zmq_config(tiny_model_dir),
        "grpc": _grpc_config(tiny_model_dir),
        "single": _single_config(slow_model, certs),
    }
    started = {
        name: start_coordinator(tmp_path_factory.mktemp(name), config, *args)
        for name, (config, args) in configs.items()
    }
    started["single"].verify = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    started["grpc"].headers = {"api-key": API_KEY}
    raylets_before = raylets()
    try:
        _assert_unavailable_until_ready(started)
        yield started
    finally:
        _assert_all_stop_cleanly(started, raylets_before)


def raylets() -> set[int]:
    """Raylets on this host's network (not those of the multi-host test bed's namespaces)."""
    found = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout
    ours = os.readlink("/proc/self/ns/net")
    return {int(pid) for pid in found.split() if _netns(int(pid)) == ours}


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None  # gone
