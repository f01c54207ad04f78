"""The coordinator's end of the workers' token channels (``workers/token_channel.py``).

Life cycle: the coordinator builds one :class:`TokenStreams` (its ``coordinator_id`` is the
routing id of all its sockets) and, for each worker, awaits :meth:`TokenStreams.connect` with
the endpoint the worker announced: a DEALER connects, says hello, and ``connect`` returns once
the worker welcomed it. Each channel is read by a callback on the event loop, called when its
socket (or its monitor) signals: it takes every message waiting and hands every event to its
request's queue without ever waiting (no task, future or poller per message: on a 2-core host
the asyncio sockets' machinery cost ~1 ms of the coordinator's CPU a step message). A request's
items from one worker are read from
:meth:`TokenStreams.open` (request id, worker), called before the request is sent there (an
item for a request not open is counted and dropped): an async iterator that ends after its final
item (a prefill's first token and hand-off result come on the prefill worker's stream, the rest
on the decode worker's, so each is in order); :meth:`TokenStreams.close` forgets it early.
:meth:`TokenStreams.aclose` at the coordinator's end closes everything.

Bounds and failures (each ends the request's stream with a failure event its caller acts on):

- a request whose queue holds ``max_queued_events`` unread events is overflowed: its queue is
  emptied and ends with a ``stream_overflow`` failure, so one slow reader never holds back the
  others' events (the caller aborts it on its worker);
- a worker that goes away (its socket closed or silent past the heartbeat: the socket monitor
  says disconnected; or the caller's :meth:`TokenStreams.worker_lost`, from its load poll) ends
  every request on it with a ``worker_lost`` failure, after the events already queued;
- events the worker dropped (its queue to us was full) end their requests with an
  ``events_lost`` failure, and a gap in a worker's message numbers (a message lost on the
  way) ends every request on that worker the same way.

Security is the KV plane's (``engine/transfer/zmq_security.py``): the DEALER is a client with
the share of the pool's credentials that is the counterpart of the worker's
(:func:`counterpart`), a plaintext gate, or None (loopback without credentials).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from coordinator.pool.token_stream import StreamItem, TokenStream, WorkerKey
from engine.outputs import TokenEvent
from engine.transfer.security import ClusterCredentials, KVCredentials
from engine.transfer.zmq_security import secure_client
from workers.token_wire import PROTOCOL_VERSION, HelloMsg, StepMsg, WelcomeMsg, decode, encode

log = logging.getLogger(__name__)
MAX_QUEUED_EVENTS = 4096  # unread events of one request before it is overflowed
MAX_STEP_BYTES = 64 << 20  # a longer frame from a worker drops its connection
HEARTBEAT_MS = 1000  # a worker silent for HEARTBEAT_TIMEOUT_MS is disconnected (lost)
HEARTBEAT_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_S = 3.0  # a welcome takes milliseconds; a worker that died meanwhile never sends it
RECONNECT_MAX_MS = 5000  # a lost worker's address is retried at most this often
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_YIELD_EVERY = 256  # messages taken in a row before the readers get a turn


class TokenChannelError(ConnectionError):
    """A worker's token channel did not come up."""


def counterpart(
    keys: ClusterCredentials, worker_share: KVCredentials | None
) -> KVCredentials | None:
    """The share a coordinator connects with to a worker holding ``worker_share`` (what
    ``transfer_credentials`` gave it): the other role's, or its gate when the worker's is a
    plaintext gate."""
    if worker_share is None:
        return None
    receiver = worker_share.curve_public == keys.receiver.curve_public
    other = keys.sender if receiver else keys.receiver
    return other if worker_share.encrypts else other.plaintext_gate()


class _Channel:
    """One worker's DEALER, its monitor, and where its messages are."""

    def __init__(self, worker: WorkerKey, socket: zmq.Socket, endpoint: str) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.socket = socket
        self.monitor: zmq.Socket = socket.get_monitor_socket(_MONITORED)
        self.monitor.setsockopt(zmq.LINGER, 0)  # a context's end never waits for its events
        self.welcomed = asyncio.Event()  # up: welcomed, and not disconnected since
        self.welcome_came = asyncio.Event()  # set by every welcome (a hello said again)
        self.refusal = ""  # why a welcome was refused (another protocol version)
        self.next_seq = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # whose readers watch the sockets
        self.closed = False

    def watch(self, loop: asyncio.AbstractEventLoop, readable: Callable[[], None]) -> None:
        """Call ``readable`` on ``loop`` whenever either socket signals, and once now (what
        came before). The signal is edge-triggered: ``readable`` must take everything."""
        self.loop = loop
        loop.add_reader(self.socket.FD, readable)
        loop.add_reader(self.monitor.FD, readable)
        loop.call_soon(readable)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.loop is not None:
            # its loop is gone (abandon): its selector went with it
            with contextlib.suppress(RuntimeError, AttributeError, ValueError, OSError):
                self.loop.remove_reader(self.socket.FD)
                self.loop.remove_reader(self.monitor.FD)
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)


