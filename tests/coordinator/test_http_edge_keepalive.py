"""Every request of a kept-alive connection is under the edge's limits, on every listener of a
real coordinator (its four ``uvicorn_configs``, served in this process; no Ray), whatever the
answer before it did: answered before its body was read, pipelined, or followed by one idle
byte. And the status listener answers its probes with hundreds of sockets held open on it."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from coordinator.http_edge import PIPELINE_DEPTH
from tests.support.coordinator_listeners import (
    DEADLINE_S,
    LISTENERS,
    coordinator_listeners,
)
from tests.support.raw_http import connect, is_closed, read_one_answer, status_of, statuses_of

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    with coordinator_listeners() as listeners:
        yield listeners


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def early_answered(url: str, path: str) -> socket.socket:
    """A connection whose POST of 100 body bytes was answered before any of its body came
    (and kept alive: a body that short is read and dropped)."""
    sock = connect(url)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n".encode())
    first = read_one_answer(sock)
    assert 400 <= status_of(first) < 500, first
    assert b"connection: close" not in first.lower(), first
    return sock


def assert_408_at_the_header_deadline(sock: socket.socket) -> None:
    """The next thing ``sock`` gets, within the header deadline and a margin, is a 408."""
    start = time.monotonic()
    received = sock.recv(65536)
    assert status_of(received) == 408, received
    assert time.monotonic() - start < 3 * DEADLINE_S


def endless_header_bytes(sock: socket.socket) -> tuple[int, bytes]:
    """Send a request whose one header never ends, until the server stops taking it."""
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent = 0
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while sent < 32 * MIB:
            sock.sendall(b"a" * 1024)
            sent += 1024
    sock.settimeout(5)
    received = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            received += chunk
    return sent, received


@pytest.mark.parametrize("listener", LISTENERS)
def test_after_an_early_answer_and_its_body_the_next_header_is_capped(urls, listener):
    sock = early_answered(urls[listener], LISTENERS[listener][1])
    sock.sendall(b"x" * 100)  # the rest of the first request
    sent, received = endless_header_bytes(sock)
    assert sent < 8 * MIB, f"{listener}: the server took {sent} bytes of header"
    assert statuses_of(received)[-1:] == [431], received


@pytest.mark.parametrize("listener", LISTENERS)
def test_after_an_early_answer_a_half_sent_next_request_is_408(urls, listener):
    sock = early_answered(urls[listener], LISTENERS[listener][1])
    sock.sendall(b"x" * 100 + b"GET / HTTP/1.1\r\nhost: x\r\n")
    assert_408_at_the_header_deadline(sock)


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_body_that_never_ends_after_its_answer_closes_the_connection(urls, listener):
    sock = early_answered(urls[listener], LISTENERS[listener][1])
    sock.sendall(b"x" * 10)
    assert is_closed(sock, 3 * DEADLINE_S), f"{listener} kept the connection"


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_huge_body_after_its_answer_is_not_read_to_its_end(urls, listener):
    sock = connect(urls[listener])
    path = LISTENERS[listener][1]
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {64 * MIB}\r\n\r\n".encode())
    answer = read_one_answer(sock)
    assert 400 <= status_of(answer) < 500, answer
    # The connection will close once the drain is spent: the answer says so, so that a client
    # does not send its next request on it (as httpx would with a kept-alive connection).
    assert b"connection: close" in answer.lower(), answer
    sent = 0
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while sent < 64 * MIB:
            sock.sendall(b"x" * 65536)
            sent += 65536
    assert sent < 16 * MIB, f"{listener} read {sent} bytes of a body it had answered"


@pytest.mark.parametrize("listener", LISTENERS)
def test_one_idle_byte_after_an_answer_is_408_at_the_header_deadline(urls, listener):
    sock = connect(urls[listener])
    sock.sendall(get(LISTENERS[listener][0]))
    assert status_of(read_one_answer(sock)) < 500
    sock.sendall(b"G")
    assert_408_at_the_header_deadline(sock)


@pytest.mark.parametrize("listener", LISTENERS)
def test_an_idle_kept_alive_connection_is_closed_at_the_header_deadline(urls, listener):
    sock = connect(urls[listener])
    sock.sendall(get(LISTENERS[listener][0]))
    assert status_of(read_one_answer(sock)) < 500
    assert is_closed(sock, 3 * DEADLINE_S)


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_pipelined_header_over_the_cap_ends_the_connection(urls, listener):
    sock = connect(urls[listener])
    sock.sendall(get(LISTENERS[listener][0]))
    sent, received = endless_header_bytes(sock)
    assert sent < 8 * MIB, f"{listener}: the server took {sent} bytes of a pipelined header"
    assert statuses_of(received)[-1:] == [431] or statuses_of(received)[:1] == [200]


@pytest.mark.parametrize("listener", LISTENERS)
def test_more_pipelined_requests_than_the_depth_close_the_connection(urls, listener):
    sock = connect(urls[listener])
    count = PIPELINE_DEPTH + 8
    sock.sendall(get(LISTENERS[listener][0]) * count)
    sock.settimeout(5)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    assert len(statuses_of(received)) < count


@pytest.mark.parametrize("listener", LISTENERS)
def test_every_listener_serves_after_the_attacks(urls, listener):
    path = LISTENERS[listener][0]
    with httpx.Client() as client:
        assert client.get(f"{urls[listener]}{path}").status_code < 500


def test_probes_answer_with_300_sockets_each_holding_a_byte_on_the_status_listener():
    with coordinator_listeners(max_requests=40, header_timeout=30) as listeners:
        url = listeners["status"]
        held = []
        for _ in range(300):
            sock = connect(url)
            sock.sendall(get("/v1/health"))
            assert status_of(read_one_answer(sock)) == 200
            sock.sendall(b"G")
            held.append(sock)
        latencies = []
        with httpx.Client() as client:
            for _ in range(5):
                start = time.monotonic()
                assert client.get(f"{url}/v1/health").status_code == 200
                latencies.append(time.monotonic() - start)
        for sock in held:
            sock.close()
    assert max(latencies) < 0.1, latencies
