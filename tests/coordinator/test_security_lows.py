"""The small holes of the predict and management edges: an empty API key opens nothing (refused at
load, never matched), keys are compared in constant time against every configured key; a failed
request tells its client no node address, KV port or Ray text; Azure's 422 echoes a bounded value;
fault injection needs a key always (the management keys, else its own, else no start), warns at
start and reads a bounded body. No Ray; real uvicorn sockets where the
finding is about what a client sends."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

import coordinator.api.app as app_module
from coordinator.api.app import create_predict_app
from coordinator.api.azure import ECHOED_CHARS
from coordinator.cli import main as cli_main
from coordinator.config.loader import load_config
from coordinator.errors import GenerationFailed
from coordinator.fault_injection import FAULT_BODY_LIMIT, FAULT_KEY_ENV
from coordinator.model_info import ModelInfo
from coordinator.served_model import ServedModels
from coordinator.server import Coordinator
from engine.errors import ConfigError
from engine.outputs import TokenEvent
from tests.support.coordinator_configs import config_with, get
from tests.support.door_fakes import AZURE_CHAT, MESSAGES, CharTokenizer, ScriptedService, serving
from tests.support.fake_cluster import FakeCluster, _service

# ---- API keys ----


@pytest.mark.parametrize("section_key", ["api_keys", "manage_api_keys"])
@pytest.mark.parametrize("keys", [["good", ""], ["  "]])
def test_an_empty_api_key_is_refused_at_load(tmp_path, section_key, keys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"http_config": {section_key: keys}}))
    with pytest.raises(ConfigError, match=rf"http_config\.{section_key}\[\d\] is empty"):
        load_config(path, environ={})


def _keyed_app(keys: tuple[str, ...]) -> Any:
    model = ModelInfo("fake", CharTokenizer(), 1024, 1000, 100)
    served = ServedModels(generation=model, embedding_path=None)
    return create_predict_app(
        ScriptedService(2), served, None, body_limit_mb=1, api_keys=keys, is_ready=lambda: True
    )


@pytest.mark.parametrize(
    "header", [("api-key", ""), ("authorization", "Bearer"), ("authorization", "bearer")]
)
def test_an_empty_presented_key_never_matches(header):
    """Even a key list that holds an empty key (built without the config's check)."""
    with serving(_keyed_app(("real-key", ""))) as url:
        refused = httpx.post(f"{url}/infer", json={"inputs": "hi"}, headers=dict([header]))
        allowed = httpx.post(f"{url}/infer", json={"inputs": "hi"}, headers={"api-key": "real-key"})
    assert refused.status_code == 401, refused.text
    assert allowed.status_code == 200, allowed.text


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = app_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", counting)
    keys = ("key-one", "key-two", "key-three")
    with serving(_keyed_app(keys)) as url:
        response = httpx.post(f"{url}/infer", json={"inputs": "hi"}, headers={"api-key": "key-one"})
    assert response.status_code == 200
    assert sorted(b for _, b in compared) == sorted(k.encode() for k in keys)  # no early exit


# ---- client-visible failures ----

RAY_TEXT = (
    "worker failed: RayActorError: The actor died unexpectedly before finishing this task. "
    "class_name: DecodeWorker actor_id: 5e4c ip: 10.1.2.3 KV endpoint tcp://10.1.2.3:5557"
)


class RayFailingCluster(FakeCluster):
    """Every attempt fails at once with the text a dead Ray actor leaves."""

    async def stream(self, run):
        self.calls.append((run.route, run.attempt))
        yield TokenEvent.failure(run.attempt.request_id, RAY_TEXT, "worker_lost")


@pytest.mark.parametrize("path", ["/v1/completions", "/infer", "/generate", AZURE_CHAT])
def test_a_failed_request_tells_no_ip_port_or_ray_text(path, caplog):
    service = _service(RayFailingCluster(), max_retry=1)
    model = ModelInfo("fake", CharTokenizer(), 1024, 1000, 100)
    app = create_predict_app(
        service,
        ServedModels(model, None),
        None,
        body_limit_mb=1,
        api_keys=(),
        is_ready=lambda: True,
    )
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
    body = {"inputs": "hi"} if path in ("/infer", "/generate") else body
    with caplog.at_level(logging.ERROR, logger="coordinator.inference"):
        response = _post(app, path, body)
    assert response.status_code == 500, response.text
    for leak in ("10.1.2.3", "5557", "Ray", "DecodeWorker", "tcp://"):
        assert leak not in response.text, response.text
    assert "failed after 1 migrations: worker_lost" in response.text
    logged = [
        r.getMessage() for r in caplog.records if "failed after 1 migrations" in r.getMessage()
    ]
    assert logged and RAY_TEXT in logged[0]
    request_id = logged[0].split()[1]
    assert request_id in response.text  # the operator finds the detail by the id the client has


def test_the_service_raises_the_cause_without_the_detail():
    with pytest.raises(GenerationFailed) as raised:
        asyncio.run(_collect(_service(RayFailingCluster(), max_retry=0)))
    assert str(raised.value).endswith("failed after 0 migrations: worker_lost")


async def _collect(service: Any) -> None:
    from tests.support.fake_cluster import _request

    async for _ in service.generate(_request()):
        pass


def _post(app: Any, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            return await client.post(path, json=body, **kwargs)

    return asyncio.run(run())


# ---- Azure's 422 ----


def test_azure_422_echoes_at_most_a_bounded_value():
    stops = [{"type": "function", "function": {"name": "f" * 10_000}}]
    pass_through = {"extra-parameters": "pass-through"}
    body = {"messages": MESSAGES, "stops": stops}
    response = _post(_keyed_app(()), AZURE_CHAT, body, headers=pass_through)
    assert response.status_code == 422
    echoed = response.json()["detail"]["input"]
    assert isinstance(echoed, str) and len(echoed) <= ECHOED_CHARS + 3
    assert echoed.startswith('[{"type": "function"')
    assert len(response.content) < 1024


def test_azure_400_for_a_refused_tool_echoes_at_most_a_bounded_value():
    tools = [{"type": "function", "function": {"name": "f" * 10_000}}]
    response = _post(_keyed_app(()), AZURE_CHAT, {"messages": MESSAGES, "tools": tools})
    assert response.status_code == 400
    assert response.json()["detail"]["loc"] == ["body", "tools"]
    echoed = response.json()["detail"]["input"]
    assert isinstance(echoed, str) and len(echoed) <= ECHOED_CHARS + 3
    assert len(response.content) < 1024


def test_azure_422_still_echoes_a_short_value_as_it_is():
    body = {"messages": MESSAGES, "response_format": {"type": "xml"}}
    response = _post(_keyed_app(()), AZURE_CHAT, body)
    assert response.status_code == 422
    assert response.json()["detail"] == {
        "loc": ["body", "response_format"],
        "input": {"type": "xml"},
    }


# ---- fault injection ----

FAULT_KEY = "chaos-key-1"
FAULT_HEADERS = {"api-key": FAULT_KEY}
UNKNOWN_ROLE = {"role": "nobody", "instance": 0, "fault": "x"}


@pytest.fixture
def fault_app(monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_FAULT_INJECTION", "1")
    monkeypatch.setenv(FAULT_KEY_ENV, FAULT_KEY)
    with caplog.at_level(logging.WARNING, logger="coordinator.fault_injection"):
        app = Coordinator(config_with()).manage_app()
    return app


def test_fault_injection_warns_loudly_at_start(fault_app, caplog):
    warnings = [r for r in caplog.get_records("setup") if r.levelno == logging.WARNING]
    assert any("FAULT INJECTION IS ON" in r.getMessage() for r in warnings)


@pytest.mark.parametrize("key", [None, "", "   "])
def test_fault_injection_without_any_key_refuses_to_start(monkeypatch, key):
    monkeypatch.setenv("PDSERVE_FAULT_INJECTION", "1")
    monkeypatch.delenv(FAULT_KEY_ENV, raising=False)
    if key is not None:
        monkeypatch.setenv(FAULT_KEY_ENV, key)
    with pytest.raises(ConfigError) as error:
        Coordinator(config_with())
    assert str(error.value) == (
        "PDSERVE_FAULT_INJECTION=1 needs a key for POST /v1/faults: set "
        "http_config.manage_api_keys, or PDSERVE_FAULT_INJECTION_KEY to a non-blank key"
    )


def test_the_command_line_stops_with_exit_code_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_FAULT_INJECTION", "1")
    monkeypatch.delenv(FAULT_KEY_ENV, raising=False)
    assert cli_main([]) == 2
    assert "PDSERVE_FAULT_INJECTION_KEY" in capsys.readouterr().err


@pytest.mark.parametrize(
    "headers", [{}, {"api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"api-key": ""}]
)
def test_a_fault_request_without_its_key_is_401_even_on_loopback(fault_app, headers):
    response = _post(fault_app, "/v1/faults", UNKNOWN_ROLE, headers=headers)
    assert response.status_code == 401, response.text
    assert get(fault_app, "/v1/instances").status_code == 200  # only the fault route is keyed


@pytest.mark.parametrize("headers", [FAULT_HEADERS, {"Authorization": f"Bearer {FAULT_KEY}"}])
def test_a_fault_request_with_its_key_reaches_the_cluster(fault_app, headers):
    response = _post(fault_app, "/v1/faults", UNKNOWN_ROLE, headers=headers)
    assert response.status_code == 400  # read and parsed: the role is refused by the cluster
    assert "role must be one of" in response.json()["error"]


def test_with_management_keys_the_fault_route_is_behind_them(monkeypatch):
    monkeypatch.setenv("PDSERVE_FAULT_INJECTION", "1")
    monkeypatch.setenv(FAULT_KEY_ENV, FAULT_KEY)
    app = Coordinator(config_with(manage_api_keys=["m-1"])).manage_app()
    assert _post(app, "/v1/faults", UNKNOWN_ROLE, headers=FAULT_HEADERS).status_code == 401
    opened = _post(app, "/v1/faults", UNKNOWN_ROLE, headers={"api-key": "m-1"})
    assert opened.status_code == 400, opened.text
    monkeypatch.delenv(FAULT_KEY_ENV)  # the management keys are enough to start
    Coordinator(config_with(manage_api_keys=["m-1"])).manage_app()


def test_a_fault_body_past_the_bound_is_413(fault_app):
    padding = "x" * FAULT_BODY_LIMIT
    body = {"role": "decode", "instance": 0, "fault": "break_transport", "pad": padding}
    declared = _post(fault_app, "/v1/faults", body, headers=FAULT_HEADERS)
    assert declared.status_code == 413, declared.text

    async def chunks():  # no Content-Length: refused as the bytes come in
        yield b'{"role": "decode", "pad": "'
        for _ in range(64):
            yield b"x" * 1024

    chunked = _post(fault_app, "/v1/faults", None, content=chunks(), headers=FAULT_HEADERS)
    assert chunked.status_code == 413, chunked.text


def test_a_fault_body_within_the_bound_is_read(fault_app):
    response = _post(fault_app, "/v1/faults", UNKNOWN_ROLE, headers=FAULT_HEADERS)
    assert response.status_code == 400  # read and parsed: the role is refused by the cluster
    assert "role must be one of" in response.json()["error"]
