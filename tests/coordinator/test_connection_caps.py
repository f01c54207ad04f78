"""A listener at its connection cap closes its oldest idle connection for a newcomer and refuses
one only when none is idle (503; 429 at one address's cap): on a registry of fake connections,
then on a real uvicorn server behind the edge."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

from coordinator.connection_caps import ConnectionCaps, ListenerConnections
from coordinator.http_edge import EdgeLimits, uvicorn_limits
from tests.support.door_fakes import ScriptedService, predict_app, serving
from tests.support.raw_http import connect, is_closed, read_one_answer, status_of

LIMITS = EdgeLimits(header_timeout_s=30.0, body_timeout_s=30.0)


class FakeConnection:
    def __init__(self, host: str, idle_since: float, idle: bool = True) -> None:
        self.client_host, self.idle_since, self.idle, self.closed = host, idle_since, idle, False

    def is_idle(self) -> bool:
        return self.idle

    def close_idle(self) -> None:
        self.closed = True


def test_the_oldest_idle_connection_makes_room_at_the_cap():
    listener = ListenerConnections(ConnectionCaps(max_connections=3))
    busy = FakeConnection("a", 0.0, idle=False)
    newer, older = FakeConnection("b", 5.0), FakeConnection("c", 2.0)
    for connection in (busy, newer, older):
        assert listener.admit(connection) is None
    assert listener.admit(FakeConnection("d", 9.0)) is None
    assert (busy.closed, newer.closed, older.closed) == (False, False, True)
    assert len(listener.open) == 3 and listener.per_client["c"] == 0


def test_with_every_connection_busy_a_newcomer_is_503():
    listener = ListenerConnections(ConnectionCaps(max_connections=2))
    for host in ("a", "b"):
        assert listener.admit(FakeConnection(host, 0.0, idle=False)) is None
    status, message = listener.admit(FakeConnection("c", 1.0)) or (0, "")
    assert status == 503 and "retry" in message
    assert len(listener.open) == 2


def test_an_address_at_its_cap_gives_up_its_own_idle_connection_else_429():
    listener = ListenerConnections(ConnectionCaps(max_per_client=2))
    other = FakeConnection("b", 0.0)
    mine = [FakeConnection("a", 1.0), FakeConnection("a", 2.0, idle=False)]
    for connection in (other, *mine):
        assert listener.admit(connection) is None
    assert listener.admit(FakeConnection("a", 3.0, idle=False)) is None
    assert (other.closed, mine[0].closed) == (False, True)
    status, message = listener.admit(FakeConnection("a", 4.0, idle=False)) or (0, "")
    assert status == 429 and "2 open connections" in message


def test_release_forgets_a_connection_once():
    listener = ListenerConnections(ConnectionCaps(max_connections=1))
    connection = FakeConnection("a", 0.0)
    listener.admit(connection)
    listener.release(connection)
    listener.release(connection)
    assert not listener.open and not listener.per_client


@contextlib.contextmanager
def capped(caps: ConnectionCaps) -> Iterator[str]:
    app = predict_app(ScriptedService(1))
    with serving(app, **uvicorn_limits(LIMITS, caps), timeout_keep_alive=60) as url:
        yield url


def kept_alive(url: str) -> socket.socket:
    """A connection that has had one answer and is idle now."""
    sock = connect(url)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status_of(read_one_answer(sock)) == 200
    return sock


def half_sent(url: str) -> socket.socket:
    sock = connect(url)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
    time.sleep(0.05)
    return sock


def test_a_new_client_is_served_at_the_cap_by_closing_the_oldest_idle_connection():
    with capped(ConnectionCaps(max_connections=4)) as url:
        idle = [kept_alive(url) for _ in range(4)]
        newcomer = kept_alive(url)
        assert is_closed(idle[0], 2)
        assert not is_closed(idle[1], 0.2)
        newcomer.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert status_of(read_one_answer(newcomer)) == 200


def test_a_new_connection_is_503_when_every_held_one_is_busy():
    with capped(ConnectionCaps(max_connections=4)) as url:
        busy = [half_sent(url) for _ in range(4)]
        refused = connect(url).recv(65536)
        assert status_of(refused) == 503, refused
        body = json.loads(refused.split(b"\r\n\r\n", 1)[1])
        assert body["error_type"] == "Service Unavailable"
        assert b"\r\nretry-after: 1\r\n" in refused
        busy[0].sendall(b"\r\n")
        assert status_of(read_one_answer(busy[0])) == 200


def test_one_address_over_its_cap_is_429_while_its_connections_are_busy():
    with capped(ConnectionCaps(max_connections=100, max_per_client=3)) as url:
        busy = [half_sent(url) for _ in range(3)]
        refused = connect(url).recv(65536)
        assert status_of(refused) == 429, refused
        assert b"3 open connections" in refused
        assert b"\r\nretry-after: 1\r\n" in refused
        for sock in busy:
            sock.close()
