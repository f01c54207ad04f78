"""Runs an :class:`LLMEngine` on its own thread, which builds it too (``engine/openmp.py``: one
thread of a worker runs OpenMP teams).

Everything else (RPC handlers, transport threads) talks to the engine only through ``call``,
which runs a function on the engine thread between two steps; so the engine itself needs no
locks. The one exception is a hand-off's pages: a transport thread writes them into their
reserved blocks itself (``LLMEngine.take_reservation`` / ``write_pages``, its copy on that thread
alone: ``engine.openmp.serial_here``), so that a decode step in progress does not delay them.

The worker hears the loop through one :class:`EngineHooks` object, every method on the engine
thread: ``on_events`` with the events of every step, and, every
``HOUSEKEEPING_PERIOD_S`` (between two steps, or while idle), ``on_housekeeping``, after the
loop ended reservations past their deadline (each costs a pass over the requests, so not every
step pays it).

``stats`` holds the engine's figures as of the last step, for a caller that cannot wait for the
engine thread (a load poll during a long prefill step).

A caller that stops waiting may ``cancel`` the future of a call that has not started: it never
runs. An error in a callback is logged; the engine thread goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, TypeVar

from engine.openmp import start_building
from engine.outputs import EngineStats, TokenEvent

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
HOUSEKEEPING_PERIOD_S = 0.25


class EngineHooks(Protocol):
    """What the engine thread tells its worker (module docstring)."""

    def on_events(self, events: list[TokenEvent]) -> None: ...

    def on_housekeeping(self) -> None: ...


class EngineLoop:
    def __init__(self, build: Callable[[], LLMEngine], hooks: EngineHooks) -> None:
        """Start the engine thread, have it build the engine with ``build`` (so that the model
        load's parallel regions run on the thread that steps: ``engine/openmp.py``), and return
        once the engine is built; ``build``'s error, if it fails."""
        self.hooks = hooks
        self._next_housekeeping = 0.0
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], object], Future]] = queue.Queue()
        self._stopped = threading.Event()

        def built() -> LLMEngine:
            engine = build()
            self.stats: EngineStats = engine.stats()
            return engine

        self.engine, self._thread = start_building(built, self._run, "engine-loop")

    @property
    def native_id(self) -> int:
        """The OS thread id of the engine thread (its CPU affinity is the worker's)."""
        return self._thread.native_id or 0

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Schedule ``fn(engine)`` on the engine thread; the future holds its result or error."""
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return future

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():  # else its caller gave up: skip it
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # the caller sees it through the future
                    future.set_exception(exc)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, engine: LLMEngine) -> None:
        self.engine = engine
        while not self._stopped.is_set():
            self._run_commands(block=not self.engine.has_work())
            self._housekeeping()
            if not self.engine.has_work():
                continue
            try:
                events = self.engine.step()
                self.stats = self.engine.stats()
            except Exception:
                log.exception("engine step failed; aborting its requests")
                events = self._abort_all("engine step failed")
            if events:
                self._hook("on_events", events)

    def _hook(self, name: str, *args: object) -> None:
        """``hooks.<name>(*args)``; an error is logged and the loop goes on."""
        try:
            getattr(self.hooks, name)(*args)
        except Exception:
            log.exception("%s hook failed", name)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_PERIOD_S
        try:
            self.engine.importer.expire_reservations(now)
            self.engine.pulls.expire(now)
            self.engine.blocks.expire_preferences(now)
            if not self.engine.has_work():  # idle: what a restart should find goes to disk
                self.engine.checkpoint_tiers()
        except Exception:
            log.exception("housekeeping failed")
        self._hook("on_housekeeping")

    def _abort_all(self, error: str) -> list[TokenEvent]:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id, error=error)
        return self.engine.step()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
