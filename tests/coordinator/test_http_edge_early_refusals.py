"""After an answer the predict listener gives before reading a body (the key gate's 401, the
door gate's 429 at its limit and 503 while draining), the next request of that kept-alive
connection is under the edge's limits as any other: its header capped (431), its header
deadline armed (408). A real coordinator's listeners, served in this process (no Ray)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from coordinator.server import Coordinator
from tests.coordinator.test_http_edge_keepalive import (
    MIB,
    assert_408_at_the_header_deadline,
    endless_header_bytes,
)
from tests.support.coordinator_listeners import coordinator_listeners
from tests.support.raw_http import connect, read_one_answer, status_of, statuses_of


def _at_the_limit(coordinator: Coordinator) -> None:
    coordinator.service.max_requests = 0  # every POST is one past it


def _draining(coordinator: Coordinator) -> None:
    coordinator.service.draining = True


EARLY: dict[int, tuple[dict, Callable[[Coordinator], None] | None]] = {
    401: ({"http_config.api_keys": ["a-key-nobody-sends"]}, None),
    429: ({}, _at_the_limit),
    503: ({}, _draining),
}


@pytest.fixture(scope="module", params=sorted(EARLY), ids=lambda status: f"after-{status}")
def early(request) -> Iterator[tuple[str, int]]:
    """The predict listener's url, and the status it answers a POST with before its body."""
    overrides, prepare = EARLY[request.param]
    with coordinator_listeners(overrides, prepare) as urls:
        yield urls["predict"], request.param


def _answered(url: str, status: int) -> socket.socket:
    """A kept-alive connection whose ``POST /infer`` of 100 body bytes was answered ``status``
    before any of its body came."""
    sock = connect(url)
    sock.sendall(b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
    first = read_one_answer(sock)
    assert status_of(first) == status, first
    assert b"connection: close" not in first.lower(), first
    return sock


def test_after_it_the_next_request_is_answered_as_usual(early):
    url, status = early
    sock = _answered(url, status)
    sock.sendall(b"x" * 100)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    received = sock.recv(65536)
    assert status_of(received) in (200, 401), received  # the next request is served as usual
    sock.close()


def test_after_it_the_next_header_is_capped(early):
    url, status = early
    sock = _answered(url, status)
    sock.sendall(b"x" * 100)  # the rest of the first request
    sent, received = endless_header_bytes(sock)
    assert sent < 8 * MIB, f"after {status}: the server took {sent} bytes of header"
    assert statuses_of(received)[-1:] == [431], received


def test_after_it_one_idle_byte_is_408_at_the_header_deadline(early):
    url, status = early
    sock = _answered(url, status)
    sock.sendall(b"x" * 100 + b"G")
    assert_408_at_the_header_deadline(sock)
