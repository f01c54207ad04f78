"""What every worker actor shares: an engine on its own thread, per-request event queues, and
the stream / abort / load methods the cluster client calls.

Worker actors are threaded Ray actors: ``stream`` is a Ray streaming generator that blocks on a
``queue.Queue`` the engine thread fills, so token events reach the client as they are made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.outputs import TokenEvent
from engine.worker.contracts import GenerationRequest, HandoffResult, WorkerLoad

log = logging.getLogger(__name__)


class WorkerRuntime:
    role = "worker"

    def __init__(
        self, config: EngineConfig, instance: int = 0, cpu_ids: tuple[int, ...] | None = None
    ) -> None:
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s %(levelname)s {self.role}[{instance}] %(message)s",
        )
        if cpu_ids:  # own these cores: a prefill and a decode worker never share one
            _pin_process(cpu_ids)
        self.instance = instance
        self.engine = LLMEngine(config)
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self.loop = EngineLoop(self.engine, self._dispatch)

    # ---- events ------------------------------------------------------------------------------

    def _open(self, request_id: str) -> queue.Queue:
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use on {self.role}")
            self._queues[request_id] = queue.Queue()
            return self._queues[request_id]

    def _put(self, request_id: str, item: Any) -> None:
        with self._lock:
            q = self._queues.get(request_id)
        if q is not None:
            q.put(item)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            self._put(event.request_id, event)

    def _drain(self, request_id: str, q: queue.Queue) -> Iterator[Any]:
        """Yield items until a final one (a finished event or a HandoffResult)."""
        try:
            while True:
                item = q.get()
                yield item
                if isinstance(item, HandoffResult) or item.finished:
                    return
        finally:
            with self._lock:
                self._queues.pop(request_id, None)

    def _run(
        self, request: GenerationRequest, add: Callable[[LLMEngine], None] | None = None
    ) -> Iterator[Any]:
        """Queue ``request`` on the engine and yield its stream up to the final item; a request
        the engine refuses ends with an error event. ``add`` (default: :func:`submit`) runs on
        the engine thread."""
        q = self._open(request.request_id)
        try:
            self.loop.call(add or (lambda engine: submit(engine, request))).result()
        except Exception as exc:
            self._put(request.request_id, TokenEvent.failure(request.request_id, str(exc)))
        yield from self._drain(request.request_id, q)

    # ---- methods the client calls --------------------------------------------------------------

    def ready(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "instance": self.instance,
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(self.loop.native_id)),
            "model": self.engine.model_name,
            "layout": self.engine.layout.to_dict(),
        }

    def abort(self, request_id: str) -> bool:
        return self.loop.call(lambda e: e.abort(request_id)).result()

    def load(self) -> WorkerLoad:
        stats = self.loop.call(lambda e: e.stats()).result()
        return WorkerLoad(self.role, self.instance, os.getpid(), stats)


def submit(engine: LLMEngine, request: GenerationRequest, prefill_only: bool = False) -> None:
    """Engine thread: queue ``request`` (:class:`RequestRejectedError` if it can never run)."""
    engine.add_request(
        request.request_id,
        list(request.prompt_token_ids),
        request.params,
        request.priority,
        prefill_only=prefill_only,
    )


def _pin_process(cpu_ids: tuple[int, ...]) -> None:
    """Set the affinity of every thread of this process; threads started later inherit it."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task), cpu_ids)
