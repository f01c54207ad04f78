"""Runs an :class:`LLMEngine` on its own thread.

Everything else (RPC handlers, transport threads) talks to the engine only through ``call``,
which runs a function on the engine thread between two steps; so the engine itself needs no
locks. The one exception is a hand-off's pages: a transport thread writes them into their
reserved blocks itself (``LLMEngine.take_reservation`` / ``write_pages``), so that a decode step
in progress does not delay them. Events of every step go to ``on_events``, also on the engine
thread. ``on_busy`` hears, on the engine thread, whether the engine has work, before each step
(and after each idle wait), and ``on_stepped`` right after each step (a worker lends or
borrows cores by them). Every ``HOUSEKEEPING_PERIOD_S``
(between two steps, or while idle) the loop also ends reservations past their deadline and runs
``on_housekeeping`` (the worker's own clean-up); each costs a pass over the requests, so not
every step pays it.

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
from typing import TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")
HOUSEKEEPING_PERIOD_S = 0.25


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_events: Callable[[list[TokenEvent]], None],
        on_housekeeping: Callable[[], None] | None = None,
        on_busy: Callable[[bool], None] | None = None,
        on_stepped: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_busy = on_busy
        self._on_stepped = on_stepped
        self._on_events = on_events
        self._on_housekeeping = on_housekeeping
        self._next_housekeeping = 0.0
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], object], Future]] = queue.Queue()
        self._stopped = threading.Event()
        self.num_steps = 0
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int:
        """The OS thread id of the engine thread (its CPU affinity is the worker's)."""
        return self._thread.native_id or 0

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Schedule ``fn(engine)`` on the engine thread; the future holds its result or error."""
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return future

    def run_pending(self) -> None:
        """Engine thread, while it waits between two steps (a lender's pause): run the calls
        queued so far, as if the next step had begun after them."""
        self._run_commands(block=False)

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

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._run_commands(block=not self.engine.has_work())
            self._housekeeping()
            if not self._busy():
                continue
            try:
                events = self.engine.step()
                self.num_steps += 1
                self.stats = self.engine.stats()
            except Exception:
                log.exception("engine step failed; aborting its requests")
                events = self._abort_all("engine step failed")
            self._stepped()
            if events:
                self._emit(events)

    def _busy(self) -> bool:
        busy = self.engine.has_work()
        if self._on_busy is not None:
            try:
                self._on_busy(busy)
            except Exception:
                log.exception("busy callback failed")
        return busy

    def _stepped(self) -> None:
        if self._on_stepped is not None:
            try:
                self._on_stepped()
            except Exception:
                log.exception("step callback failed")

    def _emit(self, events: list[TokenEvent]) -> None:
        try:
            self._on_events(events)
        except Exception:
            log.exception("event callback failed")

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_PERIOD_S
        try:
            self.engine.expire_reservations(now)
            if self._on_housekeeping is not None:
                self._on_housekeeping()
        except Exception:
            log.exception("housekeeping failed")

    def _abort_all(self, error: str) -> list[TokenEvent]:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id, error=error)
        return self.engine.step()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
