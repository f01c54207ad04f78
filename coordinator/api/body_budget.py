"""The coordinator's budget of buffered request bodies: every byte of a ``POST`` body is taken
from one global budget (``request_limit.max_buffered_body_mb``) as its chunk arrives, and given
back when the request ends, so the bodies held at once never pass it whatever ``max_requests``
and the body limit allow (10,000 requests of 2 MB would be 20 GB).

A request whose declared ``Content-Length`` does not fit in what is left is refused before a byte
of its body is read; one whose chunks outgrow what is left (a chunked body, or others that came
first) is refused at the chunk that would pass the budget, and nothing more of it is read. The
door gate (:mod:`~coordinator.api.admission`) answers both 429 with ``Retry-After``.
"""

from __future__ import annotations

from starlette.types import Message, Receive

MIB = 1024 * 1024


class BodyBudgetSpent(Exception):
    """A request's body would pass the budget of buffered bodies."""


class BodyBudget:
    """The bytes of request bodies held now, against ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes, self.held = limit_bytes, 0

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes fit now."""
        return self.held + size <= self.limit_bytes

    def take(self, size: int) -> None:
        """Hold ``size`` more bytes; raises :class:`BodyBudgetSpent` when they do not fit."""
        if not self.fits(size):
            raise BodyBudgetSpent(f"{size} more body bytes do not fit")
        self.held += size

    def give(self, size: int) -> None:
        """Give back ``size`` bytes taken before."""
        self.held -= size


class BudgetedBody:
    """One request's ``receive``, with each body chunk taken from ``budget`` as it arrives;
    :meth:`release` gives back all it took (once the request has ended)."""

    def __init__(self, receive: Receive, budget: BodyBudget) -> None:
        self.server_receive, self.budget, self.taken = receive, budget, 0

    async def receive(self) -> Message:
        message = await self.server_receive()
        if message["type"] == "http.request":
            size = len(message.get("body", b""))
            self.budget.take(size)
            self.taken += size
        return message

    def release(self) -> None:
        self.budget.give(self.taken)
        self.taken = 0


def declared_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The request's ``Content-Length``, 0 when it has none (or not a number)."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return 0
