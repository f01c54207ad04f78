"""The connections a sender keeps, one per receiver endpoint (a ZMQ socket, a gRPC channel).

A connection is opened by the first transfer to its endpoint and reused by the next ones. It is
closed, so that their number stays bounded by the endpoints in use:

- when a transfer over it broke (no answer in time, connection error): ``discard``. The next
  transfer opens a fresh one, so a late answer on the old one is never read, and an endpoint
  that is gone for good (its decode worker died) keeps nothing open;
- when nothing used it for ``idle_s`` (a decode worker restarted on another port, or removed,
  is never sent to again): checked whenever a transfer starts;
- when the sender closes.

A connection that transfers are still using is closed as soon as the last of them is over.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
IDLE_CLOSE_S = 300.0


@dataclass(eq=False)
class Link(Generic[T]):
    """One endpoint's connection and who is using it."""

    conn: T
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    discarded: bool = False  # no new transfer takes it; closed when its last user is done


class EndpointCache(Generic[T]):
    def __init__(
        self,
        open_conn: Callable[[str], T],
        close_conn: Callable[[T], None],
        idle_s: float = IDLE_CLOSE_S,
    ) -> None:
        self._open = open_conn
        self._close = close_conn
        self._idle_s = idle_s
        self._links: dict[str, Link[T]] = {}
        self._guard = threading.Lock()

    def __len__(self) -> int:
        with self._guard:
            return len(self._links)

    @contextmanager
    def lease(self, endpoint: str) -> Iterator[Link[T]]:
        """The endpoint's connection (opened now if there is none) for one transfer."""
        with self._guard:
            idle = self._take_idle()
            link = self._links.get(endpoint)
            if link is None:
                link = self._links[endpoint] = Link(self._open(endpoint))
            link.users += 1
        for stale in idle:
            self._close(stale.conn)
        try:
            yield link
        finally:
            with self._guard:
                link.users -= 1
                link.last_used = time.monotonic()
                done = link.discarded and link.users == 0
            if done:
                self._close(link.conn)

    def discard(self, endpoint: str, link: Link[T]) -> None:
        """A transfer over ``link`` broke: nothing takes it again; it closes when unused."""
        with self._guard:
            link.discarded = True
            if self._links.get(endpoint) is link:
                del self._links[endpoint]
            done = link.users == 0
        if done:
            self._close(link.conn)

    def close(self) -> None:
        """Close every connection (those in use once their transfers are over)."""
        with self._guard:
            links, self._links = list(self._links.values()), {}
            for link in links:
                link.discarded = True
            unused = [link for link in links if link.users == 0]
        for link in unused:
            self._close(link.conn)

    def _take_idle(self) -> list[Link[T]]:
        """Under the guard: forget the links unused for ``idle_s``; the caller closes them."""
        horizon = time.monotonic() - self._idle_s
        idle = [
            (endpoint, link)
            for endpoint, link in self._links.items()
            if link.users == 0 and link.last_used < horizon
        ]
        for endpoint, link in idle:
            link.discarded = True
            del self._links[endpoint]
        return [link for _, link in idle]