def _take(socket: zmq.Socket) -> list[bytes] | None:
    """The next message waiting on ``socket``, None if there is none."""
    if not cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        return None
    try:
        return socket.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


class TokenStreams:
    def __init__(self, coordinator_id: str, max_queued_events: int = MAX_QUEUED_EVENTS) -> None:
        self.coordinator_id = coordinator_id
        self.max_queued_events = max_queued_events
        self.loop = asyncio.get_running_loop()  # its sockets' and tasks' loop
        self._context = zmq.Context()
        self._channels: dict[WorkerKey, _Channel] = {}
        self._streams: dict[tuple[str, WorkerKey], TokenStream] = {}
        self.num_unrouted = 0  # events for requests not open here
        self.num_overflowed = 0  # requests ended for a full queue
        self.num_gaps = 0  # step messages lost on the way (by their numbers)
        self.num_malformed = 0  # frames that were no channel message

    # ---- channels ------------------------------------------------------------------------------

    async def connect(
        self,
        worker: WorkerKey,
        endpoint: str,
        credentials: KVCredentials | None = None,
        timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        """Connect to ``worker``'s channel at ``endpoint`` (replacing one it had: see
        :meth:`disconnect`) and wait until it welcomed us (TokenChannelError past ``timeout_s``)."""
        self.disconnect(worker)
        channel = _Channel(worker, self._dealer(credentials), endpoint)
        self._channels[worker] = channel
        channel.watch(self.loop, lambda: self._readable(channel))
        channel.socket.connect(endpoint)  # _readable says hello once the handshake is done
        try:
            await asyncio.wait_for(channel.welcomed.wait(), timeout_s)
        except TimeoutError:
            self.disconnect(worker)
            message = f"no welcome from {worker} at {endpoint} in {timeout_s} s{channel.refusal}"
            raise TokenChannelError(message) from None

    def _dealer(self, credentials: KVCredentials | None) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, self.coordinator_id.encode())
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_STEP_BYTES)
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        secure_client(socket, credentials)
        return socket

    def disconnect(self, worker: WorkerKey) -> None:
        """Close ``worker``'s channel, if any; if it was up, its open requests end as lost (one
        already down ended them when it went: those opened since wait for a new one)."""
        channel = self._channels.pop(worker, None)
        if channel is not None:
            channel.close()
            if channel.welcomed.is_set():
                self.worker_lost(worker, "worker failed: its token channel was closed")

    async def hello(self, worker: WorkerKey, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Say hello again on ``worker``'s channel (the worker no longer counts us attached)
        and wait for its welcome (TokenChannelError past ``timeout_s``)."""
        channel = self._channels[worker]
        channel.welcome_came.clear()
        try:
            channel.socket.send(encode(HelloMsg(self.coordinator_id)), zmq.NOBLOCK)
        except zmq.Again:
            raise TokenChannelError(f"{worker}'s channel takes no message now") from None
        finally:
            self.loop.call_soon(self._readable, channel)  # a send may take the socket's signal
        try:
            await asyncio.wait_for(channel.welcome_came.wait(), timeout_s)
        except TimeoutError:
            message = f"no welcome from {worker} in {timeout_s} s{channel.refusal}"
            raise TokenChannelError(message) from None

    def endpoint_of(self, worker: WorkerKey) -> str:
        """The endpoint ``worker``'s channel connects to ("" without one)."""
        channel = self._channels.get(worker)
        return "" if channel is None else channel.endpoint

    def connected(self, worker: WorkerKey) -> bool:
        """Whether ``worker``'s channel is up (welcomed and not disconnected since)."""
        channel = self._channels.get(worker)
        return channel is not None and channel.welcomed.is_set()

    def _readable(self, channel: _Channel) -> None:
        """A channel's socket or monitor signalled (a failure here loses the worker's
        requests, never hangs them)."""
        if channel.closed:
            return
        try:
            self._receive(channel)
        except Exception:
            log.exception("token channel of %s failed", channel.worker)
            channel.close()
            channel.welcomed.clear()
            self.worker_lost(channel.worker, "the token channel failed")

    def _receive(self, channel: _Channel) -> None:
        """Take every message waiting, then the monitor's events, until neither socket has
        any (so that what the worker sent before its connection dropped reaches its requests
        before the drop ends them). During a flood, the readers get a turn every
        ``_YIELD_EVERY`` messages: the rest is taken by a call scheduled after them."""
        taken = 0
        while True:
            while (frames := _take(channel.socket)) is not None:
                self._on_frame(channel, frames[-1])
                taken += 1
                if taken == _YIELD_EVERY:
                    self.loop.call_soon(self._readable, channel)
                    return
            if (frames := _take(channel.monitor)) is None:
                return
            self._on_monitor(channel, parse_monitor_message(frames)["event"])

    def _on_frame(self, channel: _Channel, frame: bytes) -> None:
        try:
            msg = decode(frame)
        except ValueError as exc:
            self.num_malformed += 1
            log.warning("token channel of %s: malformed frame (%s)", channel.worker, exc)
            return
        if isinstance(msg, StepMsg):
            self._deliver(channel, msg)
        elif isinstance(msg, WelcomeMsg):
            self._welcome(channel, msg)

    def _welcome(self, channel: _Channel, msg: WelcomeMsg) -> None:
        if msg.version != PROTOCOL_VERSION:
            channel.refusal = f": it speaks version {msg.version}, not {PROTOCOL_VERSION}"
            log.error("token channel of %s refused%s", channel.worker, channel.refusal)
            return
        channel.next_seq = msg.next_seq
        channel.welcomed.set()
        channel.welcome_came.set()

    def _deliver(self, channel: _Channel, msg: StepMsg) -> None:
        # before the welcome (a handed-over connection) the numbers are not ours to check yet
        if msg.seq != channel.next_seq and channel.welcomed.is_set():
            self.num_gaps += 1
            self._end_all(channel.worker, "token events were lost on the way", "events_lost")
        channel.next_seq = msg.seq + 1
        worker = channel.worker
        for request_id in msg.lost:
            self._end((request_id, worker), "the worker dropped token events", "events_lost")
        items: list[StreamItem] = [*msg.events, *msg.handoffs]
        for item in items:
            stream = self._streams.get((item.request_id, worker))
            if stream is None or stream.ended:
                self.num_unrouted += 1
            elif not stream.push(item):
                self.num_overflowed += 1

    def _on_monitor(self, channel: _Channel, event: int) -> None:
        """Hello after each handshake (the first one, and after a reconnect); a drop of a
        welcomed connection loses the worker's requests (their events may be gone with it)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            with contextlib.suppress(zmq.Again):
                channel.socket.send(encode(HelloMsg(self.coordinator_id)), zmq.NOBLOCK)
        elif event == zmq.EVENT_DISCONNECTED and channel.welcomed.is_set():
            channel.welcomed.clear()
            self.worker_lost(channel.worker, "worker failed: its token channel disconnected")

    # ---- requests ------------------------------------------------------------------------------

    def open(self, request_id: str, worker: WorkerKey) -> TokenStream:
        """The items of ``request_id`` from ``worker``, up to its final one."""
        key = (request_id, worker)
        if key in self._streams:
            raise ValueError(f"request id {request_id!r} is already open on {worker}")
        stream = TokenStream(request_id, worker, self.max_queued_events, self._forget)
        self._streams[key] = stream
        return stream

    def close(self, stream: TokenStream) -> None:
        """Forget ``stream``: its iterator ends after what it holds; later items drop."""
        if self._streams.get((stream.request_id, stream.worker)) is stream:
            del self._streams[(stream.request_id, stream.worker)]
        stream.stop()

    def _forget(self, stream: TokenStream) -> None:
        """``stream``'s reader took its final item: it is done."""
        key = (stream.request_id, stream.worker)
        if self._streams.get(key) is stream:
            del self._streams[key]

    def __len__(self) -> int:
        return len(self._streams)

    def worker_lost(self, worker: WorkerKey, error: str = "the worker was lost") -> int:
        """End every open request on ``worker`` with a ``worker_lost`` failure; how many."""
        return self._end_all(worker, error, "worker_lost")

    def _end_all(self, worker: WorkerKey, error: str, cause: str) -> int:
        ended = [s for s in self._streams.values() if s.worker == worker and not s.ended]
        for stream in ended:
            stream.end(TokenEvent.failure(stream.request_id, error, cause))
        return len(ended)

    def _end(self, key: tuple[str, WorkerKey], error: str, cause: str) -> None:
        stream = self._streams.get(key)
        if stream is not None and not stream.ended:
            stream.end(TokenEvent.failure(stream.request_id, error, cause))

    def abandon(self) -> None:
        """Close every socket without its loop (which ended: its readers are gone)."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self._context.destroy(linger=0)

    async def aclose(self) -> None:
        """Close every channel (their open requests end as lost) and the context."""
        for worker in list(self._channels):
            self.disconnect(worker)
        self._context.destroy(linger=0)
