"""A coordinator's token streams against real workers' token channels on loopback: events
reach their requests in order across steps; two coordinators on one worker each get only their
own; a slow reader is overflowed without delaying anyone else; a flood of messages arrives whole
and in order; a worker whose socket closes (or that the caller declares lost) ends its open
requests with a ``worker_lost`` failure; dropped events and a gap in a worker's message numbers
end their requests with ``events_lost``; CURVE and the plaintext gate both work, and a
coordinator without the credentials is never welcomed."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from coordinator.pool.token_streams import TokenChannelError, TokenStreams, counterpart
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.transfer.security import generate_credentials
from workers.token_channel import TokenSender
from workers.token_wire import HelloMsg, StepMsg, WelcomeMsg, decode, encode

pytestmark = pytest.mark.timeout(10)
WORKER = ("decode", 0)


def token(request_id: str, i: int) -> TokenEvent:
    return TokenEvent(request_id, i, f"t{i}", 3, i + 1, 100.0 + i)


def last(request_id: str, i: int) -> TokenEvent:
    return TokenEvent(request_id, i, "", 3, i + 1, 200.0, FinishReason.EOS)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 8))


async def read_all(stream) -> list[TokenEvent]:
    return [event async for event in stream]


async def settle(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.fixture
def sender():
    sender = TokenSender()
    yield sender
    sender.close()


def test_events_reach_their_requests_in_order(sender):
    async def main():
        streams = TokenStreams("coord")
        await streams.connect(WORKER, sender.endpoint)
        a, b = streams.open("a", WORKER), streams.open("b", WORKER)
        readers = asyncio.gather(read_all(a), read_all(b))
        for step in range(100):
            sender.send_step({"coord": [token("a", step), token("b", step), token("x", step)]})
            await asyncio.sleep(0)
        sender.send_step({"coord": [last("a", 100), last("b", 100)]})
        got_a, got_b = await readers
        assert [e.token_id for e in got_a] == [e.token_id for e in got_b] == list(range(101))
        assert got_a[-1].finish_reason is FinishReason.EOS and got_a[5].text == "t5"
        assert len(streams) == 0 and streams.num_unrouted == 100  # "x" was never open
        await streams.aclose()

    run(main())


def test_a_flood_of_messages_arrives_whole_and_in_order(sender):
    async def main():
        streams = TokenStreams("coord")
        await streams.connect(WORKER, sender.endpoint)
        flood, other = streams.open("flood", WORKER), streams.open("other", WORKER)
        for step in range(1000):  # all queued before the loop reads any
            sender.send_step({"coord": [token("flood", step)]})
        sender.send_step({"coord": [last("flood", 1000), last("other", 0)]})
        ids = [e.token_id for e in await read_all(flood)]
        assert ids == list(range(1001))
        assert [e.finish_reason for e in await read_all(other)] == [FinishReason.EOS]
        await streams.aclose()

    run(main())


def test_two_coordinators_get_only_their_own(sender):
    async def main():
        one, two = TokenStreams("one"), TokenStreams("two")
        await asyncio.gather(
            one.connect(WORKER, sender.endpoint), two.connect(WORKER, sender.endpoint)
        )
        mine, theirs = one.open("r1", WORKER), two.open("r2", WORKER)
        two.open("r1", WORKER)  # the same id open on the other: must see nothing of one's
        sender.send_step({"one": [token("r1", 0), last("r1", 1)], "two": [last("r2", 0)]})
        assert [e.token_id for e in await read_all(mine)] == [0, 1]
        assert [e.token_id for e in await read_all(theirs)] == [0]
        assert len(two) == 1 and two.num_unrouted == 0
        await one.aclose()
        await two.aclose()

    run(main())


def test_a_slow_reader_is_overflowed_and_delays_no_one(sender):
    async def main():
        streams = TokenStreams("coord", max_queued_events=8)
        await streams.connect(WORKER, sender.endpoint)
        slow, fast = streams.open("slow", WORKER), streams.open("fast", WORKER)
        for step in range(20):
            sender.send_step({"coord": [token("slow", step), token("fast", step)]})
            event = await asyncio.wait_for(anext(fast), 1)  # each step's event arrives at once
            assert event.token_id == step
        assert slow.overflowed and streams.num_overflowed == 1
        events = await read_all(slow)
        assert [e.cause for e in events] == ["stream_overflow"]
        assert events[0].finish_reason is FinishReason.ERROR
        await streams.aclose()

    run(main())


def test_a_worker_whose_socket_closes_ends_its_requests():
    async def main():
        sender, other = TokenSender(), TokenSender()
        streams = TokenStreams("coord")
        await streams.connect(WORKER, sender.endpoint)
        await streams.connect(("decode", 1), other.endpoint)
        doomed, fine = streams.open("doomed", WORKER), streams.open("fine", ("decode", 1))
        sender.send_step({"coord": [token("doomed", 0)]})
        await settle(lambda: len(doomed) == 1)
        started = time.monotonic()
        sender.close()
        events = await read_all(doomed)
        assert time.monotonic() - started < 2
        assert [e.token_id for e in events] == [0, None]  # what came, then the failure
        assert (events[-1].finish_reason, events[-1].cause) == (FinishReason.ERROR, "worker_lost")
        assert not streams.connected(WORKER) and streams.connected(("decode", 1))
        other.send_step({"coord": [last("fine", 0)]})
        assert [e.finish_reason for e in await read_all(fine)] == [FinishReason.EOS]
        await streams.aclose()
        other.close()

    run(main())


def test_what_a_worker_sent_before_it_went_comes_first(sender):
    async def main():
        streams = TokenStreams("coord")
        await streams.connect(WORKER, sender.endpoint)
        done, cut = streams.open("done", WORKER), streams.open("cut", WORKER)
        sender.send_step({"coord": [last("done", 3), token("cut", 3)]})
        time.sleep(0.2)  # the loop is busy: the step waits in the socket...
        sender.close()
        time.sleep(0.2)  # ...and the drop behind it
        assert [e.finish_reason for e in await read_all(done)] == [FinishReason.EOS]
        assert [(e.token_id, e.cause) for e in await read_all(cut)] == [
            (3, ""),
            (None, "worker_lost"),
        ]
        await streams.aclose()

    run(main())


def test_the_caller_declares_a_worker_lost(sender):
    async def main():
        streams = TokenStreams("coord")
        await streams.connect(WORKER, sender.endpoint)
        here, there = streams.open("r", WORKER), streams.open("r", ("prefill", 0))
        stays = streams.open("stays", WORKER)
        assert streams.worker_lost(WORKER, "pid changed") == 2
        for stream in (here, stays):
            [event] = await read_all(stream)
            assert (event.cause, event.error) == ("worker_lost", "pid changed")
        assert len(streams) == 1 and not there.ended  # the same request on another worker
        streams.close(there)
        assert len(streams) == 0
        await streams.aclose()

    run(main())


async def fake_worker(context, steps):
    """A raw ROUTER playing a worker: welcomes one hello, then sends ``steps``."""
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve():
        owner, hello = await router.recv_multipart()
        assert decode(hello) == HelloMsg("coord")
        await router.send_multipart([owner, encode(WelcomeMsg(5))])
        for step in steps:
            await router.send_multipart([owner, encode(step)])

    return router, f"tcp://127.0.0.1:{port}", serve


def test_a_stream_ends_once():
    """A second failure (the caller's, after the channel's) never follows the final item."""

    async def main():
        streams = TokenStreams("coord")
        stream = streams.open("r", WORKER)
        assert streams.worker_lost(WORKER, "the token channel was closed") == 1
        stream.end(TokenEvent.failure("r", "worker failed", "worker_lost"))
        events = await read_all(stream)
        assert [e.error for e in events] == ["the token channel was closed"]
        await streams.aclose()

    run(main())


def test_dropped_events_and_gaps_end_their_requests():
    async def main():
        context = zmq.asyncio.Context()
        steps = [
            StepMsg(5, [token("a", 0), token("b", 0)]),
            StepMsg(6, [token("a", 1)], lost=("b",)),  # b's events were dropped on the worker
            StepMsg(8, [token("c", 0)]),  # 7 was lost on the way: every request here ends
        ]
        router, endpoint, serve = await fake_worker(context, steps)
        streams = TokenStreams("coord")
        a, b, c = (streams.open(r, WORKER) for r in "abc")
        await asyncio.gather(streams.connect(WORKER, endpoint), serve())
        ends = {r: (await read_all(s))[-1] for r, s in zip("abc", (a, b, c), strict=True)}
        assert {r: e.cause for r, e in ends.items()} == {r: "events_lost" for r in "abc"}
        assert streams.num_gaps == 1 and streams.num_unrouted == 1  # c's token came after
        await streams.aclose()
        router.close(0)
        context.term()

    run(main())


@pytest.mark.parametrize("mode", ["curve", "plain"])
def test_secured_channels_and_a_stranger_never_welcomed(mode):
    keys, other = generate_credentials(), generate_credentials()
    share = keys.receiver if mode == "curve" else keys.receiver.plaintext_gate()
    sender = TokenSender(credentials=share)

    async def main():
        streams, stranger = TokenStreams("coord"), TokenStreams("coord")
        await streams.connect(WORKER, sender.endpoint, counterpart(keys, share))
        with pytest.raises(TokenChannelError):
            await stranger.connect(WORKER, sender.endpoint, counterpart(other, share), 0.5)
        stream, peek = streams.open("r", WORKER), stranger.open("r", WORKER)
        sender.send_step({"coord": [last("r", 0)]})
        assert [e.finish_reason for e in await read_all(stream)] == [FinishReason.EOS]
        await asyncio.sleep(0.1)
        assert len(peek) == 0 and stranger.num_unrouted == 0 and not stranger.connected(WORKER)
        await streams.aclose()
        await stranger.aclose()

    try:
        run(main())
    finally:
        sender.close()
