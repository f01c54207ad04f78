"""Property-based fuzz of the predict port on the wire: random header lists (names, values,
counts, sizes near and over the cap, bytes no header should hold) and random bodies, whole or
chunked (chunk sizes true or false, extensions, trailers, a last chunk or none), written in
random fragments with random pauses, against a real uvicorn server behind the edge
(:mod:`coordinator.http_edge`) with short deadlines.

Every exchange must end within :data:`ANSWER_TIMEOUT_S` with an answer below 500 (431 and 408
included) or a closed connection, and the server must serve a plain request after each one.
Examples are random (see ``test_http_fuzz.py``); ``PDSERVE_FUZZ_EXAMPLES`` scales them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.connection_caps import ConnectionCaps
from coordinator.http_edge import EdgeLimits, uvicorn_limits
from tests.support.door_fakes import ScriptedService, predict_app, serving

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "12")) * 2
HEADER_CAP = 8 * 1024
LIMITS = EdgeLimits(max_header_bytes=HEADER_CAP, header_timeout_s=0.5, body_timeout_s=0.5)
ANSWER_TIMEOUT_S = 5
WIRE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PATHS = ("/infer", "/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/x")
BODY = b'{"inputs": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    service = ScriptedService(2)
    with serving(predict_app(service), **uvicorn_limits(LIMITS, ConnectionCaps(164))) as base:
        yield base


token = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-_0123456789"), min_size=1, max_size=20)
header_value = st.one_of(
    st.binary(max_size=64).map(lambda b: b.replace(b"\r\n", b"")),
    st.integers(0, 2 * HEADER_CAP).map(lambda n: b"a" * n),
    st.sampled_from([b"application/json", b"chunked", b"gzip", b"100-continue", b"-1", b"1e9"]),
)
header = st.tuples(
    st.one_of(
        token.map(str.encode),
        st.sampled_from([b"content-type", b"expect", b"transfer-encoding", b"content-length"]),
    ),
    header_value,
)


@st.composite
def chunked(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` in chunks: sizes true or false, extensions, trailers, a last chunk or none."""
    out, rest = b"", body
    while rest:
        size = draw(st.integers(1, len(rest)))
        piece, rest = rest[:size], rest[size:]
        declared = draw(st.one_of(st.just(size), st.integers(0, 4 * size + 8)))
        extension = draw(st.sampled_from([b"", b";ext=1", b";" + b"x" * 100]))
        out += f"{declared:x}".encode() + extension + b"\r\n" + piece + b"\r\n"
    if draw(st.booleans()):
        out += b"0\r\n" + draw(st.sampled_from([b"", b"trailer: x\r\n"])) + b"\r\n"
    return out


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"POST", b"GET", b"PUT", b"P\x00ST"]))
    path = draw(st.sampled_from(PATHS)).encode()
    headers = draw(st.lists(header, max_size=12))
    body = draw(st.sampled_from([b"", BODY, BODY[:20], b"\xff" * 50]))
    framing = draw(st.sampled_from(["length", "false-length", "chunked", "none"]))
    if framing == "chunked":
        headers.append((b"transfer-encoding", b"chunked"))
        body = draw(chunked(body))
    elif framing != "none":
        length = len(body) if framing == "length" else draw(st.integers(0, 2 * len(body) + 10))
        headers.append((b"content-length", str(length).encode()))
    lines = [method + b" " + path + b" HTTP/1.1", b"host: fuzz"]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def exchange(url: str, request: bytes, cuts: list[int], pause_s: float) -> bytes:
    """Write ``request`` in fragments cut at ``cuts``, half-close, and read to the end."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=ANSWER_TIMEOUT_S)
    received = b""
    with sock:
        try:
            start = 0
            for cut in [*sorted(set(cuts)), len(request)]:
                sock.sendall(request[start:cut])
                start = cut
                time.sleep(pause_s)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            raise
        except OSError:  # the server closed first: a refusal
            pass
    return received


@WIRE
@given(
    request=requests(),
    cuts=st.lists(st.integers(0, 20_000), max_size=4),
    pause_s=st.sampled_from([0.0, 0.0, 0.01, 0.15]),
)
def test_no_wire_request_gets_a_server_error_or_holds_the_server(url, request, cuts, pause_s):
    start = time.monotonic()
    try:
        answer = exchange(url, request, [c for c in cuts if c < len(request)], pause_s)
    except TimeoutError:
        pytest.fail(f"no answer in {ANSWER_TIMEOUT_S} s to {request[:300]!r}")
    assert time.monotonic() - start < ANSWER_TIMEOUT_S + 1
    for line in answer.split(b"\r\n"):
        if line.startswith(b"HTTP/1.1 "):
            status = int(line.split(b" ")[1])
            assert status < 500, (request[:300], answer[:300])
    assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
