"""The HTTP edge: what a client must do within bounds before the app sees its request.

uvicorn's httptools protocol with the limits it lacks, each refused with the coordinator's JSON
error body and the connection closed. Each limit follows the parser's own request boundaries,
never the answers, so every request of every connection is under them, whatever the one before
it did (answered before its body was read, pipelined behind a stream, refused):

- **Header bytes**: a request line plus headers over ``max_header_bytes`` → 431. The bytes are
  counted as they arrive, before the parser sees them (fed to it in slices, so a next request
  beginning inside a chunk is counted from at most :data:`SLICE_BYTES` in), so an endless header
  costs at most the limit (the parser joins a header's fragments, which is quadratic in its
  length).
- **Header deadline**: the headers must be complete ``header_timeout_s`` after the connection
  opens, or after the previous request is read and answered → 408; a connection that sent
  nothing of a next request by then is closed. Always armed while no answer is under way.
- **Body deadline**: the body must be complete ``body_timeout_s`` after its headers → 408 when
  no answer has started, else the connection is closed (the handler sees a disconnect, which
  aborts its request on the workers). A body still arriving after its answer is read and dropped
  up to :data:`DRAIN_BYTES` (so a small one keeps the connection), then the connection is closed;
  an answer that comes before the end of a body that may be longer (declared so, or chunked)
  says ``connection: close``, so that no client sends its next request on a connection about to
  close.
- **Pipelining**: at most :data:`PIPELINE_DEPTH` requests wait behind the one being answered.
- **Connections**: per-listener caps (:mod:`coordinator.connection_caps`), the oldest idle
  connection closed to make room.

Requests are shed by the door gate (429 per request), not by uvicorn's ``limit_concurrency``,
which would count idle connections and answer 503 on every listener, the probes' too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.connection_caps import ConnectionCaps, ListenerConnections
from coordinator.errors import RETRY_BUSY_S

log = logging.getLogger(__name__)
SLICE_BYTES = 16 * 1024  # the most of a next request fed uncounted when it begins mid-chunk
DRAIN_BYTES = 64 * 1024  # the most of a body read and dropped after its answer
PIPELINE_DEPTH = 16  # requests queued behind the one being answered before the connection closes
REASONS = {429: "Too Many Requests", 503: "Service Unavailable"}


@dataclass(frozen=True)
class EdgeLimits:
    """The bounds of :mod:`coordinator.http_edge`; seconds and bytes."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0


