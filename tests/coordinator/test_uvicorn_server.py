"""The coordinator's uvicorn server (``coordinator/uvicorn_server.py``) on a real socket: it ticks
once a second with uvicorn's per-second work on every tick, and told to exit from another thread
it exits at once, not at its next tick."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

import coordinator.uvicorn_server as uvicorn_server
from coordinator.threaded_server import ThreadedServer
from coordinator.uvicorn_server import SignalFreeServer


async def app(scope, receive, send):  # the smallest ASGI app: 200, empty body
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def server() -> SignalFreeServer:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    return SignalFreeServer(config)


def started(serving: SignalFreeServer) -> str:
    deadline = time.monotonic() + 10
    while not serving.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{serving.servers[0].sockets[0].getsockname()[1]}"


def test_told_to_exit_from_another_thread_it_exits_at_once_not_at_its_tick(monkeypatch):
    monkeypatch.setattr(uvicorn_server, "TICK_S", 60.0)
    threaded = ThreadedServer(server(), "probes")
    threaded.start()
    url = started(threaded.server)
    assert httpx.get(url).headers["date"]  # uvicorn's date header, set by the first tick
    began = time.monotonic()
    threaded.server.should_exit = True
    threaded.thread.join(30)
    assert not threaded.thread.is_alive()
    assert time.monotonic() - began < 30  # a tick of 60 s was not waited for


def test_every_tick_does_uvicorns_per_second_work(monkeypatch):
    monkeypatch.setattr(uvicorn_server, "TICK_S", 0.01)
    serving = server()
    counters: list[int] = []
    on_tick = serving.on_tick

    async def recording(counter: int) -> bool:
        counters.append(counter)
        if len(counters) == 5:
            serving.should_exit = True
        return await on_tick(counter)

    monkeypatch.setattr(serving, "on_tick", recording)
    thread = threading.Thread(target=serving.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert counters == [0, 10, 20, 30, 40]  # uvicorn renews its date when counter % 10 == 0


def test_told_to_exit_before_it_starts_it_ends_without_waiting_for_a_tick(monkeypatch):
    monkeypatch.setattr(uvicorn_server, "TICK_S", 60.0)
    serving = server()
    serving.should_exit = True
    thread = threading.Thread(target=serving.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
