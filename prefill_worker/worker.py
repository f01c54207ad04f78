"""The prefill worker: computes prompts and first tokens, then pushes the KV to a decode worker.

Life of a request here:
1. ``prefill`` (a streaming call) queues the prompt as a prefill-only request; the engine batches
   it with other prompts (chunked by ``maxPrefillTokens``).
2. Its first token is streamed back at once. A request that ends on that token (EOS, a stop
   string, a limit of one token) ends here: no hand-off.
3. Otherwise the engine holds its blocks; the pages are exported on the engine thread and sent by
   a transfer thread to the decode worker's endpoint.
4. On the decode worker's acknowledgement, or on a refusal, an error or ``transfer_timeout_s``,
   the stream ends with a :class:`HandoffResult` and the blocks are freed (between two engine
   steps, so the result never waits for a long prefill step).
``abort`` frees the request wherever it is; a transfer already on the wire finishes or fails on
its own, and its blocks are not held for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.config import EngineConfig
from engine.kv_transfer import KVPayload
from engine.llm_engine import LLMEngine
from engine.outputs import TokenEvent
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams
from engine.transfer import KVTransferError, create_sender
from engine.worker_runtime import HandoffResult, WorkerRuntime

log = logging.getLogger(__name__)


class PrefillWorker(WorkerRuntime):
    role = "prefill"

    def __init__(
        self,
        config: EngineConfig,
        instance: int = 0,
        cpu_ids: tuple[int, ...] | None = None,
        kv_transport: str = "zmq",
        transfer_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(config, instance, cpu_ids)
        self.sender = create_sender(kv_transport)
        self.transfer_timeout_s = transfer_timeout_s
        self._handoffs: dict[str, tuple[str, int]] = {}  # request id -> (endpoint, output limit)
        self._senders = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-send")
        self.num_transferred_bytes = 0

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        priority: int = 5,
        decode_endpoint: str | None = None,
        max_output_tokens: int = 1,
    ) -> Iterator[TokenEvent | HandoffResult]:
        """Stream the first token, then (with a decode endpoint) the hand-off's result."""
        q = self._open(request_id)
        sampling = SamplingParams.from_dict(params)
        handoff = decode_endpoint is not None and max_output_tokens > 1
        if handoff:
            self._handoffs[request_id] = (decode_endpoint, max_output_tokens)

        def add(engine: LLMEngine) -> None:
            engine.add_request(
                request_id, prompt_token_ids, sampling, priority, prefill_only=handoff
            )

        try:
            self.loop.call(add).result()
        except Exception as exc:
            self._handoffs.pop(request_id, None)
            self._end(request_id, FinishReason.ERROR, str(exc))
        yield from self._drain(request_id, q)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        """On the engine thread: stream events; start the hand-off of requests now held."""
        for event in events:
            self._put(event.request_id, event)
            target = self._handoffs.pop(event.request_id, None)
            if target is None:
                continue
            request = self.engine.requests.get(event.request_id)
            if event.finished or request is None or request.status != RequestStatus.HELD:
                self._put(
                    event.request_id,
                    HandoffResult(event.request_id, ok=False, error="ended before the hand-off"),
                )
                continue
            payload = self.engine.export_kv(event.request_id)
            payload.state.max_output_tokens = target[1]
            self._senders.submit(self._send, target[0], payload)

    def _send(self, endpoint: str, payload: KVPayload) -> None:
        request_id = payload.state.request_id
        start = time.monotonic()
        try:
            self.sender.send(endpoint, payload, self.transfer_timeout_s)
            result = HandoffResult(
                request_id, True, None, payload.num_bytes, time.monotonic() - start
            )
            self.num_transferred_bytes += payload.num_bytes
        except (KVTransferError, OSError) as exc:
            log.warning("request %s: KV hand-off to %s failed: %s", request_id, endpoint, exc)
            result = HandoffResult(request_id, False, f"KV hand-off failed: {exc}")
        # The result first: the caller switches to the decode worker's stream at once, instead
        # of waiting for the engine thread to finish its current (maybe long) prefill step.
        self._put(request_id, result)
        self.loop.call(lambda e: e.release(request_id)).result()
