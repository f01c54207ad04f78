"""MindIE ``/infer`` response shapes (SPEC §3): the text answer and the SSE events."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import TokenEvent
from engine.request import FinishReason

FINISH_REASONS = {
    FinishReason.EOS: "eos_token",
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop_sequence",
    FinishReason.ABORT: "stop_sequence",
    FinishReason.ERROR: "stop_sequence",
}


def sse(payload: dict[str, Any]) -> bytes:
    """One event, exactly ``data: <json>\\n\\n`` (compact JSON, UTF-8 kept as is)."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def error_body(message: str, error_type: str) -> dict[str, str]:
    return {"error": message, "error_type": error_type}


@dataclass
class InferAnswer:
    """Accumulates one request's events into MindIE's shapes."""

    seed: int
    details: bool
    full_text: bool
    started_at: float  # time.monotonic() when the request arrived
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    _last_at: float | None = field(default=None, repr=False)

    def details_body(self) -> dict[str, Any] | None:
        if not self.details:
            return None
        return {
            "finish_reason": self.finish_reason,
            "generated_tokens": self.num_tokens,
            "seed": self.seed,
        }

    def add(self, event: TokenEvent, now: float) -> dict[str, Any] | None:
        """Take one event; return the SSE payload for it (None for an event with no token)."""
        self.text += event.text
        if event.finish_reason is not None:
            self.finish_reason = FINISH_REASONS[event.finish_reason]
        if event.token_id is None:
            return None
        self.num_tokens += 1
        first = self._last_at is None
        prefill_ms = round((now - self.started_at) * 1000, 3) if first else None
        decode_ms = None if first else round((now - self._last_at) * 1000, 3)
        self._last_at = now
        if event.finished:
            return {
                "prefill_time": prefill_ms,
                "decode_time": decode_ms,
                "generated_text": self.text,
                "details": self.details_body(),
                "token": {"id": event.token_id, "text": None},
            }
        piece = self.text if self.full_text else event.text
        return {
            "prefill_time": prefill_ms,
            "decode_time": decode_ms,
            "token": {"id": event.token_id, "text": piece},
        }

    def text_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"generated_text": self.text}
        if self.details:
            body["details"] = self.details_body()
        return body
