"""A worker's token channel over real loopback sockets, its peers raw ZMQ DEALERs: the wire
encoding round-trips every TokenEvent field exactly; a hello is welcomed while the engine is
idle; each owner gets one message per step with its own events only, in order; a coordinator
that is gone or does not read costs counted drops (never a blocked engine thread) and marks its
requests lagging, and its next message names them; a peer without the pool's credentials gets
nothing; no credentials off loopback is refused."""

from __future__ import annotations

import time
from dataclasses import asdict, fields

import pytest
import zmq

from engine.errors import ConfigError
from engine.outputs import TokenEvent, TokenLogprobs
from engine.request import FinishReason
from engine.transfer.security import generate_credentials
from engine.transfer.zmq_security import secure_client
from workers.token_channel import TokenSender
from workers.token_wire import HelloMsg, StepMsg, WelcomeMsg, decode, encode

pytestmark = pytest.mark.timeout(10)


def token(request_id: str, i: int, text: str = "x") -> TokenEvent:
    return TokenEvent(request_id, i, text, 3, i + 1, 100.0 + i)


def every_field_events() -> list[TokenEvent]:
    full = TokenEvent(
        "req-é", 2**31 + 5, "tête \U0001f600", 17, 4, 1234.5678901234, FinishReason.STOP,
        "boom", "engine_error", 8, 0.125, 1e-9,
        TokenLogprobs(-0.6931471805599453, ((2**31 + 5, -0.6931471805599453), (7, -1.25))),
    )  # fmt: skip
    ends = [TokenEvent("r", None, "", 0, 0, 0.5, reason) for reason in FinishReason]
    odd = TokenEvent("r\udc80", 0, "half \ud83d", 0, 0, -0.0)  # not valid Unicode: kept as is
    return [full, *ends, odd, TokenEvent.failure("f", "lost", "worker_lost")]


def test_every_field_round_trips_exactly():
    events = every_field_events()
    covered = {f.name for f in fields(TokenEvent)}
    assert all(getattr(events[0], name) is not None for name in covered)  # none left default
    msg = decode(encode(StepMsg(7, events, ("lost-1",))))
    assert isinstance(msg, StepMsg) and (msg.seq, msg.lost) == (7, ("lost-1",))
    assert [asdict(e) for e in msg.events] == [asdict(e) for e in events]
    assert [type(e.finish_reason) for e in msg.events[1:6]] == [FinishReason] * 5
    assert msg.events[-2].queued_s is None and msg.events[-2].error is None
    assert decode(encode(HelloMsg("c-1"))) == HelloMsg("c-1")
    assert decode(encode(WelcomeMsg(42))) == WelcomeMsg(42)


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x93\x03\x00\x01", b"\x93\x09\x01\x02"])
def test_a_malformed_frame_is_a_value_error(frame):
    with pytest.raises(ValueError):
        decode(frame)


def test_an_unknown_finish_reason_is_refused():
    frame = encode(StepMsg(0, [token("r", 1)])).replace(b"\xc0", b"\xa1z", 1)
    with pytest.raises(ValueError, match="finish reason"):
        decode(frame)


@pytest.fixture
def sender():
    sender = TokenSender()
    yield sender
    sender.close()


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def dealer(context, sender, owner, credentials=None, hello=True, rcvhwm=1000):
    """A coordinator's socket on ``sender``'s channel, welcomed unless ``hello`` is False."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)  # a stranger's hello never goes: term must not wait for it
    socket.setsockopt(zmq.ROUTING_ID, owner.encode())
    socket.setsockopt(zmq.RCVHWM, rcvhwm)
    secure_client(socket, credentials)
    socket.connect(sender.endpoint)
    if hello:
        socket.send(encode(HelloMsg(owner)))
        assert socket.poll(3000), "no welcome"
        assert decode(socket.recv()) == WelcomeMsg(0)
    return socket


def received(socket, timeout_ms=2000) -> StepMsg:
    assert socket.poll(timeout_ms), "no step message"
    msg = decode(socket.recv())
    assert isinstance(msg, StepMsg)
    return msg


def test_each_owner_gets_its_own_events_in_order(sender, context):
    a, b = dealer(context, sender, "coord-a"), dealer(context, sender, "coord-b")
    for step in range(50):
        sender.send_step({"coord-a": [token("a1", step), token("a2", step)], "coord-b": []})
        if step % 2:
            sender.send_step({"coord-b": [token("b1", step)]})
    got = [received(a) for _ in range(50)]
    assert [m.seq for m in got] == list(range(50))
    assert [[(e.request_id, e.token_id) for e in m.events] for m in got] == [
        [("a1", i), ("a2", i)] for i in range(50)
    ]
    b_tokens = [e.token_id for _ in range(25) for e in received(b).events]
    assert b_tokens == list(range(1, 50, 2))
    assert not a.poll(100) and not b.poll(0)
    assert set(sender.attached) == {"coord-a", "coord-b"}
    assert sender.num_dropped_messages == 0


def test_a_coordinator_not_there_costs_counted_drops_then_is_told(sender, context):
    sender.send_step({"gone": [token("g1", 0), token("g2", 0)]})
    sender.send_step({"gone": [token("g1", 1)]})
    assert (sender.num_dropped_messages, sender.num_dropped_events) == (2, 3)
    assert sender.take_lagging() == {"gone": {"g1", "g2"}}
    assert sender.take_lagging() == {}
    back = dealer(context, sender, "gone")  # its first message names what it missed
    sender.send_step({"gone": [token("g3", 0)]})
    msg = received(back)
    assert (msg.seq, set(msg.lost), msg.events[0].request_id) == (0, {"g1", "g2"}, "g3")
    sender.send_step({"gone": [token("g3", 1)]})
    assert received(back).lost == ()


def test_a_coordinator_that_does_not_read_never_blocks_the_engine(context):
    sender = TokenSender(max_queued_steps=4)
    try:
        dealer(context, sender, "stuck", rcvhwm=4)  # never read again
        step = {"stuck": [token("s", 0, "y" * 65536)]}
        slowest = 0.0
        for _ in range(2000):
            started = time.perf_counter()
            sender.send_step(step)
            slowest = max(slowest, time.perf_counter() - started)
            if sender.num_dropped_messages >= 10:
                break
        assert sender.num_dropped_messages >= 10, "the queue never filled"
        assert slowest < 0.05
        assert sender.take_lagging() == {"stuck": {"s"}}
    finally:
        sender.close()


@pytest.mark.parametrize("mode", ["curve", "plain"])
def test_a_peer_without_the_credentials_gets_nothing(mode, context):
    keys, other = generate_credentials(), generate_credentials()
    share = keys.receiver if mode == "curve" else keys.receiver.plaintext_gate()
    sender = TokenSender(credentials=share)
    try:
        member = keys.sender if mode == "curve" else keys.sender.plaintext_gate()
        strangers = [None, other.sender, other.sender.plaintext_gate(), keys.receiver]
        sockets = [dealer(context, sender, "coord", s, hello=False) for s in strangers]
        for socket in sockets:
            socket.send(encode(HelloMsg("coord")))  # a hello that must not be answered
        coordinator = dealer(context, sender, "coord", member)
        sender.send_step({"coord": [token("r", 0)]})
        assert received(coordinator).events[0].request_id == "r"
        time.sleep(0.3)
        assert not any(socket.poll(0) for socket in sockets)
    finally:
        sender.close()


def test_no_credentials_off_loopback_is_refused():
    with pytest.raises(ConfigError, match="credentials"):
        TokenSender(host="0.0.0.0")
