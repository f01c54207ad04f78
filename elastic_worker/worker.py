"""An elastic worker: a prefill or a decode worker by turns, switching roles while it serves.

It holds both ends of the KV plane for life (a hand-off sender and a receiver, bound once) and
one engine whose weights and compiled kernels stay through every switch; which calls it takes is
its :class:`~workers.role_gate.RoleGate`'s to say. ``switch_role(target, epoch)`` starts a switch
if the worker is still at ``epoch`` (a compare-and-set: two planners cannot both move it), and
from then on it takes no new work. Then, on a thread of its own, it drains:

- **leaving decode**: hand-offs waiting for blocks are refused (cause ``role_switch``); every
  request decoding here ends with an error event of cause ``role_switch``, which its coordinator
  answers by migrating it, token-identically, to another decode worker without spending one of
  its retries; a reservation whose pages are on their way is let land first (ending it would
  fail its hand-off), then migrated the same way;
- **leaving prefill**: the prompts admitted finish, and their hand-offs with them.

Once the engine holds no request and no admitted call is still inside, the role flips and the
epoch goes up by one: calls naming an older epoch are refused from then on. The prefix cache is
kept (its blocks are valid KV in either role). A drain that has not ended within
``drain_limit_s`` (a reservation whose pages never come) ends what is left the same way.
``retire`` is a switch to no role at all: the pool releasing the worker
(``coordinator/pool/pool_size.py``) drains it so, then stops its actor.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from decode_worker.reservations import Moved
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig, KVTransferConfig
from engine.request import RequestStatus
from engine.transfer.security import KVCredentials, transfer_credentials
from prefill_worker.worker import PrefillWorker
from workers.contracts import (
    ROLE_SWITCH,
    GenerationRequest,
    HandoffTarget,
    Reservation,
    RoleState,
    Submitted,
    WorkerLoad,
)
from workers.role_gate import ANY_EPOCH, DECODE, PREFILL, RETIRED, RoleGate
from workers.runtime import CONTROL, HANDOFFS, LONG_POLLS, in_group

if TYPE_CHECKING:  # the engine's types: a coordinator imports this module without torch
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
DRAIN_TICK_S = 0.01
MAX_SWITCH_WAIT_S = 60.0  # the longest ``switch_role`` waits for the switch to end
LANDING = (RequestStatus.RESERVED, RequestStatus.RECEIVING)  # pages on their way: let them land


class ElasticWorker(PrefillWorker, DecodeWorker):
    role = "elastic"

    def __init__(
        self,
        config: EngineConfig,
        transfer: KVTransferConfig,
        credentials: KVCredentials | None = None,
        pull_credentials: KVCredentials | None = None,
        send_credentials: KVCredentials | None = None,
        serving: str = PREFILL,
        **runtime: Any,
    ) -> None:
        """``credentials``: the receivers' share (its receiver, token channel and the prefixes
        it pulls); ``send_credentials``: the senders' share (its hand-offs and the prefixes it
        sends); ``serving``: the role it starts in."""
        self.gate = RoleGate(serving)
        self._send_credentials = transfer_credentials(transfer, send_credentials)
        self._steps_at_switch = 0
        self.num_switch_migrations = 0  # requests it handed on by switching away from decode
        super().__init__(config, transfer, credentials, pull_credentials, **runtime)
        # a reservation whose pages never come ends by its own timeout: a drain waits that long
        self.drain_limit_s = transfer.reservation_timeout_s + transfer.transfer_timeout_s + 5.0

    def open_kv_plane(self) -> None:
        DecodeWorker.open_kv_plane(self)
        self.open_sender(self._send_credentials)

    # ---- calls by role -------------------------------------------------------------------------

    def prefill(
        self, request: GenerationRequest, target: HandoffTarget | None = None,
        epoch: int = ANY_EPOCH,
    ) -> Submitted:  # fmt: skip
        with self.gate.admit(PREFILL, epoch) as refusal:
            if refusal:
                return Submitted(False, refusal, cause=ROLE_SWITCH)
            return super().prefill(request, target)

    @in_group(HANDOFFS)
    def reserve(
        self, request: GenerationRequest, wait_s: float = 5.0, max_output_tokens: int = 0,
        epoch: int = ANY_EPOCH,
    ) -> Reservation:  # fmt: skip
        with self.gate.admit(DECODE, epoch) as refusal:
            if refusal:
                return Reservation.moved(refusal)
            return super().reserve(request, wait_s, max_output_tokens)

    def generate(
        self, request: GenerationRequest, max_output_tokens: int = 0, epoch: int = ANY_EPOCH
    ) -> Submitted:
        with self.gate.admit(DECODE, epoch) as refusal:
            if refusal:
                return Submitted(False, refusal, cause=ROLE_SWITCH)
            return super().generate(request, max_output_tokens)

    # ---- the switch ----------------------------------------------------------------------------

    @in_group(LONG_POLLS)
    def switch_role(self, target: str, epoch: int, wait_s: float = 0.0) -> tuple[str, RoleState]:
        """Switch to ``target`` if still at ``epoch`` (module docstring), waiting up to
        ``wait_s`` for the switch to end; ("", the role state then) when it started, else
        (why not, the role state now)."""
        refusal, started = self.gate.begin(target, epoch)
        if started:
            threading.Thread(target=self._drain, name="role-drain", daemon=True).start()
        if not refusal and wait_s > 0:
            self.gate.wait_past(epoch, min(float(wait_s), MAX_SWITCH_WAIT_S))
        return refusal, self.role_state()

    @in_group(LONG_POLLS)
    def retire(self, epoch: int, wait_s: float = 0.0) -> tuple[str, RoleState]:
        """Leave the pool: drain as a switch does (requests decoding here are handed on,
        prompts finish) and take no work again; answered as ``switch_role``."""
        return self.switch_role(RETIRED, epoch, wait_s)

    @in_group(CONTROL)
    def role_state(self) -> RoleState:
        """Its role, epoch and switch now."""
        return self.gate.state(max(self.loop.stats.num_steps - self._steps_at_switch, 0))

    def _drain(self) -> None:
        leaving, started = self.gate.serving, time.monotonic()
        log.info("switching from %s to %s (epoch %d)", leaving, self.gate.target, self.gate.epoch)
        try:
            while True:
                overdue = time.monotonic() - started > self.drain_limit_s
                tick = functools.partial(self._hand_on, leaving=leaving, overdue=overdue)
                empty = self.loop.call(tick).result()
                if empty and self.gate.quiet() and not len(self.requests):
                    break
                time.sleep(DRAIN_TICK_S)
            self._steps_at_switch = self.loop.call(lambda e: e.stats().num_steps).result()
        except Exception:  # the engine failed mid-drain: the switch is given up, asked again
            log.exception("role switch from %s failed; still serving it", leaving)
            self.gate.abandon()
            return
        state = self.gate.finish()
        log.info("now serving %s (epoch %d) after %.3f s", state.serving, state.epoch,
                 time.monotonic() - started)  # fmt: skip

    def _hand_on(self, engine: LLMEngine, leaving: str, overdue: bool) -> bool:
        """On the engine thread, one drain tick: leaving decode, refuse waiting hand-offs and
        end the requests decoding here (their coordinators migrate them); ``overdue``: end
        whatever is left. Whether the engine holds no request any more."""
        if leaving == DECODE:
            self._waiting.refuse_all(Moved("this worker is switching to prefill"))
        for request_id, request in list(engine.requests.items()):
            if request.status >= RequestStatus.FINISHED:
                continue
            decoding = leaving == DECODE and request.status not in LANDING
            if decoding or overdue:
                why = f"worker switched from {leaving} to {self.gate.target}"
                if engine.abort(request_id, why, ROLE_SWITCH):
                    self.num_switch_migrations += 1
        if overdue:
            log.warning("role switch: drain overdue after %.0f s, the rest ended",
                        self.drain_limit_s)  # fmt: skip
        return not engine.requests

    @in_group(CONTROL)
    def load(self) -> WorkerLoad:
        return replace(super().load(), role_state=self.role_state())
