"""Property-based fuzz of kept-alive connections on every listener of a real coordinator (its
four ``uvicorn_configs``, no Ray): random sequences of whole requests, requests answered before
their bodies were read (with some, all or more of the body after), pipelined requests, partial
headers, idle bytes and pauses, then a last request that asks the server to close.

Whatever the sequence, every answer is below 500 (503 included: nothing is shed), the server
ends the connection within :data:`END_TIMEOUT_S` (answering or closing), and the listener then
serves a plain request. Examples are random; ``PDSERVE_FUZZ_EXAMPLES`` scales them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.coordinator_listeners import LISTENERS, coordinator_listeners
from tests.support.raw_http import connect, statuses_of

EXAMPLES = max(2, int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "12")) // 2)
END_TIMEOUT_S = 6.0  # the header and body deadlines (1 s each) and a margin
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    with coordinator_listeners() as listeners:
        yield listeners


def whole(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


step = st.one_of(
    st.just(("whole",)),
    st.tuples(st.just("early"), st.integers(0, 4096), st.sampled_from([0.0, 0.5, 1.0, 1.5])),
    st.tuples(st.just("pipelined"), st.integers(2, 24)),
    st.tuples(st.just("partial"), st.integers(1, 40)),
    st.just(("idle_byte",)),
    st.tuples(st.just("pause"), st.floats(0, 0.3)),
)


def wire(listener: str, action: tuple) -> bytes:
    get_path, early_path = LISTENERS[listener]
    kind = action[0]
    if kind == "whole":
        return whole(get_path)
    if kind == "early":
        length, share = action[1], action[2]
        head = f"POST {early_path} HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n\r\n"
        return head.encode() + b"x" * int(length * share)
    if kind == "pipelined":
        return whole(get_path) * action[1]
    if kind == "partial":
        return whole(get_path)[: action[1]]
    return b"G"


def play(url: str, listener: str, steps: list[tuple]) -> tuple[bytes, float]:
    """Send ``steps`` and a last request with ``connection: close``; everything the server sent,
    and how long after the last byte the connection ended."""
    sock = connect(url)
    received = b""
    sock.settimeout(0.05)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for action in steps:
            if action[0] == "pause":
                time.sleep(action[1])
            else:
                sock.sendall(wire(listener, action))
            with contextlib.suppress(TimeoutError):
                received += sock.recv(65536)
        sock.sendall(f"GET {LISTENERS[listener][0]} HTTP/1.1\r\nhost: x\r\n".encode())
        sock.sendall(b"connection: close\r\n\r\n")
    sent_at = time.monotonic()
    sock.settimeout(END_TIMEOUT_S)
    with contextlib.suppress(ConnectionResetError, TimeoutError, OSError):
        while chunk := sock.recv(65536):
            received += chunk
    ended_after = time.monotonic() - sent_at
    sock.close()
    return received, ended_after


@pytest.mark.parametrize("listener", LISTENERS)
@FUZZ
@given(steps=st.lists(step, min_size=1, max_size=6))
def test_keep_alive_sequences_end_within_bounds_on_every_listener(urls, listener, steps):
    received, ended_after = play(urls[listener], listener, steps)
    assert all(status < 500 for status in statuses_of(received)), received[-400:]
    assert ended_after < END_TIMEOUT_S, f"the connection lived {ended_after:.1f} s after {steps}"
    with httpx.Client() as client:
        assert client.get(f"{urls[listener]}{LISTENERS[listener][0]}").status_code < 500


def test_a_socket_closed_mid_sequence_leaves_the_listener_serving(urls):
    for listener, (path, _) in LISTENERS.items():
        sock = socket.create_connection(("127.0.0.1", int(urls[listener].rsplit(":", 1)[1])))
        sock.sendall(whole(path) * 3 + b"GET / HTTP/1.1\r\nhost")
        sock.close()
        with httpx.Client() as client:
            assert client.get(f"{urls[listener]}{path}").status_code < 500
