"""The coordinator's uvicorn server: signals left to the coordinator, and a quiet tick."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

TICK_S = 1.0  # how often a server checks it should exit (at once when told) and renews its date
UVICORN_TICKS_PER_S, UVICORN_TICK_PERIOD = 10, 864000


class SignalFreeServer(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM / SIGINT to the coordinator, which drains first, and
    ticks once a second instead of ten times (each tick wakes its event loop: four servers
    ticking cost an idle coordinator ~2 ms of CPU a second), woken at once when told to exit."""

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:  # from any thread
        self._should_exit = value
        wake = getattr(self, "_wake", None)
        if value and wake is not None:
            loop, event = wake
            with contextlib.suppress(RuntimeError):  # its loop has closed
                loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        event = asyncio.Event()
        self._wake = (asyncio.get_running_loop(), event)
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            # uvicorn's tick is 0.1 s and does its per-second work every tenth: here, every tick
            counter = (counter + UVICORN_TICKS_PER_S) % UVICORN_TICK_PERIOD
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), TICK_S)
            should_exit = await self.on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
