"""HTTP/1.1 on a raw socket, for tests of the edge: what a client library would never send."""

from __future__ import annotations

import contextlib
import re
import socket
from urllib.parse import urlsplit

STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def status_of(response: bytes) -> int:
    """The status of the first answer in ``response`` (0: none)."""
    return int(response.split(b" ", 2)[1]) if response else 0


def statuses_of(received: bytes) -> list[int]:
    """The status of every answer in ``received`` (bodies are JSON or empty: no status lines)."""
    return [int(code) for code in STATUS_LINE.findall(received)]


def read_one_answer(sock: socket.socket) -> bytes:
    """One whole answer with a ``content-length`` (head and body)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk
    head, body = received.split(b"\r\n\r\n", 1)
    length = re.search(rb"(?i)content-length: (\d+)", head)
    missing = int(length.group(1)) - len(body) if length else 0
    while missing > 0:
        chunk = sock.recv(missing)
        if not chunk:
            break
        body += chunk
        missing -= len(chunk)
    return head + b"\r\n\r\n" + body


def is_closed(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout_s`` (anything it sends is dropped)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True
