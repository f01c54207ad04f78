"""The budget of buffered request bodies, on a real uvicorn server fed from raw sockets: a body
whose declared length does not fit is refused unread, one that outgrows the budget as its chunks
arrive is refused at that chunk, parallel bodies beyond the budget are 429s while the bytes held
never pass it, and the budget is whole again once the requests end."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from coordinator.api.body_budget import MIB, BodyBudget
from coordinator.connection_caps import ConnectionCaps
from coordinator.door_limits import DoorLimits
from coordinator.http_edge import EdgeLimits, uvicorn_limits
from tests.support.door_fakes import ScriptedService, predict_app, serving
from tests.support.raw_http import answer, connect, read_one_answer, status_of

BUDGET_MB = 4
PATH = "/v1/chat/completions"


@contextlib.contextmanager
def budgeted() -> Iterator[tuple[str, BodyBudget]]:
    limits = DoorLimits(max_buffered_body_mb=BUDGET_MB)
    app = predict_app(ScriptedService(1), body_limit_mb=8, door_limits=limits)
    edge = uvicorn_limits(EdgeLimits(body_timeout_s=30.0), ConnectionCaps(max_connections=64))
    with serving(app, **edge) as url:
        yield url, app.state.body_budget


def json_body(size: int) -> bytes:
    """A chat body of exactly ``size`` bytes."""
    head, tail = b'{"messages": [{"role": "user", "content": "', b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def open_post(url: str, length: int) -> socket.socket:
    sock = connect(url)
    sock.sendall(f"POST {PATH} HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n\r\n".encode())
    return sock


def assert_busy(response: bytes) -> None:
    assert status_of(response) == 429, response[:300]
    assert b"\r\nretry-after: 1\r\n" in response.lower()
    body = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["message"] == "the server is busy; retry later"


def test_a_declared_body_that_does_not_fit_is_refused_unread_and_a_chunked_one_midway():
    body = json_body(3 * MIB)
    with budgeted() as (url, budget):
        holder = open_post(url, len(body))
        holder.sendall(body[:-1])  # all but its last byte: held, its handler still reading
        wait_for(lambda: budget.held == len(body) - 1)
        assert_busy(read_one_answer(open_post(url, 2 * MIB)))
        chunked = connect(url)
        chunked.sendall(
            f"POST {PATH} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode()
        )
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(32):  # 2 MiB in 64 KiB chunks, unless refused before
                chunked.sendall(b"10000\r\n" + b"x" * 65536 + b"\r\n")
        assert_busy(read_one_answer(chunked))
        assert budget.held == len(body) - 1
        holder.sendall(body[-1:])
        assert status_of(read_one_answer(holder)) == 422  # the prompt is over its limit
        wait_for(lambda: budget.held == 0)


def post_whole(url: str, body: bytes) -> bytes:
    sock = open_post(url, len(body))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for start in range(0, len(body), 65536):
            sock.sendall(body[start : start + 65536])
    with sock:
        return answer(sock)


def test_parallel_bodies_beyond_the_budget_are_429_and_the_budget_is_whole_after():
    body = json_body(3 * MIB // 2)
    with budgeted() as (url, budget):
        peak = 0

        def sample() -> None:
            nonlocal peak
            while not done:
                peak = max(peak, budget.held)
                time.sleep(0.001)

        done = False
        with ThreadPoolExecutor(9) as pool:
            sampler = pool.submit(sample)
            answers = list(pool.map(lambda _: post_whole(url, body), range(8)))
            done = True
            sampler.result()
        wait_for(lambda: budget.held == 0)
    statuses = sorted(status_of(a) for a in answers)
    assert 429 in statuses and set(statuses) <= {422, 429}, statuses
    for refused in (a for a in answers if status_of(a) == 429):
        assert_busy(refused)
    assert 0 < peak <= BUDGET_MB * MIB
