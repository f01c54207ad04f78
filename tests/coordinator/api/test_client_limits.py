"""Each client's own limits at every door: a key over its requests open or its token rate is
answered 429 with Retry-After in the door's shape, naming its own limit and nothing of anyone
else's; another key is served meanwhile; without API keys the client is its address; and a
request's priority is clamped to what its key is entitled to."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from coordinator.api.clients import Client, ClientLimits
from coordinator.connection_caps import ConnectionCaps
from coordinator.door_limits import DoorLimits
from coordinator.errors import TooManyRequests
from coordinator.http_edge import EdgeLimits, uvicorn_limits
from engine.outputs import TokenEvent
from tests.support.door_fakes import (
    DOORS,
    ScriptedService,
    post,
    predict_app,
    serving,
)
from tests.support.raw_http import connect

KEY_A, KEY_B = "key-a-secret", "key-b-secret"


def message_of(door: str, response: httpx.Response) -> str:
    body = response.json()
    if door == "openai":
        return body["error"]["message"]
    if door == "azure":
        return body["error"]["message"]
    if door == "mlflow":
        return body["message"]
    return body["error"]


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


@pytest.mark.parametrize(("door", "path", "body"), DOORS)
def test_a_key_past_its_token_rate_is_429_until_its_bucket_refills(door, path, body):
    limits = DoorLimits(tokens_per_minute_per_key=1)  # one generated token a minute
    service = ScriptedService(1)
    app = predict_app(service, door_limits=limits, api_keys=(KEY_A, KEY_B))
    assert post(app, path, body, headers=key(KEY_A)).status_code == 200
    refused = post(app, path, body, headers=key(KEY_A))
    assert refused.status_code == 429
    assert 55 <= int(refused.headers["retry-after"]) <= 60
    assert service.refusals == 1  # counted as the door gate's refusals are
    expected = (
        "Too many requests"
        if door == "mindie"
        else ("this key may generate at most 1 tokens a minute")
    )
    assert message_of(door, refused) == expected
    assert post(app, path, body, headers=key(KEY_B)).status_code == 200


def test_the_unused_tokens_of_a_request_are_given_back():
    limits = DoorLimits(tokens_per_minute_per_key=100)
    app = predict_app(ScriptedService(1), door_limits=limits, api_keys=(KEY_A,))
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 80}}
    for _ in range(5):  # each generates 1 token and pays for that one only
        assert post(app, "/infer", body, headers=key(KEY_A)).status_code == 200
    assert 94 <= app.state.client_limits.tokens.buckets.popitem()[1].level <= 100


def hold_one_open(url: str, headers: str) -> Any:
    """A POST whose body never comes: open at the door gate until the socket closes."""
    sock = connect(url)
    head = f"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n{headers}\r\n"
    sock.sendall(head.encode())
    return sock


def wait_open(app: Any, count: int) -> None:
    deadline = time.monotonic() + 5
    while app.state.door.open != count:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def served_app(app: Any) -> Any:
    edge = uvicorn_limits(EdgeLimits(body_timeout_s=30.0), ConnectionCaps(max_connections=64))
    return serving(app, **edge)


def test_a_key_past_its_requests_open_is_429_at_every_door_and_another_key_is_served():
    limits = DoorLimits(max_requests_per_key=1)
    app = predict_app(ScriptedService(1), door_limits=limits, api_keys=(KEY_A, KEY_B))
    with served_app(app) as url:
        holder = hold_one_open(url, f"api-key: {KEY_A}\r\n")
        wait_open(app, 1)
        for door, path, body in DOORS:
            refused = httpx.post(url + path, json=body, headers=key(KEY_A))
            assert refused.status_code == 429, (path, refused.text)
            assert refused.headers["retry-after"] == "1"
            expected = (
                "Too many requests"
                if door == "mindie"
                else ("this key may have at most 1 requests open at once")
            )
            assert message_of(door, refused) == expected
            assert httpx.post(url + path, json=body, headers=key(KEY_B)).status_code == 200
        holder.close()
        wait_open(app, 0)
        assert httpx.post(url + "/infer", json={"inputs": "hi"}, headers=key(KEY_A)).is_success
    assert not app.state.client_limits.open


def test_without_api_keys_the_client_is_its_address():
    app = predict_app(ScriptedService(1), door_limits=DoorLimits(max_requests_per_key=1))
    with served_app(app) as url:
        holder = hold_one_open(url, "")
        wait_open(app, 1)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        holder.close()
    assert refused.status_code == 429
    assert refused.json()["error"]["message"] == (
        "this key may have at most 1 requests open at once"
    )


def test_each_generation_names_its_client_by_a_keyed_hash_for_the_engines_queue():
    service = ScriptedService(1)
    app = predict_app(service, api_keys=(KEY_A, KEY_B))
    for name in (KEY_A, KEY_A, KEY_B):
        assert post(app, "/v1/completions", {"prompt": "hi"}, headers=key(name)).is_success
    a1, a2, b = (request.client for request in service.requests)
    assert a1 == a2 != b and a1.startswith("key:")
    assert KEY_A not in a1 and KEY_B not in b
    anonymous = ScriptedService(1)
    assert post(predict_app(anonymous), "/infer", {"inputs": "hi"}).is_success
    (request,) = anonymous.requests
    assert request.client.startswith("address:") and "127.0.0.1" not in request.client


async def _two_tokens():
    for count in (1, 2):
        yield TokenEvent("r", 7, "a", 3, count, time.monotonic())


def test_a_key_past_its_constrained_requests_open_is_refused_and_each_ended_one_gives_back():
    refusals: list[int] = []
    limits = ClientLimits(
        max_constrained_requests_per_key=1,
        tokens_per_minute_per_key=2,
        on_refusal=lambda: refusals.append(1),
    )
    client = Client("key", limits)

    async def run() -> None:
        running = client.metered(_two_tokens(), 1, constrained=True)
        await running.__anext__()
        refused = client.metered(_two_tokens(), 1, constrained=True)
        with pytest.raises(TooManyRequests, match="at most 1 constrained requests open at once"):
            await refused.__anext__()
        free = client.metered(_two_tokens(), 1)  # not constrained: not counted
        assert [e.num_output_tokens async for e in free] == [1, 2]
        await running.aclose()
        assert limits.constrained == {}
        # the bucket is empty now: the token refusal gives the constrained count back too
        starved = client.metered(_two_tokens(), 1, constrained=True)
        with pytest.raises(TooManyRequests, match="tokens a minute"):
            await starved.__anext__()
        assert limits.constrained == {}
        assert len(refusals) == 2  # each refusal counted once

    asyncio.run(run())
