"""The token bucket of one client, on a fake clock: it takes a request's max tokens while it
holds them, refuses with the seconds until it will, refills at its rate, takes back what was not
generated, lets a request of more than a minute's worth through a full bucket only, and forgets
the keys idle long enough to be full again."""

from __future__ import annotations

import pytest

from coordinator.api.token_bucket import SWEEP_AT, TokenBuckets
from coordinator.errors import TooManyRequests


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refuses_until_it_refills_and_names_only_its_own_limit():
    clock = Clock()
    buckets = TokenBuckets(60, clock)  # one token a second
    buckets.take("a", 50)
    with pytest.raises(TooManyRequests) as refused:
        buckets.take("a", 20)
    assert refused.value.retry_after_s == 10
    assert str(refused.value) == "this key may generate at most 60 tokens a minute"
    buckets.take("b", 60)  # another key's bucket is its own
    clock.now = 10.0
    buckets.take("a", 20)


def test_what_was_not_generated_is_given_back_up_to_a_full_bucket():
    buckets = TokenBuckets(100, Clock())
    buckets.take("a", 100)
    buckets.give_back("a", 90)
    buckets.take("a", 90)
    buckets.give_back("a", 500)
    assert buckets.buckets["a"].level == 100


def test_a_request_of_more_than_a_minute_needs_a_full_bucket_and_leaves_a_debt():
    clock = Clock()
    buckets = TokenBuckets(60, clock)
    buckets.take("a", 120)
    assert buckets.buckets["a"].level == -60
    with pytest.raises(TooManyRequests) as refused:
        buckets.take("a", 1)
    assert refused.value.retry_after_s == 61


def test_off_takes_nothing_and_keeps_no_bucket():
    buckets = TokenBuckets(0, Clock())
    buckets.take("a", 10**9)
    assert not buckets.buckets


def test_full_buckets_are_forgotten_when_many_are_held():
    clock = Clock()
    buckets = TokenBuckets(60, clock)
    for index in range(SWEEP_AT - 1):
        buckets.take(f"idle-{index}", 1)
    buckets.take("busy", 60)
    clock.now = 2.0  # the idle ones are full again, "busy" is not
    buckets.take("new", 1)
    assert set(buckets.buckets) == {"busy", "new"}
