"""The prefill worker: computes prompts and first tokens, then pushes the KV to a decode worker.

Life of a request here (the whole hand-off: ``docs/kv-handoff.md``):
1. ``prefill`` takes the :class:`GenerationRequest` and, when the decode side
   has room for it, a :class:`HandoffTarget` (the decode worker's endpoint, output limit and the
   reservation's secret, sent with the pages); it
   queues the prompt as a prefill-only request, which the engine batches with other prompts
   (chunked by ``maxPrefillTokens``).
2. Its first token goes on the token channel at once. A request that ends on that token (EOS, a stop
   string, a limit of one token) ends here: no hand-off.
3. Otherwise the engine holds its blocks; the pages are exported on the engine thread and sent by
   a transfer thread to the decode worker's endpoint: only those from the target's
   ``first_block`` on, the decode worker holding the ones before in its prefix cache.
4. On the decode worker's acknowledgement, or on a refusal, any error (of the transport, the
   codec, or anything else) or ``transfer_timeout_s``, the stream ends with a
   :class:`HandoffResult` (failed ones say why) and the blocks are freed (between two engine
   steps, so the result never waits for a long prefill step). Its full blocks stay in the prefix
   cache: the next prompt with the same prefix computes only what follows it.
``abort`` frees the request wherever it is; a transfer already on the wire finishes or fails on
its own, and its blocks are not held for it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from engine.openmp import serial_here
from engine.outputs import TokenEvent
from engine.request import RequestStatus
from engine.transfer.base import KVTransferError
from engine.transfer.payload import KVPayload
from engine.transfer.security import KVCredentials
from engine.transfer.transports import create_sender
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget, Submitted
from workers.handoff_worker import HandoffWorker

log = logging.getLogger(__name__)


class PrefillWorker(HandoffWorker):
    role = "prefill"

    def open_kv_plane(self) -> None:
        self.open_sender(self.credentials)

    def open_sender(self, credentials: KVCredentials | None) -> None:
        """The hand-off's sender (and its threads), holding the senders' share ``credentials``."""
        transfer = self.transfer
        self.sender = create_sender(transfer.transport, transfer.shared_memory, credentials)
        self.transfer_timeout_s = transfer.transfer_timeout_s
        self._senders = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kv-send", initializer=serial_here
        )

    def open_pull_plane(self) -> None:
        self.pull_receiver = self._pull_receiver()  # it sends prefixes with its hand-off sender

    def prefill(self, request: GenerationRequest, target: HandoffTarget | None = None) -> Submitted:
        """Queue ``request``: its first token goes on the token channel, then (with a target)
        the hand-off's result. A target whose
        limit this first token reaches (a migrated request one token short of it) is not
        handed off: the request finishes here, at the limit."""
        max_output_tokens = target.max_output_tokens if target is not None else None
        ends_here = max_output_tokens is not None and (
            max_output_tokens <= len(request.output_token_ids) + 1
        )
        handoff = target if target is not None and target.hands_off and not ends_here else None
        return self._submit(
            request, handoff, prefill_only=handoff is not None, max_output_tokens=max_output_tokens
        )

    def num_handoffs_by_path(self) -> dict[str, int]:
        """Hand-offs acknowledged so far, by the path their pages took (``engine.transfer``)."""
        return self.sender.payloads_by_path.as_dict()

    def on_events(self, events: list[TokenEvent]) -> None:
        """On the engine thread: send the step's events; start the hand-off of requests now
        held."""
        super().on_events(events)
        for event in events:
            target = None if event.finished else self.requests.take_handoff(event.request_id)
            if target is not None:
                self._hand_off(event.request_id, target)

    def _hand_off(self, request_id: str, target: HandoffTarget) -> None:
        """Export the pages of ``request_id`` and queue their push to ``target``."""
        request = self.engine.requests.get(request_id)
        if request is None or request.status != RequestStatus.HELD:
            self._post(HandoffResult(request_id, ok=False, error="ended before the hand-off"))
            return
        try:
            limit, first_block = target.max_output_tokens, target.first_block
            payload = self.engine.export_kv(request_id, limit, first_block)
            payload.token = target.token
            deadline = time.monotonic() + self.transfer_timeout_s
            self._senders.submit(self._send, target.endpoint, payload, deadline)
        except Exception as exc:
            self._post(_failed(request_id, target.endpoint, exc))
            self.engine.release(request_id)

    def _post(self, result: HandoffResult) -> None:
        """Send ``result`` to its request's coordinator: the request ends here."""
        owner = self.requests.close(result.request_id)
        if owner is not None:
            self.channel.send_handoff(owner, result)

    def _send(self, endpoint: str, payload: KVPayload, deadline: float) -> None:
        """Sender thread: push the pages by ``deadline`` (``transfer_timeout_s`` after the
        export, time waiting for this thread included); whatever happens, post the result and
        free the blocks."""
        request_id = payload.state.request_id
        start = time.monotonic()
        try:
            if deadline <= start:
                raise KVTransferError(f"no sender free within {self.transfer_timeout_s:.1f} s")
            path = self.sender.send(endpoint, payload, deadline - start)
            seconds = time.monotonic() - start
            result = HandoffResult(request_id, True, None, payload.num_bytes, seconds, path)
        except Exception as exc:
            result = _failed(request_id, endpoint, exc)
        # The result first: the caller switches to the decode worker's stream at once, instead
        # of waiting for the engine thread to finish its current (maybe long) prefill step.
        self._post(result)
        self.loop.call(lambda e: e.release(request_id))


def _failed(request_id: str, endpoint: str, exc: Exception) -> HandoffResult:
    """The result of a hand-off that failed with ``exc``, saying why."""
    reason = str(exc) if isinstance(exc, KVTransferError) else f"{type(exc).__name__}: {exc}"
    log.warning("request %s: KV hand-off to %s failed: %s", request_id, endpoint, reason)
    return HandoffResult(request_id, False, f"KV hand-off failed: {reason}")
