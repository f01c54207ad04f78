"""A request's deadline over its waits (coordinator/request_deadline.py): a wait past it raises
RequestTimeout with the limit's message; a deadline passing between waits never cancels the
work in between, and the next wait ends at once; a cancellation from elsewhere stays one."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.errors import RequestTimeout
from coordinator.request_deadline import Deadline


async def slow_events(delay_s: float, count: int = 3):
    for i in range(count):
        await asyncio.sleep(delay_s)
        yield i


def test_a_wait_past_the_deadline_times_out_with_the_limits_message():
    async def main():
        deadline = Deadline(time.monotonic())
        deadline.set(0.05, "Request first token timeout")
        with pytest.raises(RequestTimeout, match="first token"):
            await deadline.wait(slow_events(1.0))
        deadline.clear()

    asyncio.run(main())


def test_waits_within_the_deadline_get_their_events_and_the_end():
    async def main():
        deadline = Deadline(time.monotonic())
        deadline.set(5.0, "Request inference timeout")
        events = slow_events(0.001, 2)
        assert [await deadline.wait(events), await deadline.wait(events)] == [0, 1]
        with pytest.raises(StopAsyncIteration):
            await deadline.wait(events)
        deadline.clear()

    asyncio.run(main())


def test_the_deadline_never_cancels_the_work_between_waits_the_next_wait_ends_at_once():
    async def main():
        deadline = Deadline(time.monotonic())
        deadline.set(0.02, "Request inference timeout")
        events = slow_events(0.0)
        assert await deadline.wait(events) == 0
        await asyncio.sleep(0.1)  # a client's write outlasting the deadline: not cancelled
        assert deadline.expired
        with pytest.raises(RequestTimeout, match="inference"):
            await deadline.wait(events)

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    async def main():
        deadline = Deadline(time.monotonic())
        deadline.set(0.2, "Request inference timeout")
        task = asyncio.create_task(deadline.wait(slow_events(1.0)))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline.clear()

    asyncio.run(main())


def test_a_limit_is_one_timer_the_same_limit_again_keeps_it_with_its_new_message():
    async def main():
        deadline = Deadline(time.monotonic())
        deadline.set(0.05, "Request first token timeout")
        timer = deadline._timer
        deadline.set(0.05, "Request inference timeout")
        assert deadline._timer is timer
        with pytest.raises(RequestTimeout, match="inference"):
            await deadline.wait(slow_events(1.0))
        deadline.set(float("inf"), "")
        assert deadline._timer is None and not deadline.expired
        assert await deadline.wait(slow_events(0.0)) == 0

    asyncio.run(main())


def test_a_limit_counts_from_the_requests_creation():
    async def main():
        deadline = Deadline(time.monotonic() - 10.0)  # made 10 s ago
        deadline.set(10.0, "Request inference timeout")  # so it has passed: fires at once
        with pytest.raises(RequestTimeout):
            await deadline.wait(slow_events(1.0))

    asyncio.run(main())
