"""What the router counts a decode worker as holding, for ``max_requests_per_worker``: its own
open requests exactly (from its choice to their release), and the other coordinators' as the
worker's last poll reports them (``requests_by_owner``, its own entry left out)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.errors import TooManyRequests
from tests.support.router_polls import PROMPT_A, FakeCluster, _router


def test_the_poll_counts_the_other_coordinators_and_not_this_ones_own_twice():
    cluster = FakeCluster(by_owner={("decode", 0): {"me": 5, "other": 2, "": 1}})
    router = _router(cluster, max_requests_per_worker=4)
    first, second = router.view.decodes
    assert (first.num_others_requests, second.num_others_requests) == (3, 0)
    chosen = router.choose(PROMPT_A, holder="a")[1]
    held = {w.instance: w.num_requests_held for w in router.view.decodes}
    assert held == {0: 3 + (chosen == 0), 1: int(chosen == 1)}


def test_a_cap_refuses_at_once_and_a_release_frees_the_place_before_any_poll():
    router = _router(FakeCluster(decodes=[0]), max_requests_per_worker=2)
    router.choose(PROMPT_A, holder="a")
    router.choose(PROMPT_A, holder="b")
    with pytest.raises(TooManyRequests):
        router.choose(PROMPT_A, holder="c")
    asyncio.run(router.view.refresh())  # a poll does not forget what is open
    with pytest.raises(TooManyRequests):
        router.choose(PROMPT_A, holder="c")
    router.release("b")
    assert router.choose(PROMPT_A, holder="c") == (0, 0)
    assert router.view.decodes[0].num_own_requests == 2
