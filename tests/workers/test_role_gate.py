"""The role gate of elastic workers: calls admitted by role and epoch, a switch as a
compare-and-set on the epoch, and no flip while an admitted call is inside."""

from __future__ import annotations

import threading

import pytest

from workers.contracts import RoleState
from workers.role_gate import ANY_EPOCH, DECODE, PREFILL, RETIRED, RoleGate


def test_admits_only_its_role_at_its_epoch():
    gate = RoleGate(PREFILL)
    with gate.admit(PREFILL) as refusal:
        assert refusal == ""
    with gate.admit(PREFILL, 0) as refusal:
        assert refusal == ""
    with gate.admit(DECODE) as refusal:
        assert "serves prefill now (epoch 0), not decode" in refusal
    with gate.admit(PREFILL, 3) as refusal:
        assert "stale role epoch 3" in refusal
    assert gate.num_refused == 2


def test_a_switch_is_a_compare_and_set_on_the_epoch():
    gate = RoleGate(PREFILL)
    assert "stale role epoch 1" in gate.begin(DECODE, 1)[0]
    assert gate.begin(PREFILL, 0) == ("this worker serves prefill already", False)
    assert gate.begin("embedding", 0)[0].startswith("role must be one of prefill, decode")
    assert gate.begin(DECODE, 0) == ("", True)
    assert gate.begin(DECODE, 0) == ("", False)  # the same switch asked again: under way
    assert gate.begin(PREFILL, 0) == ("already switching to decode", False)
    with gate.admit(PREFILL) as refusal:  # no work of either role while it switches
        assert "switching from prefill to decode" in refusal
    with gate.admit(DECODE) as refusal:
        assert "switching" in refusal
    state = gate.finish()
    assert (state.serving, state.epoch, state.switching) == (DECODE, 1, False)
    with gate.admit(DECODE, 1) as refusal:
        assert refusal == ""
    with gate.admit(DECODE, 0) as refusal:  # a sender that saw the old epoch
        assert "stale role epoch 0" in refusal
    assert "stale" in gate.begin(PREFILL, 0)[0]  # a second planner that saw epoch 0 loses
    with pytest.raises(RuntimeError):
        gate.finish()


def test_not_quiet_while_an_admitted_call_is_inside():
    gate = RoleGate(DECODE)
    inside, leave = threading.Event(), threading.Event()

    def call() -> None:
        with gate.admit(DECODE, ANY_EPOCH) as refusal:
            assert refusal == ""
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=call)
    thread.start()
    assert inside.wait(5)
    assert gate.begin(PREFILL, 0) == ("", True)
    assert not gate.quiet()
    leave.set()
    thread.join(5)
    assert gate.quiet()
    assert not gate.wait_past(0, 0.01)
    gate.finish()
    assert gate.wait_past(0, 0.01)


def test_a_role_it_cannot_serve_is_refused_at_start():
    with pytest.raises(ValueError, match="role must be one of prefill, decode"):
        RoleGate("colocated")


def test_a_retired_worker_takes_nothing_again():
    gate = RoleGate(DECODE)
    assert gate.begin(RETIRED, 0) == ("", True)
    with gate.admit(DECODE) as refusal:
        assert "switching from decode to retired" in refusal
    assert gate.finish().serving == RETIRED
    for role in (PREFILL, DECODE):
        with gate.admit(role, 1) as refusal:
            assert "serves retired now" in refusal
    assert gate.begin(PREFILL, 1) == ("this worker is retired", False)


def test_an_abandoned_switch_keeps_the_role_and_can_be_asked_again():
    gate = RoleGate(DECODE)
    assert gate.begin(PREFILL, 0) == ("", True)
    assert gate.abandon() == RoleState(DECODE, 0)
    with gate.admit(DECODE, 0) as refusal:
        assert refusal == ""
    assert gate.begin(PREFILL, 0) == ("", True)  # a fresh drain, not "under way already"
