"""The HTTP edge: what a client must do within bounds before the app sees its request.

uvicorn's httptools protocol with three limits it lacks, each refused with the coordinator's
JSON error body and the connection closed:

- **Header bytes**: a request line plus headers over ``max_header_bytes`` → 431. The bytes are
  counted as they arrive, before the parser sees them, so an endless header costs at most the
  limit (the parser joins a header's fragments, which is quadratic in its length).
- **Header deadline**: the headers must be complete ``header_timeout_s`` after the connection
  opens, or after the previous response on a kept-alive connection → 408 (a connection that sent
  nothing is just closed).
- **Body deadline**: the body must be complete ``body_timeout_s`` after its headers → 408 when
  no answer has started, else the connection is closed (the handler sees a disconnect, which
  aborts its request on the workers).

uvicorn's own ``limit_concurrency`` (sized from ``max_requests`` by :func:`uvicorn_limits`)
answers 503 to a request that arrives while that many connections or requests are open.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
CONCURRENCY_HEADROOM = 64  # connections beyond max_requests before uvicorn answers 503


@dataclass(frozen=True)
class EdgeLimits:
    """The bounds of :mod:`coordinator.http_edge`; seconds and bytes."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0


def error_bytes(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response, the coordinator's JSON error body, ``connection: close``."""
    body = json.dumps({"error": message, "error_type": reason}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """httptools' protocol with the header cap and the two deadlines (``limits`` is set on the
    subclass :func:`guarded_protocol` makes)."""

    limits = EdgeLimits()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.header_bytes = 0
        self.reading_headers = True
        self.body_deadline: asyncio.TimerHandle | None = None
        self.header_deadline: asyncio.TimerHandle | None = None
        self.arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_deadlines()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.reading_headers:
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - self.header_bytes
        head, rest = data[:room], data[room:]
        self.header_bytes += len(head)
        super().data_received(head)
        if rest and self.reading_headers and not self.transport.is_closing():
            limit = self.limits.max_header_bytes
            message = f"the request line and headers may hold at most {limit} bytes; more were sent"
            self.refuse(431, "Request Header Fields Too Large", message)
        elif rest and not self.transport.is_closing():
            super().data_received(rest)

    def on_headers_complete(self) -> None:
        self.reading_headers = False
        self.cancel(self.header_deadline)
        self.body_deadline = self.loop.call_later(self.limits.body_timeout_s, self.body_expired)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.cancel(self.body_deadline)
        super().on_message_complete()
        self.expect_next_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.expect_next_request()

    def expect_next_request(self) -> None:
        """Once the latest request is read and answered, the next one's headers are counted
        and timed."""
        cycle = self.cycle
        if cycle.response_complete and not cycle.more_body and not self.transport.is_closing():
            self.reading_headers, self.header_bytes = True, 0
            self.arm_header_deadline()

    def arm_header_deadline(self) -> None:
        self.cancel(self.header_deadline)
        self.header_deadline = self.loop.call_later(
            self.limits.header_timeout_s, self.headers_expired
        )

    def headers_expired(self) -> None:
        if not self.reading_headers or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request is still being answered
        if self.header_bytes == 0:
            self.transport.close()  # an idle connection: nothing to answer
            return
        timeout = self.limits.header_timeout_s
        self.refuse(408, "Request Timeout", f"the request headers took over {timeout:g} s")

    def body_expired(self) -> None:
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        if cycle.response_started:
            self.transport.close()
            return
        timeout = self.limits.body_timeout_s
        self.refuse(408, "Request Timeout", f"the request body took over {timeout:g} s")

    def refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` and close; the request (if the app has it) sees a disconnect."""
        log.info("refused %s: %d %s", self.client or "a client", status, message)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.response_started = self.cycle.response_complete = True
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.cancel_deadlines()
        self.transport.write(error_bytes(status, reason, message))
        self.transport.close()

    def cancel_deadlines(self) -> None:
        self.cancel(self.header_deadline)
        self.cancel(self.body_deadline)

    @staticmethod
    def cancel(handle: asyncio.TimerHandle | None) -> None:
        if handle is not None:
            handle.cancel()


def guarded_protocol(limits: EdgeLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


def uvicorn_limits(limits: EdgeLimits, max_requests: int) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments of a guarded listener."""
    return {
        "http": guarded_protocol(limits),
        "limit_concurrency": max_requests + CONCURRENCY_HEADROOM,
    }
