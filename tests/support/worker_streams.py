"""Reading in-process worker streams in tests: on a thread, failing instead of hanging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from workers.worker_request import Phase, WorkerRequests


def collect(items: Iterator[Any], timeout_s: float = 10.0) -> list[Any]:
    """Every item of a worker stream, read on a thread; fails instead of hanging."""
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.extend(items), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert not reader.is_alive(), f"stream still open after {timeout_s} s: {got}"
    return got


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def phase_of(requests: WorkerRequests, request_id: str) -> Phase | None:
    """The phase of ``request_id`` on a worker (None: it holds no such request)."""
    with requests._lock:
        request = requests._requests.get(request_id)
        return request.phase if request is not None else None
