"""A synchronous test client of in-process workers' token channels (``workers/token_channel.py``):
what a coordinator's token streams do, with real sockets and no event loop.

A :class:`ChannelReader` is one coordinator (its ``owner`` id): it attaches to each worker it is
given (a DEALER with that routing id, a hello, the welcome awaited), and :meth:`ChannelReader.items`
reads a worker's step messages until a request's final item (a finished event, or a prefill's
hand-off result), keeping other requests' items for later calls. Every wait has a deadline: a
test fails, never hangs. Workers take only requests whose owner is attached: submit them with
:meth:`ChannelReader.request`.

Thread-safe: the socket is read under a lock taken for one short poll at a time, so several
threads may wait for their own requests at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from typing import Any, TypeVar

import zmq

from engine.outputs import TokenEvent
from engine.transfer.security import KVCredentials
from engine.transfer.zmq_security import secure_client
from workers.contracts import GenerationRequest, HandoffResult
from workers.token_wire import HelloMsg, StepMsg, WelcomeMsg, decode, encode

Item = TokenEvent | HandoffResult
OWNER = "tests-coordinator"  # the owner of requests the worker test helpers build
_POLL_MS = 20  # the longest one read holds the lock

R = TypeVar("R", bound=GenerationRequest)


def is_final(item: Item) -> bool:
    """Whether nothing follows ``item`` for its request from that worker."""
    return isinstance(item, HandoffResult) or item.finished


class ChannelReader:
    def __init__(
        self,
        *workers: Any,
        owner: str = OWNER,
        credentials: KVCredentials | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        """Attach to each of ``workers`` (anything with a ``channel``: a ``TokenSender``) as
        ``owner``, each welcome awaited up to ``timeout_s``."""
        self.owner = owner
        self.credentials = credentials
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._sockets: dict[int, zmq.Socket] = {}  # id(worker) -> its DEALER
        self._next_seq: dict[int, int] = {}  # the number of the next step message expected
        self._items: dict[tuple[int, str], list[Item]] = defaultdict(list)
        self._lost: dict[int, set[str]] = defaultdict(set)
        self.messages: dict[int, list[StepMsg]] = defaultdict(list)  # every one read, per worker
        for worker in workers:
            self.attach(worker, timeout_s)

    # ---- attaching ------------------------------------------------------------------------------

    def attach(self, worker: Any, timeout_s: float = 5.0) -> None:
        """Connect to ``worker``'s channel and say hello (again, after :meth:`detach`)."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, self.owner.encode())
        secure_client(socket, self.credentials)
        socket.connect(worker.channel.endpoint)
        socket.send(encode(HelloMsg(self.owner)))
        assert socket.poll(int(timeout_s * 1000)), f"no welcome from {worker.channel.endpoint}"
        welcome = decode(socket.recv())
        assert isinstance(welcome, WelcomeMsg), welcome
        with self._lock:
            old = self._sockets.pop(id(worker), None)
            if old is not None:
                old.close(0)
            self._sockets[id(worker)] = socket
            self._next_seq[id(worker)] = welcome.next_seq

    def detach(self, worker: Any) -> None:
        """Close the connection to ``worker``: to it, this coordinator is gone."""
        with self._lock:
            socket = self._sockets.pop(id(worker))
            socket.close(0)

    def request(self, request: R) -> R:
        """``request`` as this coordinator sends it (the workers take only attached owners)."""
        return dataclasses.replace(request, owner=self.owner)

    # ---- reading --------------------------------------------------------------------------------

    def items(self, worker: Any, request_id: str, timeout_s: float = 10.0) -> list[Item]:
        """Every item of ``request_id`` from ``worker`` up to its final one, within
        ``timeout_s``; fails if it does not end by then, or if its events were dropped."""
        deadline = time.monotonic() + timeout_s
        got: list[Item] = []
        while not got or not is_final(got[-1]):
            left = deadline - time.monotonic()
            assert left > 0, f"{request_id} did not end within {timeout_s} s: {got}"
            got += self.take(worker, request_id, left)
        return got

    def take(self, worker: Any, request_id: str, timeout_s: float = 10.0) -> list[Item]:
        """The items of ``request_id`` from ``worker`` read so far (at least one: waits up to
        ``timeout_s`` for it; [] if none came), its final one last if it came."""
        deadline = time.monotonic() + timeout_s
        key = (id(worker), request_id)
        while True:
            with self._lock:
                if self._items.get(key):
                    return self._items.pop(key)
                assert request_id not in self._lost[id(worker)], f"{request_id}'s events were lost"
                if time.monotonic() >= deadline:
                    return []
                self._read(worker, _POLL_MS)

    def pending(self, worker: Any, timeout_s: float = 0.2) -> list[Item]:
        """Whatever ``worker`` sent within ``timeout_s`` that no call took yet (any request)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while time.monotonic() < deadline:
                self._read(worker, _POLL_MS)
            keys = [key for key in self._items if key[0] == id(worker)]
            return [item for key in keys for item in self._items.pop(key)]

    def lost(self, worker: Any) -> set[str]:
        """The requests ``worker`` said it dropped events of (a step message's ``lost``)."""
        with self._lock:
            return set(self._lost[id(worker)])

    def _read(self, worker: Any, timeout_ms: int) -> None:
        """Read every step message waiting from ``worker`` (waiting up to ``timeout_ms`` for
        the first), filing their items by request; under the lock."""
        socket = self._sockets.get(id(worker))
        assert socket is not None, "not attached to this worker"
        if not socket.poll(timeout_ms):
            return
        while socket.poll(0):
            msg = decode(socket.recv())
            assert isinstance(msg, StepMsg), msg
            expected = self._next_seq[id(worker)]
            assert msg.seq == expected, f"step message {msg.seq} after {expected - 1}: one lost"
            self._next_seq[id(worker)] = expected + 1
            self.messages[id(worker)].append(msg)
            self._lost[id(worker)] |= set(msg.lost)
            items: list[Item] = [*msg.events, *msg.handoffs]
            for item in items:
                self._items[(id(worker), item.request_id)].append(item)

    # ---- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            for socket in self._sockets.values():
                socket.close(0)
            self._sockets.clear()
        self._context.term()

    def __enter__(self) -> ChannelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
