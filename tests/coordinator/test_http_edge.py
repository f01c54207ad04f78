"""The HTTP edge against raw sockets: a huge header is refused at the cap, connections that never
finish their headers or bodies are refused at the deadlines, a request is admitted before its
body is read, parallel oversized bodies cost the server no memory, and the probes answer while
the predict loop is stalled. Real uvicorn servers in this process (no Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from coordinator.api import common
from coordinator.api.limits import default_body_limit_mb
from coordinator.connection_caps import ConnectionCaps
from coordinator.http_edge import EdgeLimits, uvicorn_limits
from coordinator.threaded_server import ThreadedServer
from tests.support.door_fakes import ScriptedService, predict_app, serving
from tests.support.endless_service import EndlessService
from tests.support.raw_http import answer, connect, status_of

LIMITS = EdgeLimits(max_header_bytes=64 * 1024, header_timeout_s=1.0, body_timeout_s=1.0)
MIB = 1024 * 1024
CAPS = ConnectionCaps(max_connections=164)


@contextlib.contextmanager
def guarded(app: Any, limits: EdgeLimits = LIMITS, caps: ConnectionCaps = CAPS) -> Iterator[str]:
    with serving(app, **uvicorn_limits(limits, caps)) as url:
        yield url


def test_a_trickled_32_mib_header_is_431_once_the_cap_is_passed():
    process = psutil.Process(os.getpid())
    with guarded(predict_app(ScriptedService(1))) as url:
        before = process.memory_info().rss
        sock = connect(url)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent, start = 0, time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 32 * MIB:
                sock.sendall(b"a" * 1024)
                sent += 1024
        refused_after = time.monotonic() - start
        response = answer(sock)
        grown = process.memory_info().rss - before
    assert status_of(response) == 431, response
    body = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert body["error_type"] == "Request Header Fields Too Large"
    assert "at most 65536 bytes" in body["error"]
    assert sent < 8 * MIB, f"the server took {sent} bytes of header"
    assert refused_after < 5
    assert grown < 16 * MIB, f"RSS grew by {grown} bytes"


def test_a_header_just_under_the_cap_is_served():
    with guarded(predict_app(ScriptedService(1))) as url:
        response = httpx.get(f"{url}/v1/models", headers={"x-big": "a" * 60_000})
    assert response.status_code == 200


def test_64_half_sent_requests_are_408_at_the_header_deadline():
    with guarded(predict_app(ScriptedService(1))) as url:
        socks = [connect(url) for _ in range(64)]
        for sock in socks:
            sock.sendall(b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: appl")
        start = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(answer, socks))
        elapsed = time.monotonic() - start
    assert [status_of(r) for r in responses] == [408] * 64
    assert elapsed < 5, f"the last half-sent request was refused after {elapsed:.1f} s"


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline():
    with guarded(predict_app(ScriptedService(1))) as url:
        sock = connect(url)
        start = time.monotonic()
        assert answer(sock) == b""
    assert 0.5 < time.monotonic() - start < 5


def test_a_trickled_body_is_408_at_the_body_deadline():
    with guarded(predict_app(ScriptedService(1))) as url:
        sock = connect(url)
        sock.sendall(
            b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        start = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(50):
                sock.sendall(b" ")
                time.sleep(0.1)
        response = answer(sock)
    assert status_of(response) == 408, response
    assert b"the request body took over 1 s" in response
    assert time.monotonic() - start < 6


def test_the_next_request_on_a_kept_alive_connection_has_its_own_header_deadline():
    with guarded(predict_app(ScriptedService(1))) as url:
        sock = connect(url)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        first = sock.recv(65536)
        time.sleep(0.5)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")  # never finished
        second = answer(sock)
    assert status_of(first) == 200
    assert status_of(second) == 408, second


def test_a_stream_longer_than_the_deadlines_is_not_cut():
    service = EndlessService()
    with guarded(predict_app(service)) as url, httpx.Client(base_url=url) as client:
        body = {"inputs": "hi", "stream": True}
        with client.stream("POST", "/infer", json=body) as response:
            start, events = time.monotonic(), 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if time.monotonic() - start > 2.5:
                    break
    assert response.status_code == 200
    assert events > 50


def test_a_header_pipelined_behind_a_stream_is_capped_and_the_connection_ends():
    """A next request sent while an answer streams is counted against the header cap as it
    arrives: past it, the connection (stream and all) is closed, and the aborted generation
    ends; an uncapped server would take the header forever and stream on."""
    service = EndlessService()
    with guarded(predict_app(service)) as url:
        sock = connect(url)
        body = b'{"inputs": "hi", "stream": true}'
        head = "POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        assert status_of(sock.recv(65536)) == 200  # the stream is under way
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        sock.settimeout(2.0)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            while sent < 32 * MIB:
                sock.sendall(b"a" * 1024)
                sent += 1024
        ended = False  # what is left of the stream, until the server closes the connection
        deadline = time.monotonic() + 5
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while time.monotonic() < deadline and not ended:
                ended = not sock.recv(65536)
        ended = ended or time.monotonic() < deadline  # reset or timed out before the deadline
        assert service.generations[0].closed.wait(5), "the generation went on"
    assert sent < 8 * MIB, f"the server took {sent} bytes of a pipelined header"
    assert ended, "the stream went on after the pipelined header passed the cap"


def test_a_request_is_refused_429_before_its_body_is_read_at_max_requests():
    service = ScriptedService(1)
    service.max_requests = 2
    app = predict_app(service)
    with guarded(app, EdgeLimits(body_timeout_s=30.0)) as url:
        holders = [connect(url) for _ in range(2)]
        for sock in holders:  # headers only: their bodies never come
            sock.sendall(b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        deadline = time.monotonic() + 5
        while app.state.door.open < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        refused = httpx.post(f"{url}/v1/tokenizer", json={"inputs": "hello"})
        refused_in = time.monotonic() - start
        for sock in holders:
            sock.close()
        while app.state.door.open:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served = httpx.post(f"{url}/v1/tokenizer", json={"inputs": "hello"})
    assert refused.status_code == 429, refused.text
    assert refused.json() == {"error": "Too many requests", "error_type": "Too many requests"}
    assert refused.headers["retry-after"] == "1"
    assert refused_in < 1
    assert served.status_code == 200


def post_raw(url: str, path: str, body: bytes) -> int:
    """POST ``body`` in 64 KiB writes from a raw socket (no copies on the client's side), until
    the server answers or closes; the answer's status."""
    sock = connect(url)
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
    sock.sendall(head.encode() + b"connection: close\r\n\r\n")
    view = memoryview(body)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for start in range(0, len(body), 65536):
            sock.sendall(view[start : start + 65536])
    with sock:
        return status_of(answer(sock))


def test_parallel_bodies_of_empty_objects_at_the_old_limit_cost_no_memory():
    """32 MB of ``[{},{},...]`` decodes to ~770 MB of objects; the default body limit (from
    the prompt limit) refuses it unread."""
    process = psutil.Process(os.getpid())
    body = b"[" + b"{}," * (32 * MIB // 3 - 1) + b"{}]"
    limit_mb = default_body_limit_mb(2048)
    with guarded(predict_app(ScriptedService(1), body_limit_mb=limit_mb)) as url:
        before = process.memory_info().rss
        with ThreadPoolExecutor(6) as pool:
            statuses = list(
                pool.map(lambda _: post_raw(url, "/v1/chat/completions", body), range(6))
            )
        grown = process.memory_info().rss - before
    assert statuses == [413] * 6
    assert grown < 128 * MIB, f"RSS grew by {grown} bytes"


def test_parallel_bodies_at_the_limit_are_decoded_one_at_a_time_off_the_loop(monkeypatch):
    threads: list[str] = []
    decode = common.decode_json

    def recording(body: bytes) -> tuple[str, Any]:
        threads.append(threading.current_thread().name)
        return decode(body)

    monkeypatch.setattr(common, "decode_json", recording)
    body = b"[" + b"{}," * (2 * MIB // 3 - 2) + b"{}]"
    with guarded(predict_app(ScriptedService(1), body_limit_mb=2)) as url:
        with ThreadPoolExecutor(6) as pool:
            responses = list(
                pool.map(lambda _: httpx.post(f"{url}/v1/chat/completions", content=body), range(6))
            )
        small = httpx.post(f"{url}/v1/chat/completions", content=b"[]")
    assert [r.status_code for r in responses] == [400] * 6
    assert small.status_code == 400
    assert threads[:6] and all(name.startswith("large-json") for name in threads[:6])
    assert not threads[6].startswith("large-json")  # a small body: decoded on the loop


def test_the_probes_answer_within_100_ms_while_the_predict_loop_is_stalled():
    stalled = FastAPI()

    @stalled.get("/stall")
    async def stall() -> Response:
        time.sleep(3)  # holds the predict server's event loop
        return Response()

    probes = FastAPI()

    @probes.get("/v1/health")
    async def health() -> Response:
        return Response(status_code=200)

    config = uvicorn.Config(probes, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    probe_server = ThreadedServer(uvicorn.Server(config), "probes")
    probe_server.start()
    deadline = time.monotonic() + 10
    while not probe_server.server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    port = probe_server.server.servers[0].sockets[0].getsockname()[1]
    try:
        with guarded(stalled) as url, httpx.Client() as client:
            client.get(f"http://127.0.0.1:{port}/v1/health")  # connect once
            threading.Thread(target=httpx.get, args=(f"{url}/stall",), daemon=True).start()
            time.sleep(0.5)
            latencies = []
            for _ in range(10):
                start = time.monotonic()
                assert client.get(f"http://127.0.0.1:{port}/v1/health").status_code == 200
                latencies.append(time.monotonic() - start)
    finally:
        asyncio.run(probe_server.stop())
    assert max(latencies) < 0.1, latencies
