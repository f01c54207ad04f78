"""How many connections one listener holds, in all and from one client address.

A listener at its cap makes room for a new connection by closing its oldest idle one (kept
alive, between requests, no byte of a next request yet); only when every connection is busy is
the newcomer refused: 503 at the listener's cap, 429 at a client's. Work is shed elsewhere (the
door gate answers 429 per request), so a flood of idle sockets never turns away a client with a
request to send, and a probe listener given no caps sheds nothing at all.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ConnectionCaps:
    """A listener's connection caps; 0: none."""

    max_connections: int = 0
    max_per_client: int = 0


class Connection(Protocol):
    """What the registry needs of a connection (``GuardedHttpProtocol``)."""

    client_host: str
    idle_since: float

    def is_idle(self) -> bool: ...

    def close_idle(self) -> None: ...


class ListenerConnections:
    """The open connections of one listener (one event loop: no lock)."""

    def __init__(self, caps: ConnectionCaps) -> None:
        self.caps = caps
        self.open: dict[Connection, None] = {}  # in the order they opened
        self.per_client: Counter[str] = Counter()

    def admit(self, connection: Connection) -> tuple[int, str] | None:
        """Register ``connection``, closing idle ones to make room; None when admitted, else
        the status and reason to refuse it with (it is not registered then)."""
        caps, host = self.caps, connection.client_host
        at_client_cap = caps.max_per_client and self.per_client[host] >= caps.max_per_client
        if at_client_cap and not self.close_oldest_idle(host):
            limit = caps.max_per_client
            return 429, f"this address holds {limit} open connections, the most allowed"
        at_cap = caps.max_connections and len(self.open) >= caps.max_connections
        if at_cap and not self.close_oldest_idle(None):
            return 503, "the server holds all the connections it allows; retry shortly"
        self.open[connection] = None
        self.per_client[host] += 1
        return None

    def release(self, connection: Connection) -> None:
        if connection not in self.open:
            return
        del self.open[connection]
        host = connection.client_host
        self.per_client[host] -= 1
        if self.per_client[host] <= 0:
            del self.per_client[host]

    def close_oldest_idle(self, host: str | None) -> bool:
        """Close the connection idle longest (of ``host`` when given); False when none is idle."""
        idle = [c for c in self.open if c.is_idle() and (host is None or c.client_host == host)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        self.release(oldest)
        oldest.close_idle()
        return True
