"""A uvicorn server on a thread and event loop of its own: the probes run so, so that nothing
the predict port's loop does (a parse, a stall, a flood of connections) delays their answer."""

from __future__ import annotations

import asyncio
import threading

import uvicorn


class ThreadedServer:
    """``server`` served by a daemon thread running its own event loop."""

    def __init__(self, server: uvicorn.Server, name: str) -> None:
        self.server = server
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to exit and wait (at most ``timeout_s``) for its thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            await asyncio.to_thread(self.thread.join, timeout_s)
