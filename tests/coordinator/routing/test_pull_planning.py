"""Peer prefix pulls in the router (``kv_peer_pull``): the prefill worker chosen for a prompt
whose prefix another worker holds pulls it when the measured costs say the transfer beats the
compute, and not otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.routing.pull_cost import MIN_BLOCKS, PRIOR_BLOCK_S, PRIOR_OVERHEAD_S, PullCosts
from tests.support.router_polls import _poll, _queued, _router

LONG = list(range(300, 341))  # 41 tokens: 10 full blocks of 4, the last token computed


def _busy_holder(router, token_s: float) -> None:
    """``LONG`` sent to pair (0, 0), then prefill 0 too busy to take it again; prefill 1
    computes a prompt token in ``token_s``."""
    assert router.choose(LONG, holder="first") == (0, 0)
    assert router.take_pull("first") is None  # nobody held it
    _poll(router, prefill_0=_queued(10_000),
          prefill_1=replace(_queued(0), prompt_token_seconds=token_s))  # fmt: skip


def test_a_slow_compute_pulls_the_prefix_from_its_holder():
    router = _router(peer_pull=True, max_prefill_imbalance=100)
    _busy_holder(router, token_s=0.001)  # 4 ms a block: 10 blocks, 40 ms against ~20 ms
    assert router.choose(LONG, holder="second")[0] == 1
    plan = router.take_pull("second")
    assert plan is not None and plan.num_blocks == 10
    assert plan.source in {("prefill", 0), ("decode", 0)}
    assert router.take_pull("second") is None  # taken once


def test_a_fast_compute_or_slow_pulls_compute_it():
    router = _router(peer_pull=True, max_prefill_imbalance=100)
    _busy_holder(router, token_s=0.00005)  # 0.2 ms a block: cheaper than any transfer
    router.choose(LONG, holder="second")
    assert router.take_pull("second") is None
    slow = _router(peer_pull=True, max_prefill_imbalance=100)
    for _ in range(30):  # pulls measured at 200 ms each
        slow.pull_costs.record(0.2, 10)
    _busy_holder(slow, token_s=0.001)
    slow.choose(LONG, holder="second")
    assert slow.take_pull("second") is None


def test_without_peer_pull_nothing_is_planned():
    router = _router(max_prefill_imbalance=100)
    _busy_holder(router, token_s=0.001)
    router.choose(LONG, holder="second")
    assert router.take_pull("second") is None


def test_the_cost_model_learns_from_the_pulls_made():
    costs = PullCosts()
    assert costs.estimate(10) == pytest.approx(PRIOR_OVERHEAD_S + 10 * PRIOR_BLOCK_S)
    assert not costs.worth(MIN_BLOCKS - 1, 1.0)  # too few blocks to bother
    assert not costs.worth(10, 0.0)  # no compute time known
    for _ in range(60):  # pulls of two sizes: 2 ms fixed, 3 ms a block
        costs.record(0.002 + 2 * 0.003, 2)
        costs.record(0.002 + 20 * 0.003, 20)
    overhead, block_s = costs.terms
    assert overhead == pytest.approx(0.002, rel=0.05) and block_s == pytest.approx(0.003, rel=0.05)


def test_a_pull_stuck_until_its_timeout_does_not_switch_pulls_off():
    costs = PullCosts()
    for _ in range(20):
        costs.record(0.012, 2)
        costs.record(0.03, 20)
    before = costs.estimate(20)
    costs.record(30.0, 0, num_asked=20)  # timed out: capped at a few times its estimate
    assert costs.estimate(20) < 4 * before
    assert costs.worth(20, 0.01)  # 20 blocks of 10 ms compute still pull
