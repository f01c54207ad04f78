"""The decode worker: receives a request's KV pages and decodes it in continuous batches.

Life of a request here:
1. ``reserve`` sets aside blocks for the prompt (waiting up to ``wait_s`` for room, else refusing
   with the reason) and opens the request's event stream; the answer names this worker's KV
   endpoint for the prefill worker to push to.
2. The transport's receiver thread checks the header's layout (model, dtype, block size, shape)
   against ours, then has the engine thread install the pages into the reserved blocks; the
   acknowledgement goes back only after that, so the prefill side may free its copy.
3. The request decodes with everything else running; each token is streamed by ``stream``.
4. It ends on EOS, a stop string or its output limit (SPEC §3 accounting), or on ``abort``, and
   its blocks are freed. A reservation whose pages never arrive within ``reservation_timeout_s``
   is dropped and its stream ended with an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from decode_worker.reservations import ReservationQueue
from engine.config import EngineConfig
from engine.kv_transfer import KVLayout, KVPayload
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.transfer import create_receiver
from engine.worker_runtime import WorkerRuntime


def kv_bind_address(host: str) -> str:
    """The address the KV endpoint binds to and advertises: ``auto`` is this node's IP (pods of
    a Kubernetes RayCluster), anything else is taken as given."""
    if host != "auto":
        return host
    import ray

    return ray.util.get_node_ip_address()


class DecodeWorker(WorkerRuntime):
    role = "decode"

    def __init__(
        self,
        config: EngineConfig,
        instance: int = 0,
        cpu_ids: tuple[int, ...] | None = None,
        kv_transport: str = "zmq",
        host: str = "127.0.0.1",
        reservation_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(config, instance, cpu_ids)
        self.receiver = create_receiver(kv_transport, self._on_transfer, kv_bind_address(host))
        self.reservation_timeout_s = reservation_timeout_s
        self._reserved_at: dict[str, float] = {}
        self._waiting = ReservationQueue()
        self._transfer_lock = threading.Lock()
        threading.Thread(target=self._expire_reservations, daemon=True).start()

    def endpoint(self) -> str:
        return self.receiver.endpoint

    def reserve(
        self, request_id: str, num_prompt_tokens: int, wait_s: float = 5.0, priority: int = 5
    ) -> dict[str, object]:
        """Pre-allocate blocks for an incoming hand-off; ``{"ok", "endpoint" | "reason"}``.

        Waits up to ``wait_s`` for room; waiting hand-offs are served by priority, then arrival.
        """
        self._open(request_id)
        waiter = self._waiting.add(request_id, num_prompt_tokens, priority)
        self.loop.call(self._waiting.grant)
        if not waiter.done.wait(wait_s) and self._waiting.withdraw(waiter):
            self._close(request_id)
            stats = self.engine.stats()
            needed = self.engine.blocks.blocks_for(num_prompt_tokens + 1)
            return {
                "ok": False,
                "reason": (
                    f"decode cache full: {stats.num_free_blocks} of {stats.num_total_blocks} "
                    f"blocks free, {needed} needed"
                ),
            }
        if waiter.error is not None:
            self._close(request_id)
            return {"ok": False, "reason": waiter.error}
        self._reserved_at[request_id] = time.monotonic()
        return {"ok": True, "endpoint": self.receiver.endpoint}

    def _dispatch(self, events: list[TokenEvent]) -> None:
        super()._dispatch(events)
        if self._waiting and any(event.finished for event in events):
            self._waiting.grant(self.engine)  # blocks were freed: serve waiting hand-offs

    def stream(self, request_id: str) -> Iterator[TokenEvent]:
        """Token events of a reserved request, up to its finish."""
        with self._lock:
            q = self._queues.get(request_id)
        if q is None:
            yield TokenEvent(
                request_id,
                None,
                "",
                0,
                0,
                time.monotonic(),
                FinishReason.ERROR,
                f"request {request_id!r} is unknown to decode worker {self.instance}",
            )
            return
        yield from self._drain(request_id, q)

    def abort(self, request_id: str) -> bool:
        if self._waiting.cancel(request_id):
            return True
        with self._transfer_lock:
            had_reservation = self._reserved_at.pop(request_id, None) is not None
            found = super().abort(request_id)
        self.loop.call(self._waiting.grant)  # its blocks may serve a waiting hand-off
        if had_reservation:
            self._end(request_id, FinishReason.ABORT)
        return found

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def _on_transfer(self, item: KVLayout | KVPayload) -> str | None:
        """Transport thread: the handshake (a layout), then the pages (a payload).

        The pages are written into the reserved blocks right here, and acknowledged at once; the
        engine thread only has to install the request between two steps. (Waiting for the engine
        thread before acknowledging would cost each hand-off a whole decode step.)
        """
        try:
            if isinstance(item, KVLayout):
                self.engine.layout.check_compatible(item)
                return None
            request_id = item.state.request_id
            with self._transfer_lock:  # abort and expiry wait for this write to finish
                self.engine.write_reserved(item)
                self._reserved_at.pop(request_id, None)
        except Exception as exc:
            return str(exc)
        install = self.loop.call(
            lambda e: e.import_kv(item, require_reservation=True, pages_written=True)
        )
        install.add_done_callback(lambda done: self._install_failed(request_id, done))
        return None

    def _install_failed(self, request_id: str, done) -> None:
        if done.exception() is not None:
            self._end(request_id, FinishReason.ERROR, f"KV install failed: {done.exception()}")

    def _expire_reservations(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            for request_id, since in list(self._reserved_at.items()):
                if now - since > self.reservation_timeout_s:
                    with self._transfer_lock:
                        if self._reserved_at.pop(request_id, None) is None:
                            continue  # its pages arrived meanwhile
                        self.loop.call(lambda e, r=request_id: e.abort(r)).result()
                    self.loop.call(self._waiting.grant)
                    self._end(
                        request_id,
                        FinishReason.ERROR,
                        f"KV pages did not arrive within {self.reservation_timeout_s:.0f} s",
                    )
