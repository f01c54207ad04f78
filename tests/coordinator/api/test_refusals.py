"""What a refused client is told: 429, the draining 503 and the starting one carry
``Retry-After`` in every door, from the door gate and from the service alike, and no body or
header tells a client how busy the pool is or what its limits are."""

from __future__ import annotations

import re

import pytest

from coordinator.api.app import create_predict_app
from coordinator.errors import TooManyRequests
from coordinator.served_model import ServedModels
from tests.support.door_fakes import (
    DOORS,
    ScriptedService,
    no_embeddings,
    post,
    predict_app,
)

BUSY_BODIES = {
    "mindie": {"error": "Too many requests", "error_type": "Too many requests"},
    "openai": {
        "error": {
            "message": "the server is busy; retry later",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    },
    "azure": {"error": {"code": "TooManyRequests", "message": "the server is busy; retry later"}},
    "tgi": {"error": "the server is busy; retry later", "error_type": "overloaded"},
    "mlflow": {"error_code": "RESOURCE_EXHAUSTED", "message": "the server is busy; retry later"},
}


def full_service() -> ScriptedService:
    service = ScriptedService(1)
    service.max_requests = 0
    return service


@pytest.mark.parametrize(("door", "path", "body"), DOORS)
def test_the_door_gate_429_has_retry_after_and_no_counts(door, path, body):
    response = post(predict_app(full_service()), path, body)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json() == BUSY_BODIES[door]
    assert not re.search(rb"\d", response.content), response.content


@pytest.mark.parametrize(("door", "path", "body"), DOORS)
def test_a_full_pool_mid_request_is_429_with_retry_after(door, path, body):
    service = ScriptedService(0, TooManyRequests("no room for the request in the pool now"))
    response = post(predict_app(service), path, body)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize(("door", "path", "body"), DOORS)
def test_draining_is_503_with_retry_after(door, path, body):
    service = ScriptedService(1)
    service.draining = True
    response = post(predict_app(service), path, body)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"


def test_a_served_request_has_no_retry_after():
    response = post(predict_app(ScriptedService(1)), "/infer", {"inputs": "hi"})
    assert response.status_code == 200
    assert "retry-after" not in response.headers


def test_the_starting_503_has_retry_after():
    app = create_predict_app(
        ScriptedService(1),
        ServedModels(generation=None, embedding_path=None),
        no_embeddings,
        body_limit_mb=1,
        api_keys=(),
        is_ready=lambda: False,
    )
    response = post(app, "/infer", {"inputs": "hi"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