def error_bytes(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response, the coordinator's JSON error body, ``connection: close``; a
    429 or 503 (a connection cap) with ``Retry-After``."""
    body = json.dumps({"error": message, "error_type": reason}).encode()
    retry = f"retry-after: {RETRY_BUSY_S}\r\n" if status in (429, 503) else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{retry}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """httptools' protocol under the edge's limits (``limits`` and ``listener`` are set on the
    subclass :func:`guarded_protocol` makes for each listener)."""

    limits = EdgeLimits()
    listener = ListenerConnections(ConnectionCaps())

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.client_host = self.client[0] if self.client else ""
        self.header_bytes = 0
        self.reading_headers, self.reading_body = True, False
        self.request_begun = False  # the parser has seen a byte of the request it waits for
        self.drained_bytes: int | None = None  # counted once an answer came before its body's end
        self.keep_alive_once_read = False  # kept alive only if its long body is read first
        self.idle_since = self.loop.time()
        self.body_deadline: asyncio.TimerHandle | None = None
        self.header_deadline: asyncio.TimerHandle | None = None
        refusal = self.listener.admit(self)
        if refusal is not None:
            status, message = refusal
            self.refuse(status, REASONS[status], message)
            return
        self.arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.release(self)
        self.cancel_deadlines()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.feed(memoryview(data))

    def feed(self, data: memoryview) -> None:
        """Feed ``data`` to the parser a slice at a time, counting a request's head as it comes."""
        while data and not self.transport.is_closing():
            if self.reading_headers:
                room = self.limits.max_header_bytes - self.header_bytes
                if room <= 0:
                    self.refuse_long_head()
                    return
                piece = data[: min(room, SLICE_BYTES)]
                self.header_bytes += len(piece)
            else:
                piece = data[:SLICE_BYTES]
                if self.drained_bytes is not None:
                    self.drained_bytes += len(piece)
                    if self.drained_bytes > DRAIN_BYTES:
                        self.transport.close()  # answered already: nothing more to say
                        return
            data = data[len(piece) :]
            super().data_received(piece)  # type: ignore[arg-type]

    def refuse_long_head(self) -> None:
        limit = self.limits.max_header_bytes
        message = f"the request line and headers may hold at most {limit} bytes; more were sent"
        self.refuse(431, "Request Header Fields Too Large", message)

    def on_message_begin(self) -> None:
        self.request_begun = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self.reading_headers, self.reading_body = False, True
        self.cancel(self.header_deadline)
        self.body_deadline = self.loop.call_later(self.limits.body_timeout_s, self.body_expired)
        super().on_headers_complete()
        cycle, self.keep_alive_once_read = self.cycle, False
        if cycle is not None and cycle.keep_alive and body_may_outgrow_the_drain(self.headers):
            # Kept alive only if the body is read before the answer starts (on_message_complete).
            self.keep_alive_once_read, cycle.keep_alive = True, False
        if len(self.pipeline) > PIPELINE_DEPTH:
            log.info("closed %s: over %d pipelined requests", self.client, PIPELINE_DEPTH)
            self.transport.close()

    def on_message_complete(self) -> None:
        self.cancel(self.body_deadline)
        cycle = self.cycle
        if self.keep_alive_once_read and cycle is not None and not cycle.response_started:
            cycle.keep_alive = True
        self.keep_alive_once_read = False
        super().on_message_complete()
        self.reading_body, self.drained_bytes = False, None
        self.reading_headers, self.header_bytes, self.request_begun = True, 0, False
        self.arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        self.idle_since = self.loop.time()
        if self.reading_body:
            self.drained_bytes = 0  # answered before its body's end: drop what is left of it
        elif self.reading_headers:
            self.arm_header_deadline()  # the next request's headers count from this answer

    def is_idle(self) -> bool:
        """Between requests, nothing of a next one sent, nothing being answered."""
        answering = self.cycle is not None and not self.cycle.response_complete
        return self.reading_headers and not self.request_begun and not answering

    def close_idle(self) -> None:
        self.cancel_deadlines()
        self.transport.close()

    def arm_header_deadline(self) -> None:
        self.cancel(self.header_deadline)
        self.header_deadline = self.loop.call_later(
            self.limits.header_timeout_s, self.headers_expired
        )

    def headers_expired(self) -> None:
        if not self.reading_headers or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # an answer is under way: the deadline is armed again when it ends
        if not self.request_begun:
            self.transport.close()  # an idle connection: nothing to answer
            return
        timeout = self.limits.header_timeout_s
        self.refuse(408, "Request Timeout", f"the request headers took over {timeout:g} s")

    def body_expired(self) -> None:
        if not self.reading_body or self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
            return
        timeout = self.limits.body_timeout_s
        self.refuse(408, "Request Timeout", f"the request body took over {timeout:g} s")

    def refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` (unless an answer is already under way) and close; the request
        (if the app has it) sees a disconnect."""
        log.info("refused %s: %d %s", self.client or "a client", status, message)
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.response_started = cycle.response_complete = True
            cycle.disconnected = True
            cycle.message_event.set()
        self.cancel_deadlines()
        if not answering:
            self.transport.write(error_bytes(status, reason, message))
        self.transport.close()

    def cancel_deadlines(self) -> None:
        self.cancel(self.header_deadline)
        self.cancel(self.body_deadline)

    @staticmethod
    def cancel(handle: asyncio.TimerHandle | None) -> None:
        if handle is not None:
            handle.cancel()


def body_may_outgrow_the_drain(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's body, by its headers, may hold over :data:`DRAIN_BYTES`."""
    for name, value in headers:
        if name == b"content-length":
            return not value.isdigit() or int(value) > DRAIN_BYTES
        if name == b"transfer-encoding":
            return True
    return False


def guarded_protocol(limits: EdgeLimits, caps: ConnectionCaps) -> type[GuardedHttpProtocol]:
    """The protocol class of one listener (``uvicorn.Config(http=...)``): these limits, and a
    connection registry of its own under ``caps``."""
    members = {"limits": limits, "listener": ListenerConnections(caps)}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), members)


def uvicorn_limits(limits: EdgeLimits, caps: ConnectionCaps | None = None) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments of one guarded listener (call it once per listener)."""
    return {"http": guarded_protocol(limits, caps or ConnectionCaps()), "limit_concurrency": None}
