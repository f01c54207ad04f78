"""A worker's token channel: every engine step's events to the coordinators, one message each.

Life cycle: the worker builds a :class:`TokenSender` at start; it binds a ROUTER socket on a
random port of ``host`` and tells its ``endpoint`` to the coordinators (with its ``ready``
answer). A coordinator connects a DEALER whose routing id is its ``coordinator_id`` and sends a
``HelloMsg``; the sender answers with a ``WelcomeMsg`` (a listener thread answers while the
engine is idle). From then on, the engine thread calls :meth:`TokenSender.send_step` with each
step's events grouped by the coordinator (owner) of their requests: one ``StepMsg`` per owner.
:meth:`TokenSender.close` at the worker's end closes the socket, which a coordinator sees as the
worker lost.

Sending never blocks the engine thread: every send is NOBLOCK and the ROUTER is mandatory, so a
coordinator that is gone (unroutable) or whose queue of ``max_queued_steps`` messages is full
costs a dropped message, counted (``num_dropped_messages``, ``num_dropped_events``). The owner is
then lagging: :meth:`TokenSender.take_lagging` hands the caller the requests whose events were
dropped (it aborts them), and the owner's next message that gets through names them (``lost``),
so the coordinator ends them at once.

Security is the KV plane's (``engine/transfer/zmq_security.py``), with the share of the pool's
credentials this worker holds: encrypting credentials make the socket a CURVE server admitting
only the other role's key; a plaintext gate admits only the cluster's password (PLAIN); None
(no credentials, allowed on loopback only) admits anyone. So a coordinator connects with the
other role's share (``coordinator.pool.token_streams.counterpart``), which that role's workers
hold too: the channel keeps out strangers, not the cluster's own members. A coordinator that
reconnects under its id takes over its old connection (ROUTER_HANDOVER): with credentials only
the cluster's members can claim an id at all.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections import defaultdict
from typing import cast

import zmq

from engine.config import is_loopback
from engine.errors import ConfigError
from engine.outputs import TokenEvent
from engine.transfer.security import KVCredentials
from engine.transfer.zmq_security import admit_only, secure_server
from workers.contracts import HandoffResult
from workers.token_wire import HelloMsg, StepMsg, WelcomeMsg, decode, encode

log = logging.getLogger(__name__)
MAX_QUEUED_STEPS = 1000  # step messages queued for one coordinator before they are dropped
MAX_HELLO_BYTES = 4096  # a longer frame from a peer drops its connection
HEARTBEAT_MS = 1000  # a coordinator silent for HEARTBEAT_TIMEOUT_MS is disconnected
HEARTBEAT_TIMEOUT_MS = 5000
_LISTEN_S = 0.1  # the listener's longest wait before it checks the socket anyway


class TokenSender:
    def __init__(
        self,
        host: str = "127.0.0.1",
        credentials: KVCredentials | None = None,
        max_queued_steps: int = MAX_QUEUED_STEPS,
    ) -> None:
        if credentials is None and not is_loopback(host):
            raise ConfigError(f"a token channel on {host!r} needs the pool's credentials")
        self._context = zmq.Context()  # its own: the ZAP handler is per context
        self._authenticator = admit_only(self._context, credentials) if credentials else None
        self._socket = self._router(credentials, max_queued_steps)
        port: int = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._lock = threading.Lock()  # the socket is used by the engine thread and the listener
        self._seq: dict[str, int] = defaultdict(int)  # the next step message's number per owner
        self._lost: dict[str, set[str]] = defaultdict(set)  # to name in the next message
        self._lagging: dict[str, set[str]] = defaultdict(set)  # for take_lagging
        self.attached: dict[str, float] = {}  # owner -> when it last said hello (monotonic)
        self.num_dropped_messages = 0
        self.num_dropped_events = 0
        self._stop = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="token-channel", daemon=True)
        self._listener.start()

    def _router(self, credentials: KVCredentials | None, max_queued_steps: int) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable owner is an error, not silence
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a coordinator that reconnects takes over
        socket.setsockopt(zmq.SNDHWM, max_queued_steps)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_HELLO_BYTES)
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        secure_server(socket, credentials)
        return socket

    def send_step(self, events_by_owner: dict[str, list[TokenEvent]]) -> None:
        """One message per owner with its events of this step; never blocks (module
        docstring: what a message that cannot go costs)."""
        with self._lock:
            for owner, events in events_by_owner.items():
                if events:
                    self._send(owner, events)
            self._answer_hellos()

    def send_handoff(self, owner: str, result: HandoffResult) -> None:
        """A prefill's hand-off result, from its sender thread (after the request's first
        token: on the same sequence, so in order); never blocks."""
        with self._lock:
            self._send(owner, [], (result,))

    def is_attached(self, owner: str) -> bool:
        """Whether ``owner`` said hello here (its events can go)."""
        with self._lock:
            self._answer_hellos()
            return owner in self.attached

    def _send(
        self, owner: str, events: list[TokenEvent], handoffs: tuple[HandoffResult, ...] = ()
    ) -> None:
        lost = self._lost.get(owner)
        msg = StepMsg(self._seq[owner], events, tuple(lost) if lost else (), handoffs)
        try:
            self._socket.send_multipart([owner.encode(), encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # Again: its queue is full; EHOSTUNREACH: not connected
            ids = [e.request_id for e in events] + [r.request_id for r in handoffs]
            self._drop(owner, ids, exc)
            return
        self._seq[owner] += 1  # numbers only what went: a gap is a message lost on the way
        if lost:
            del self._lost[owner]

    def _drop(self, owner: str, request_ids: list[str], exc: zmq.ZMQError) -> None:
        if owner not in self._lost:  # once until a message to it gets through again
            log.warning("token channel to %s: step dropped (%s), its requests end", owner, exc)
        if exc.errno == zmq.EHOSTUNREACH:  # not connected: it says hello again when it is
            self.attached.pop(owner, None)
        self._lost[owner] |= set(request_ids)
        self._lagging[owner] |= set(request_ids)
        self.num_dropped_messages += 1
        self.num_dropped_events += len(request_ids)

    def forget(self, owner: str) -> None:
        """Drop what is kept for ``owner`` (its lease lapsed: it is gone for good)."""
        with self._lock:
            for table in (self._lost, self._lagging):
                table.pop(owner, None)

    def take_lagging(self) -> dict[str, set[str]]:
        """The requests of each owner whose events were dropped since the last call (the caller
        aborts them)."""
        with self._lock:
            lagging, self._lagging = dict(self._lagging), defaultdict(set)
            return lagging

    def _listen(self) -> None:
        """Answer hellos while the engine thread sends nothing: wait for the socket's signal
        (or ``_LISTEN_S``), then read what came under the lock."""
        fd = cast(int, self._socket.getsockopt(zmq.FD))
        while not self._stop.is_set():
            select.select([fd], [], [], _LISTEN_S)
            with self._lock:
                if self._stop.is_set():
                    return
                self._answer_hellos()

    def _answer_hellos(self) -> None:
        """Read every frame waiting (under the lock) and welcome each hello."""
        while cast(int, self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = self._socket.recv_multipart(zmq.NOBLOCK)
            owner = frames[0].decode(errors="replace")
            try:
                msg = decode(frames[-1]) if len(frames) == 2 else None
            except ValueError:
                msg = None
            if not isinstance(msg, HelloMsg) or msg.coordinator_id != owner:
                log.warning("token channel: a malformed frame from %r ignored", owner)
                continue
            self.attached[owner] = time.monotonic()
            with contextlib.suppress(zmq.ZMQError):  # gone again: it will say hello again
                welcome = encode(WelcomeMsg(self._seq[owner]))
                self._socket.send_multipart([frames[0], welcome], zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket (a coordinator sees its requests here end as the worker lost)."""
        self._stop.set()
        self._listener.join(timeout=2)
        with self._lock:
            self._socket.close(0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
