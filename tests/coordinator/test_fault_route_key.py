"""``POST /v1/faults`` of a real coordinator process (its own local Ray, a tiny model), on the
real management socket on loopback: it breaks nothing without its key, and fault injection with
no key at all never starts (``coordinator/fault_injection.py``)."""

from __future__ import annotations

import httpx
import pytest

from coordinator.fault_injection import FAULT_KEY_ENV
from testbed.coordinator_process import start_coordinator
from tests.support.coordinator_servers import backend
from workers.faults import FAULT_INJECTION_ENV

pytestmark = pytest.mark.ray
KEY = "fault-key-1"
FAULT = {"role": "decode", "instance": 0, "fault": "break_transport", "count": 1}


def test_fault_injection_without_a_key_exits_with_code_2(tmp_path, tiny_model_dir):
    config = {"backend_config": backend(tiny_model_dir)}
    refused = start_coordinator(tmp_path, config, env={FAULT_INJECTION_ENV: "1", FAULT_KEY_ENV: ""})
    assert refused.process.wait(120) == 2
    assert f"{FAULT_KEY_ENV} to a non-blank key" in refused.log_path.read_text()


def test_the_fault_route_of_a_running_coordinator_needs_its_key(tmp_path, tiny_model_dir):
    config = {"backend_config": backend(tiny_model_dir)}
    server = start_coordinator(tmp_path, config, env={FAULT_INJECTION_ENV: "1", FAULT_KEY_ENV: KEY})
    try:
        server.wait_ready()
        url = server.url("manage_port", "/v1/faults")
        for headers in ({}, {"api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            assert httpx.post(url, json=FAULT, headers=headers, timeout=30).status_code == 401
        opened = httpx.post(url, json=FAULT, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert opened.status_code == 200, opened.text
        assert opened.json() == {"injected": FAULT}
    finally:
        server.stop()
