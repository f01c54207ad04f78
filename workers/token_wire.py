"""What crosses a token channel (``workers/token_channel.py`` to
``coordinator/pool/token_streams.py``), one msgpack array per ZMQ frame.

    coordinator ──HelloMsg──► worker        once connected (and again after a reconnect)
    coordinator ◄──WelcomeMsg── worker      the answer: the channel is up
    coordinator ◄──StepMsg── worker         one per engine step with events of its requests,
                                            or with a prefill's hand-off results

A :class:`StepMsg` carries its number in the worker's sequence for that coordinator (a gap: a
message lost on the way), the events, and the requests whose events the worker had to drop since
the last message that got through (the coordinator ends them), and the hand-off results a
prefill worker's sender threads posted (each after its request's first token, on the same
numbered sequence, so in order). A :class:`TokenEvent` or a :class:`HandoffResult` travels as a
flat array of its fields in declaration order, the finish reason as its enum value, its log
probabilities as ``(logprob, (id, logprob, ...))``: the round trip
is exact for every field, None included. Strings pass ``surrogatepass``, so even a string that is
not valid Unicode comes back as it went.
"""

from __future__ import annotations

import enum
from dataclasses import astuple, dataclass, fields
from typing import Any

import msgpack

from engine.outputs import TokenEvent, TokenLogprobs
from engine.request import FinishReason
from workers.contracts import HandoffResult

PROTOCOL_VERSION = 1
_FIELDS = tuple(f.name for f in fields(TokenEvent))  # a field added fails the round-trip test
_REASON_FIELD = 6  # of _FIELDS, which event_fields and event_of write out
_HANDOFF_FIELDS = tuple(f.name for f in fields(HandoffResult))
_REASONS = {reason.value: reason for reason in FinishReason}
_ERRORS = "surrogatepass"


class MsgKind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    STEP = 3


@dataclass(frozen=True)
class HelloMsg:
    """A coordinator introduces itself (its id is also its socket's routing id)."""

    coordinator_id: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class WelcomeMsg:
    """A worker's answer to a hello: the number of its next step message to that coordinator."""

    next_seq: int
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class StepMsg:
    """One engine step's events for one coordinator."""

    seq: int
    events: list[TokenEvent]
    lost: tuple[str, ...] = ()  # requests whose events were dropped since the last message
    handoffs: tuple[HandoffResult, ...] = ()  # a prefill's last word on requests it handed off


ChannelMsg = HelloMsg | WelcomeMsg | StepMsg


def event_fields(event: TokenEvent) -> tuple[Any, ...]:
    """``event`` as a flat tuple of its fields, the finish reason as its value."""
    reason = event.finish_reason
    return (
        event.request_id,
        event.token_id,
        event.text,
        event.num_prompt_tokens,
        event.num_output_tokens,
        event.emitted_at,
        None if reason is None else reason.value,
        event.error,
        event.cause,
        event.num_cached_tokens,
        event.queued_s,
        event.prefill_s,
        _logprobs_fields(event.logprobs),
    )


def event_of(values: tuple[Any, ...] | list[Any]) -> TokenEvent:
    """The event :func:`event_fields` flattened (ValueError if it is not one)."""
    if len(values) != len(_FIELDS):
        raise ValueError(f"an event has {len(_FIELDS)} fields, got {len(values)}")
    reason = values[_REASON_FIELD]
    if reason is not None:
        if reason not in _REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        reason = _REASONS[reason]
    v = values
    logprobs = _logprobs_of(v[12])
    return TokenEvent(
        v[0], v[1], v[2], v[3], v[4], v[5], reason, v[7], v[8], v[9], v[10], v[11], logprobs
    )


def _logprobs_fields(logprobs: TokenLogprobs | None) -> tuple[float, tuple] | None:
    """A token's log probabilities as ``(logprob, (id, logprob, id, logprob, ...))``."""
    if logprobs is None:
        return None
    return logprobs.logprob, tuple(x for pair in logprobs.top for x in pair)


def _logprobs_of(value: Any) -> TokenLogprobs | None:
    if value is None:
        return None
    logprob, flat = value
    if len(flat) % 2:
        raise ValueError("a token's alternatives come in (id, logprob) pairs")
    top = tuple((int(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2))
    return TokenLogprobs(float(logprob), top)


def encode(msg: ChannelMsg) -> bytes:
    """``msg`` as one frame."""
    if isinstance(msg, StepMsg):
        handoffs = [astuple(result) for result in msg.handoffs]
        body: list[Any] = [MsgKind.STEP, msg.seq, list(msg.lost), handoffs]
        body.extend(event_fields(event) for event in msg.events)
    elif isinstance(msg, HelloMsg):
        body = [MsgKind.HELLO, msg.version, msg.coordinator_id]
    else:
        body = [MsgKind.WELCOME, msg.version, msg.next_seq]
    return msgpack.packb(body, unicode_errors=_ERRORS)


def decode(frame: bytes) -> ChannelMsg:
    """The message of one frame (ValueError if it is not one)."""
    try:
        body = msgpack.unpackb(frame, use_list=False, unicode_errors=_ERRORS)
    except Exception as exc:  # msgpack raises several kinds for a malformed frame
        raise ValueError(f"not a msgpack frame: {type(exc).__name__}") from exc
    if not isinstance(body, tuple) or len(body) < 3:
        raise ValueError("not a channel message")
    try:
        return _message(body)
    except (TypeError, IndexError) as exc:  # a field of the wrong kind
        raise ValueError(f"malformed message: {exc}") from exc


def _message(body: tuple[Any, ...]) -> ChannelMsg:
    kind = body[0]
    if kind == MsgKind.STEP:
        events = [event_of(values) for values in body[4:]]
        handoffs = tuple(_handoff_of(values) for values in body[3])
        return StepMsg(int(body[1]), events, tuple(body[2]), handoffs)
    if kind == MsgKind.HELLO:
        return HelloMsg(str(body[2]), int(body[1]))
    if kind == MsgKind.WELCOME:
        return WelcomeMsg(int(body[2]), int(body[1]))
    raise ValueError(f"unknown message kind {kind!r}")


def _handoff_of(values: tuple[Any, ...]) -> HandoffResult:
    if len(values) != len(_HANDOFF_FIELDS):
        raise ValueError(f"a hand-off result has {len(_HANDOFF_FIELDS)} fields, got {len(values)}")
    return HandoffResult(*values)
