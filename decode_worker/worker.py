"""The decode worker: receives a request's KV pages and decodes it in continuous batches.

Life of a request here (the whole hand-off: ``docs/kv-handoff.md``):
1. ``reserve`` takes the :class:`GenerationRequest` and opens its event stream. On the engine
   thread the request becomes RESERVED: blocks for its prompt set aside, with a deadline
   ``reservation_timeout_s`` away. On a full cache it waits up to ``wait_s`` among other
   hand-offs, served by (priority, arrival) (``reservations.py``), else it is refused with the
   reason, worked out on the engine thread. The :class:`Reservation` names this worker's KV
   endpoint for the prefill worker to push to.
2. The transport's receiver thread checks the header's layout (model, dtype, block size, shape)
   against ours. When the pages arrive it takes the reservation (RECEIVING; checked against the
   layout, the block count and the shape) and writes the pages into its blocks right there, then
   acknowledges, so the prefill side may free its copy. (Waiting for the engine thread first would
   cost each hand-off a whole decode step.)
3. Between two steps the engine thread starts the request decoding (RUNNING) with everything else
   running; each token is streamed by ``stream``.
4. It ends on EOS, a stop string or its output limit (``docs/token-accounting.md``), or on
   ``abort``, and its blocks are freed. A reservation ends the same way, through the engine's
   finish path: on ``abort``, or when its deadline passes with no pages (the error "KV pages did
   not arrive within N s"). One that ends while its pages are being written keeps its blocks
   until the write is over.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from decode_worker.reservations import ReservationQueue
from engine.config import EngineConfig, KVTransferConfig
from engine.errors import KVImportError
from engine.llm_engine import LLMEngine
from engine.outputs import TokenEvent
from engine.request import Request
from engine.transfer import create_receiver
from engine.transfer.payload import HandoffState, KVLayout, KVPayload
from engine.worker.contracts import GenerationRequest, Reservation
from engine.worker.runtime import WorkerRuntime


def kv_bind_address(host: str) -> str:
    """The address the KV endpoint binds to and advertises: ``auto`` is this node's IP (pods of
    a Kubernetes RayCluster), anything else is taken as given."""
    if host != "auto":
        return host
    import ray

    return ray.util.get_node_ip_address()


class DecodeWorker(WorkerRuntime):
    role = "decode"

    def __init__(self, config: EngineConfig, transfer: KVTransferConfig, **runtime: Any) -> None:
        """``runtime``: :class:`WorkerRuntime`'s ``instance`` and ``cpu_ids``."""
        super().__init__(config, **runtime)
        self._waiting = ReservationQueue(transfer.reservation_timeout_s)
        host = kv_bind_address(transfer.host)
        self.receiver = create_receiver(transfer.transport, self._on_transfer, host)

    def endpoint(self) -> str:
        return self.receiver.endpoint

    def reserve(self, request: GenerationRequest, wait_s: float = 5.0) -> Reservation:
        """Set blocks aside for an incoming hand-off and open its stream. Waits up to ``wait_s``
        for room; waiting hand-offs are served by priority, then arrival."""
        request_id = request.request_id
        self._open(request_id)
        answer = self.loop.call(lambda e: self._waiting.add(e, request)).result()
        try:
            refusal = answer.result(timeout=wait_s)
        except TimeoutError:
            self.loop.call(lambda e: self._waiting.withdraw(e, request_id)).result()
            refusal = answer.result()
        if refusal is not None:
            self._close(request_id)
            return Reservation.refused(refusal)
        return Reservation(True, self.receiver.endpoint)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        super()._dispatch(events)
        if self._waiting and any(event.finished for event in events):
            self._waiting.grant(self.engine)  # blocks were freed: serve waiting hand-offs

    def stream(self, request_id: str) -> Iterator[TokenEvent]:
        """Token events of a reserved request, up to its finish."""
        with self._lock:
            q = self._queues.get(request_id)
        if q is None:
            unknown = f"request {request_id!r} is unknown to decode worker {self.instance}"
            yield TokenEvent.failure(request_id, unknown)
            return
        yield from self._drain(request_id, q)

    def abort(self, request_id: str) -> bool:
        def abort(engine: LLMEngine) -> bool:
            return self._waiting.cancel(request_id) or engine.abort(request_id)

        return self.loop.call(abort).result()

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def _on_transfer(self, item: KVLayout | KVPayload) -> str | None:
        """Transport thread: the handshake (a layout), then the pages (a payload), written into
        their reserved blocks right here; the engine thread only starts the request decoding."""
        try:
            if isinstance(item, KVLayout):
                self.engine.layout.check_compatible(item)
                return None
            request = self.engine.take_reservation(item)
        except KVImportError as exc:
            return str(exc)
        error = self.engine.write_pages(request, item)
        state = item.state
        self.loop.call(lambda e: self._install(e, request, state, error))
        return error

    def _install(
        self, engine: LLMEngine, request: Request, state: HandoffState, error: str | None
    ) -> None:
        engine.finish_receive(request, state, error)
        self._waiting.grant(engine)  # the blocks of one aborted meanwhile were freed just now
