"""The decode worker: receives a request's KV pages and decodes it in continuous batches.

Life of a request here (the whole hand-off: ``docs/kv-handoff.md``):
1. ``reserve`` takes the :class:`GenerationRequest` (its coordinator attached to this worker's token
   channel: else it is refused with the channel's endpoint). On the engine thread the request
   becomes RESERVED: blocks for its prompt set aside, with a deadline ``reservation_timeout_s``
   away. On a full cache it waits among other hand-offs, served by (priority, arrival)
   (``reservations.py``), else it is refused with the reason, worked out on the engine thread (as no
   room, ``Reservation.full``, when it waited as long as it could, or when
   ``MAX_WAITING_RESERVATIONS`` calls wait already: then at once, holding no thread); ``reserve``
   returns within its ``wait_s`` whatever the engine thread is doing. The request's output limit is
   kept with the reservation (the coordinator's, never the one the pages' message carries). The
   :class:`Reservation` names this worker's KV endpoint for the prefill worker and carries the
   reservation's secret (128 random bits): only pages carrying it are taken.
   Leading blocks of the request already in this worker's prefix cache (an earlier turn of the
   same chat, a shared system prompt) are shared instead of reserved, and the reservation says
   how many: the prefill worker sends only the pages after them.
2. The transport's receiver thread checks the header before any page is read: a live
   reservation with that secret, our layout (model, dtype, block size), a shape and size that
   fit the reserved blocks. When the pages arrive it takes the reservation (RECEIVING; checked
   again, with the request state: the reserved prompt, token ids within the vocabulary, counts
   that fit the blocks) and writes the pages into its blocks right there, then
   acknowledges, so the prefill side may free its copy. (Waiting for the engine thread first would
   cost each hand-off a whole decode step.) A transfer that breaks after its header passed the
   handshake ends the reservation at once, with the error.
3. Between two steps the engine thread starts the request decoding (RUNNING) with everything else
   running; each step's events go on the token channel.
4. It ends on EOS, a stop string or its output limit (``docs/token-accounting.md``), or on
   ``abort``, and its blocks are freed. A reservation ends the same way, through the engine's
   finish path: on ``abort``, or when its deadline passes with no pages (the error "KV pages did
   not arrive within N s"). One that ends while its pages are being written keeps its blocks
   until the write is over.
The request's record goes with its final event (``workers/runtime.py``), or with ``abort``.

Chaos tests break transfers on purpose with ``inject_fault`` (``docs/kv-handoff.md``).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

from decode_worker.reservations import Moved, NoRoom, ReservationQueue
from engine.config import kv_bind_address
from engine.errors import GrammarError, KVImportError
from engine.openmp import serial_here
from engine.outputs import TokenEvent
from engine.request import NewRequest, Request, RequestStatus
from engine.transfer.base import ReceiverLimits, header_limit
from engine.transfer.payload import HandoffState, KVPayload, TransferHeader
from engine.transfer.transports import create_receiver, create_sender
from workers.contracts import GenerationRequest, Reservation, Submitted
from workers.faults import FAULT_INJECTION_ENV, fault_injection_enabled
from workers.handoff_worker import HandoffWorker
from workers.runtime import CONTROL, HANDOFFS, MAX_WAITING_RESERVATIONS, in_group

if TYPE_CHECKING:  # the engine's types: a coordinator imports this module without torch
    from engine.llm_engine import LLMEngine

FAULTS = ("break_transport",)
SETTLE_S = 0.1  # kept of reserve's wait_s for the engine thread to say why it refuses


class DecodeWorker(HandoffWorker):
    role = "decode"

    def open_kv_plane(self) -> None:
        transfer = self.transfer
        self._waiting = ReservationQueue(transfer.reservation_timeout_s)
        self._num_reserving = (
            0  # reserve calls waiting here (each holds one of its group's threads)
        )
        self._slots_lock = threading.Lock()
        self.receiver = create_receiver(
            transfer.transport,
            self._on_transfer,
            kv_bind_address(transfer.host),
            on_broken=self._on_broken,
            limits=ReceiverLimits(
                max_payload_bytes=self.engine.kv_cache_bytes,
                max_header_bytes=header_limit(self.engine.config.scheduler.max_seq_len),
                stream_timeout_s=transfer.transfer_timeout_s,
            ),
            credentials=self.credentials,
        )

    def open_pull_plane(self) -> None:
        """A sender, for the prefixes prefill workers pull from here; it takes no pulls."""
        transfer = self.transfer
        self.sender = create_sender(transfer.transport, transfer.shared_memory,
                                    self.pull_credentials)  # fmt: skip

    @in_group(HANDOFFS)
    def reserve(
        self, request: GenerationRequest, wait_s: float = 5.0, max_output_tokens: int = 0
    ) -> Reservation:
        """Set blocks aside for an incoming hand-off (its events go on the token channel).
        Waits for room, among
        waiting hand-offs served by priority then arrival; returns within ``wait_s``.
        ``max_output_tokens``: the request's output limit, first token included (0: the
        disaggregated limit of its ``max_new_tokens``); kept with the reservation, never taken
        from the pages' message."""
        request_id = request.request_id
        if not self.channel.is_attached(request.owner):
            return Reservation.unattached(self.channel.endpoint)
        if request_id in self.requests:
            return Reservation.refused(f"request id {request_id!r} is already in use")
        token = secrets.token_hex(16)  # only pages carrying it are accepted
        new = self.engine_request(request, max_output_tokens, disaggregated=True)
        try:  # a constraint compiles here, not on the engine thread (workers/runtime.py)
            self.engine.grammars.compile(request.params.constraint)
        except GrammarError as exc:
            return Reservation.refused(str(exc))
        self.leases.renew(request.owner)
        with self._waiting_slot() as admitted:
            if not admitted:
                limit = MAX_WAITING_RESERVATIONS
                reason = f"{limit} hand-offs already wait for KV blocks here"
                return Reservation.no_room(reason, self._waiting.drain_s)
            self.requests.open(request_id, request.owner)
            try:
                answer = self._wait_for_blocks(new, token, max(wait_s, 0.0))
            except BaseException:
                self.requests.close(request_id)
                raise
        if isinstance(answer, str):
            self.requests.close(request_id)
            if isinstance(answer, NoRoom):
                return Reservation.no_room(answer, answer.retry_after_s)
            if isinstance(answer, Moved):
                return Reservation.moved(answer)
            return Reservation.refused(answer)
        return Reservation(True, self.receiver.endpoint, token=token, num_cached_blocks=answer)

    @contextlib.contextmanager
    def _waiting_slot(self) -> Iterator[bool]:
        """One of the ``MAX_WAITING_RESERVATIONS`` places of a ``reserve`` call waiting here
        (False: none free), held while the call waits."""
        with self._slots_lock:
            admitted = self._num_reserving < MAX_WAITING_RESERVATIONS
            self._num_reserving += admitted
        try:
            yield admitted
        finally:
            if admitted:
                with self._slots_lock:
                    self._num_reserving -= 1

    def _wait_for_blocks(self, new: NewRequest, token: str, wait_s: float) -> int | str:
        """Once blocks are reserved, how many leading ones the prefix cache gave; else why not,
        within ``wait_s`` (the last ``SETTLE_S`` of it for the engine thread to say why)."""
        deadline = time.monotonic() + wait_s
        answer: Future[int | str] = Future()

        def add(engine: LLMEngine) -> None:
            if new.request_id in self.requests:  # else aborted before this thread got to it
                self._waiting.add(engine, new, token, answer, deadline)
            elif not answer.done():
                answer.set_result("aborted before its blocks were reserved")

        added = self.loop.call(add)
        with contextlib.suppress(TimeoutError):
            return answer.result(timeout=_left(deadline - min(SETTLE_S, wait_s / 2)))
        self.loop.call(lambda e: self._waiting.withdraw(e, new.request_id))
        with contextlib.suppress(TimeoutError):
            return answer.result(timeout=_left(deadline))
        if answer.cancel():  # the engine thread is busy: it drops the waiter when it gets to it
            added.cancel()  # or never even queues it
            return NoRoom(f"decode worker busy: no answer within {wait_s:.1f} s")
        return answer.result()  # being answered this instant

    def generate(self, request: GenerationRequest, max_output_tokens: int = 0) -> Submitted:
        """Queue ``request`` to prefill here, in this worker's batches (no hand-off: a short
        prompt, or no prefill worker to take it), and decode it to its finish;
        ``max_output_tokens``: its output limit, first token included
        (docs/token-accounting.md)."""
        return self._submit(request, max_output_tokens=max_output_tokens or None)

    def on_events(self, events: list[TokenEvent]) -> None:
        super().on_events(events)
        if self._waiting and any(event.finished for event in events):
            self._waiting.grant(self.engine)  # blocks were freed: serve waiting hand-offs

    @in_group(CONTROL)
    def abort(self, request_id: str, owner: str = "") -> bool:
        """As a worker's, a reservation still waiting for blocks included (no event: its
        ``reserve`` answers the refusal)."""
        self.leases.renew(owner)

        def abort(engine: LLMEngine) -> bool:
            if engine.abort(request_id):
                return True
            return self._waiting.cancel(request_id) | self._forget(request_id)

        return self.loop.call(abort).result()

    @in_group(CONTROL)
    def inject_fault(self, kind: str, count: int = 1) -> int:
        """Chaos tests only, with ``PDSERVE_FAULT_INJECTION=1`` in this worker's environment:
        ``break_transport`` breaks the next ``count`` incoming transfers mid-stream (see
        ``docs/kv-handoff.md``). Returns how many breaks are pending."""
        if not fault_injection_enabled():
            raise RuntimeError(
                f"fault injection is off: set {FAULT_INJECTION_ENV}=1 in the decode worker's "
                "environment"
            )
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        return self.receiver.break_next(count)

    def _on_transfer(self, item: TransferHeader | KVPayload) -> str | None:
        """Transport thread: the handshake (a header, checked against its reservation before
        any page is read), then the pages (a payload, checked again, state included), written
        into their reserved blocks right here; the engine thread only starts the request."""
        serial_here()  # the copy's parallel regions on this thread alone (engine/openmp.py)
        try:
            if isinstance(item, TransferHeader):
                self.engine.importer.check_transfer_header(item)
                return None
            request = self.engine.importer.take_reservation(item)
        except KVImportError as exc:
            return str(exc)
        error: str | None = "KV install failed"
        try:
            error = self.engine.importer.write_pages(request, item)
        finally:  # whatever happens, the engine thread starts the request or frees its blocks
            state = item.state
            self.loop.call(lambda e: self._install(e, request, state, error))
        return error

    def _on_broken(self, request_id: str, error: str) -> None:
        """Transport thread: a transfer broke after its header; its pages will not come."""

        def end(engine: LLMEngine) -> None:
            request = engine.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RESERVED:
                engine.abort(request_id, f"KV transfer broke: {error}")

        self.loop.call(end)

    def _install(
        self, engine: LLMEngine, request: Request, state: HandoffState, error: str | None
    ) -> None:
        engine.importer.finish_receive(request, state, error)
        self._waiting.grant(engine)  # the blocks of one aborted meanwhile were freed just now


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
