"""Idle cores lent between co-located workers: the lender's file, the borrower's thread count,
the hold after a hand-off, and the cores and files the cluster plans for each worker."""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from coordinator.cluster import Cluster
from coordinator.cluster_config import ActorResources, ClusterConfig
from workers import core_borrower, core_sharing, yield_policy
from workers.core_borrower import Borrower
from workers.core_sharing import Lender, lending_path, remove_lendings
from workers.yield_policy import PauseBudget, tpot_headroom_s


def _on_own_thread(fn):
    """``fn()`` on a fresh thread (torch's thread count is per thread there)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_borrower_runs_its_own_threads_plus_an_idle_lenders(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=3)

    def borrowing():
        borrower = Borrower(1, (lender.path,))
        idle = borrower.update(), torch.get_num_threads()
        lender.set_idle(False)
        busy = borrower.update(), torch.get_num_threads()
        lender.set_idle(True)
        again = borrower.update()
        return idle, busy, again, borrower.num_borrowing_steps

    idle, busy, again, borrowing_steps = _on_own_thread(borrowing)
    assert idle == (4, 4) and busy == (1, 1) and again == 4
    assert borrowing_steps == 2


def test_the_lender_file_changes_only_when_idleness_does(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=2)
    assert (tmp_path / "d0").read_bytes() == bytes((1, 2, 0, 0, 0, 0, 1, 0))
    lender.set_idle(False)
    assert (tmp_path / "d0").read_bytes() == bytes((0, 2, 0, 0, 0, 0, 1, 0))
    (tmp_path / "d0").write_bytes(bytes((7, 7, 0, 0, 0, 0, 1, 0)))
    lender.set_idle(False)  # no change: not rewritten
    assert (tmp_path / "d0").read_bytes() == bytes((7, 7, 0, 0, 0, 0, 1, 0))
    lender.close()
    assert not (tmp_path / "d0").exists()


def test_a_lender_on_another_host_lends_nothing_and_is_looked_for_again(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(core_borrower.time, "monotonic", lambda: now[0])
    path = str(tmp_path / "elsewhere")
    borrower = Borrower(1, (path,))
    assert _on_own_thread(borrower.update) == 1
    Lender(path, threads=1)  # it starts later on this host
    assert _on_own_thread(borrower.update) == 1  # not looked for again yet
    now[0] += core_sharing.RECHECK_MISSING_S
    assert _on_own_thread(borrower.update) == 2


def test_after_a_handoff_lenders_count_as_busy_until_seen_busy_or_the_hold_ends(
    tmp_path, monkeypatch
):
    now = [100.0]
    monkeypatch.setattr(core_borrower.time, "monotonic", lambda: now[0])
    lender = Lender(str(tmp_path / "d0"), threads=1)
    borrower = Borrower(1, (lender.path,))
    borrower.hold()
    assert _on_own_thread(borrower.update) == 1  # idle on file, but held
    # a long prompt's step on its own threads is kept short: the lender may be idle after all
    # (its stream done before this worker looked), and the next step finds out
    assert _on_own_thread(lambda: borrower.update(wants_yield=True)) == 1
    assert borrower.step_limit_s(2.0) == core_sharing.UNYIELDED_STEP_S
    now[0] += core_sharing.HANDOFF_HOLD_S
    assert _on_own_thread(lambda: borrower.update(wants_yield=True)) == 2  # the hold ran out
    assert borrower.step_limit_s(2.0) is None
    borrower.hold()
    lender.set_idle(False)
    assert _on_own_thread(borrower.update) == 1
    lender.set_idle(True)  # seen busy, then idle again: its own word counts
    assert _on_own_thread(borrower.update) == 2


def test_a_corrupt_lender_file_lends_nothing(tmp_path):
    (tmp_path / "d0").write_bytes(b"\x01")
    assert _on_own_thread(Borrower(1, (str(tmp_path / "d0"),)).update) == 1


def _yielding(lender: Lender, max_s: float, headroom=None) -> tuple[threading.Thread, list[float]]:
    """``lender.yield_if_wanted(max_s, headroom)`` on a thread of its own (its engine thread)."""
    paused: list[float] = []
    thread = threading.Thread(target=lambda: paused.append(lender.yield_if_wanted(max_s, headroom)))
    thread.start()
    return thread, paused


def test_a_busy_lender_yields_one_step_to_a_borrower_that_asks(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    assert lender.yield_if_wanted(5.0) == 0.0  # nobody asks: no pause

    def one_yielded_step():
        borrower = Borrower(1, (lender.path,))
        thread, paused = _yielding(lender, 5.0)  # sees no wish yet: returns at once
        thread.join()
        assert paused == [0.0]
        borrower.update(wants_yield=False)  # not asking: the busy lender lends nothing
        assert borrower.threads == 1
        borrower.update(wants_yield=True)  # asks; the lender yields at its next step
        thread, paused = _yielding(lender, 5.0)
        _until(lambda: _state(lender.path)[core_sharing.STATE] == core_sharing.YIELDING)
        threads = borrower.update(wants_yield=True)  # claims the yield, then runs in it
        in_yield = borrower.in_a_yield
        borrower.step_done()
        thread.join(timeout=5)
        again = borrower.update(wants_yield=True)  # the yield ended: own threads only
        borrower.idle()
        return threads, in_yield, paused, again, borrower.num_yielded_steps

    threads, in_yield, paused, again, yielded_steps = _on_own_thread(one_yielded_step)
    assert threads == 2 and in_yield and yielded_steps == 1
    assert paused and 0 < paused[0] < 1.0  # ended by the step, not by its 5 s limit
    assert again == 1 and lender.num_yields == 1
    assert (tmp_path / "d0").read_bytes()[core_sharing.STATE] == core_sharing.BUSY


def test_a_paused_lender_answers_the_calls_queued_meanwhile(tmp_path):
    """A reservation asked while the decode worker is paused is answered then, not after."""
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    pending: queue.Queue = queue.Queue()

    def serve() -> None:  # EngineLoop.run_pending
        while not pending.empty():
            pending.get_nowait()()

    def one_yield():
        borrower = Borrower(1, (lender.path,))
        borrower.update(wants_yield=True)
        thread = threading.Thread(target=lambda: lender.yield_if_wanted(5.0, None, serve))
        thread.start()
        _until(lambda: _state(lender.path)[core_sharing.STATE] == core_sharing.YIELDING)
        borrower.update(wants_yield=True)  # claims: the lender stays paused until step_done
        answered = threading.Event()
        pending.put(answered.set)
        in_the_pause = answered.wait(timeout=1.0)
        borrower.step_done()
        thread.join(timeout=5)
        return in_the_pause

    assert _on_own_thread(one_yield)


def _state(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_lender_learns_its_step_time_between_two_busy_steps_only(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(core_sharing.time, "monotonic", lambda: now[0])
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    for _ in range(30):  # nobody asks: each call only times the step before it
        lender.yield_if_wanted(1.0)
        now[0] += 0.02
    assert lender.step_s == pytest.approx(0.02)
    lender.set_idle(True)
    now[0] += 60.0  # idle for a minute: not a step
    lender.set_idle(False)
    lender.yield_if_wanted(1.0)
    assert lender.step_s == pytest.approx(0.02)


def test_a_lender_grants_only_the_pause_its_streams_afford_and_none_too_short(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    seen: list = []
    waited: list[float] = []

    def asks(afford_s: float):
        borrower = Borrower(1, (lender.path,))
        borrower.update(wants_yield=True)
        headroom = lambda step_s: seen.append(step_s) or afford_s  # noqa: E731
        thread, paused = _yielding(lender, 2.0, headroom)
        if afford_s >= core_sharing.MIN_GRANT_S:
            _until(lambda: _state(lender.path)[core_sharing.STATE] == core_sharing.YIELDING)
            borrower.update(wants_yield=True)  # claims: its step is sized to the grant
            limit = borrower.step_limit_s(2.0)
            borrower.step_done()
        else:
            thread.join(timeout=5)
            start = time.monotonic()
            borrower.update(wants_yield=True)  # the pause is put off: no wait for it ...
            waited.append(time.monotonic() - start)
            limit = borrower.step_limit_s(2.0)  # ... but short steps, for it to come soon
        thread.join(timeout=5)
        said = _state(lender.path)
        borrower.idle()
        return paused[0], limit, said

    paused, limit, said = _on_own_thread(lambda: asks(0.32))
    assert said[core_sharing.GRANT] == 6  # 0.3 s in 50 ms units: never more than afforded
    assert limit == pytest.approx(0.3 * core_sharing.YIELDED_STEP_FRACTION)
    assert 0 < paused < 0.3 and lender.num_yields == 1
    paused, limit, said = _on_own_thread(lambda: asks(0.05))  # too short to be worth a step
    assert paused == 0.0 and lender.num_yields == 1
    # only put off: the borrower keeps its steps short for the pause to come, and goes on
    assert said[core_sharing.OPEN] == core_sharing.DEFERRED
    assert limit == core_sharing.UNYIELDED_STEP_S and waited[0] < core_sharing.YIELD_WAIT_S / 2
    assert len(seen) >= 2  # asked each time, with the step time it learnt


def test_a_configured_pause_below_the_least_grant_is_still_given(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    _on_own_thread(lambda: Borrower(1, (lender.path,)).update(wants_yield=True))
    paused = lender.yield_if_wanted(0.05)  # decode_yield_ms 50: nobody claims it, it ends
    assert 0.05 <= paused < 0.5 and lender.num_yields == 1
    assert _state(lender.path)[core_sharing.GRANT] == 1  # 50 ms


def test_pauses_need_a_whole_one_earned_and_spend_what_they_lasted():
    budget = PauseBudget(0.25)
    assert budget.allows(2.0, now=100.0)  # the first pause is there at once
    budget.spend(2.0)
    assert not budget.allows(2.0, now=104.0)  # 1 s earned of the 2 s a pause needs
    assert budget.allows(2.0, now=108.0)
    budget.spend(0.4)  # a short pause spends only what it lasted
    assert not budget.allows(2.0, now=108.1) and budget.allows(2.0, now=110.0)
    assert budget.allows(2.0, now=500.0)  # never more than one pause held: not two in a row
    budget.spend(2.0)
    assert not budget.allows(2.0, now=500.0)
    assert budget.allows(0.4, now=501.6, most_s=2.0)  # a shorter pause needs only itself


def test_a_share_of_one_bounds_nothing():
    budget = PauseBudget(1.0)
    for now in (0.0, 0.001, 0.002):
        assert budget.allows(3.0, now)
        budget.spend(3.0)


@pytest.mark.parametrize("share", [0.1, 0.2, 0.5])
def test_pauses_take_at_most_their_share_of_the_time_however_often_asked(share):
    budget, now, paused = PauseBudget(share), 0.0, 0.0
    while now < 1000.0:  # a decode worker asked before every 50 ms step, pausing 3 s each time
        if budget.allows(3.0, now):
            budget.spend(3.0)
            now, paused = now + 3.0, paused + 3.0
        now += 0.05
    assert share - 0.01 <= paused / now <= share + 3.0 / now


def _stream(made: int, most: int, first_token_time: float | None, prompt_left: int = 0):
    return SimpleNamespace(
        num_output_tokens=made,
        max_output_tokens=most,
        first_token_time=first_token_time,
        num_uncomputed_tokens=prompt_left,
    )


def test_a_short_prompt_of_its_own_holds_pauses_with_or_without_a_tpot_target():
    now = 100.0
    streaming = _stream(made=4, most=32, first_token_time=now - 0.1)
    short = _stream(made=0, most=32, first_token_time=None, prompt_left=64)
    long = _stream(made=0, most=32, first_token_time=None, prompt_left=1000)
    assert yield_policy.own_prompt_headroom_s([streaming, long]) == math.inf
    assert yield_policy.own_prompt_headroom_s([streaming, short]) == 0.0
    assert tpot_headroom_s([streaming, short], 0.15, 0.02, now) == 0.0
    assert tpot_headroom_s([streaming, long], 0.15, 0.02, now) > 0


def test_the_headroom_is_what_the_tightest_stream_affords():
    fresh = _stream(1, 64, None)  # handed off, no decode step yet
    assert tpot_headroom_s([fresh], 0.15, 0.02, now=10.0) == pytest.approx(63 * 0.13)
    halfway = _stream(32, 64, 5.0)  # 5 s for 31 tokens: 4.45 s left of 63 * 0.15
    assert tpot_headroom_s([fresh, halfway], 0.15, 0.02, now=10.0) == pytest.approx(
        63 * 0.15 - 5.0 - 32 * 0.02
    )
    prefilling = _stream(0, 64, None, prompt_left=64)  # its own short prompt: first token first
    assert tpot_headroom_s([fresh, prefilling], 0.15, 0.02, now=10.0) == 0.0
    long_prompt = _stream(0, 32, None, prompt_left=yield_policy.SHORT_PROMPT_TOKENS)
    assert tpot_headroom_s([long_prompt], 0.15, 0.02, now=10.0) == math.inf  # a TTFT matter
    behind = _stream(10, 20, 0.0)  # 10 s in, 3 s budget: not paused further
    assert tpot_headroom_s([behind, fresh], 0.15, 0.02, now=10.0) == 0.0
    assert tpot_headroom_s([], 0.15, None, now=0.0) == math.inf
    last = _stream(64, 64, 0.0)  # made all but its end: affords its budget's rest
    assert tpot_headroom_s([last], 0.15, 0.02, now=9.0) == pytest.approx(63 * 0.15 - 9.0)


@pytest.mark.parametrize("step_s", [0.01, 0.03, 0.1])
@pytest.mark.parametrize("most_s", [0.2, 3.0])
def test_paused_whenever_asked_each_stream_keeps_its_tpot_target(step_s, most_s):
    """Streams of 32 tokens arriving one every 0.4 s, a decode worker asked before every step:
    each pause is what the tightest stream affords (``most_s`` at most)."""
    target, now, arrivals, streams, tpots = 0.15, 0.0, 0.0, [], []
    while now < 300.0:
        while arrivals <= now:
            streams.append(_stream(1, 32, arrivals))
            arrivals += 0.4
        pause = min(most_s, tpot_headroom_s(streams, target, step_s, now))
        now += pause if pause >= min(core_sharing.MIN_GRANT_S, most_s) else 0.0  # as Lender
        now += step_s
        for stream in streams:
            stream.num_output_tokens += 1
        tpots += [(now - s.first_token_time) / 31 for s in streams if s.num_output_tokens == 32]
        streams = [s for s in streams if s.num_output_tokens < 32]
    assert max(tpots) <= target * 1.001  # pauses included, every stream
    assert sum(tpots) / len(tpots) >= (0.5 if most_s < 1 else 0.8) * target  # room is used


def test_a_lender_that_just_paused_does_not_pause_again_until_it_has_earned_it(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1, yield_share=0.01)
    lender.set_idle(False)

    def two_asks():
        borrower = Borrower(1, (lender.path,))
        borrower.update(wants_yield=True)
        thread, paused = _yielding(lender, 2.0)
        _until(lambda: _state(lender.path)[core_sharing.STATE] == core_sharing.YIELDING)
        borrower.update(wants_yield=True)  # claims, runs its step in the yield
        time.sleep(0.3)  # the step: 0.3 s of pause spent, 30 s to earn back at 1 %
        borrower.step_done()
        thread.join(timeout=5)
        borrower.update(wants_yield=True)  # still asks
        again = lender.yield_if_wanted(2.0)  # but it has not earned a whole pause back
        said = _state(lender.path)[core_sharing.OPEN]
        start = time.monotonic()
        borrower.update(wants_yield=True)  # told no yield comes: it neither waits ...
        waited = time.monotonic() - start
        limit = borrower.step_limit_s(2.0)  # ... nor keeps its steps short for one
        borrower.idle()
        return paused, again, said, waited, limit

    paused, again, said, waited, limit = _on_own_thread(two_asks)
    assert paused and paused[0] >= 0.3 and again == 0.0 and lender.num_yields == 1
    assert said == 0 and waited < core_sharing.YIELD_WAIT_S / 2 and limit is None
    assert _state(lender.path)[core_sharing.STATE] == core_sharing.BUSY


def test_a_yield_nobody_claims_ends_at_its_limit_and_backs_off(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    borrower = Borrower(1, (lender.path,))
    _on_own_thread(lambda: borrower.update(wants_yield=True))  # asks, then dies or gets stuck
    long_enough = core_sharing.CLAIMABLE_S + 0.05  # for a live borrower's step to end
    thread, paused = _yielding(lender, long_enough)
    thread.join(timeout=5)
    assert long_enough <= paused[0] < long_enough + 1.0 and lender.num_unclaimed == 1
    assert lender.yield_if_wanted(long_enough) == 0.0  # backing off: streams are not paused
    assert _state(lender.path)[core_sharing.OPEN] == 0  # and it says so
    assert _state(lender.path)[core_sharing.STATE] == core_sharing.BUSY


def test_short_yields_unclaimed_back_off_only_several_in_a_row(tmp_path):
    # a pause shorter than a live borrower's step may end before it could claim: no backoff
    # (the borrower would compute the rest of its prompt alone, in one step, meanwhile) ...
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    borrower = Borrower(1, (lender.path,))
    _on_own_thread(lambda: borrower.update(wants_yield=True))  # asks, then stays in a step
    short = core_sharing.MIN_GRANT_S
    for _ in range(core_sharing.MAX_SHORT_UNCLAIMED - 1):
        assert lender.yield_if_wanted(short) >= short
    assert _state(lender.path)[core_sharing.OPEN] == core_sharing.OPEN_NOW
    # ... but a dead one does not cost every step a pause: so many in a row back off
    assert lender.yield_if_wanted(short) >= short
    assert lender.yield_if_wanted(short) == 0.0
    assert _state(lender.path)[core_sharing.OPEN] == core_sharing.CLOSED
    assert lender.num_unclaimed == core_sharing.MAX_SHORT_UNCLAIMED


def test_a_yield_ends_when_the_borrower_stops_asking(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    borrower = Borrower(1, (lender.path,))
    _on_own_thread(lambda: borrower.update(wants_yield=True))
    thread, paused = _yielding(lender, 5.0)
    _until(lambda: _state(lender.path)[core_sharing.STATE] == core_sharing.YIELDING)
    _on_own_thread(borrower.idle)  # its work is done: it asks no more
    thread.join(timeout=5)
    assert 0 < paused[0] < 1.0 and lender.num_unclaimed == 0


def _lender_file(path, state: int, yield_seq: int, done_seq: int, wants: int = 1) -> str:
    with open(path, "wb") as f:
        f.write(bytes((state, 1, yield_seq, done_seq, wants, 0, 1, 40)))  # 2 s granted
    return str(path)


def test_a_claimed_yield_is_run_once_and_released_at_the_step_end(tmp_path):
    path = _lender_file(tmp_path / "d0", core_sharing.YIELDING, 5, 4)

    def steps():
        borrower = Borrower(1, (path,))
        first = borrower.update(wants_yield=True), borrower.step_limit_s(2.0)
        claimed = _state(path)[core_sharing.CLAIM_SEQ]
        borrower.step_done()
        # the lender has not seen the release yet: the yield is not taken twice, and the
        # borrower waits for the next one rather than counting the lender as idle
        second = borrower.update(wants_yield=True), borrower.step_limit_s(2.0)
        return first, claimed, second

    first, claimed, second = _on_own_thread(steps)
    assert first == (2, pytest.approx(2.0 * core_sharing.YIELDED_STEP_FRACTION)) and claimed == 5
    assert _state(path)[core_sharing.DONE_SEQ] == 5
    assert second == (1, core_sharing.UNYIELDED_STEP_S)


def test_a_yield_withdrawn_while_claimed_is_released_at_once(tmp_path, monkeypatch):
    path = _lender_file(tmp_path / "d0", core_sharing.YIELDING, 5, 4)
    real_write = core_borrower._Lending.write

    def withdrawn_as_claimed(self, offset, value):
        real_write(self, offset, value)
        if offset == core_sharing.CLAIM_SEQ:  # the lender's deadline: it writes BUSY just now
            with open(path, "r+b") as f:
                f.write(bytes((core_sharing.BUSY,)))

    monkeypatch.setattr(core_borrower._Lending, "write", withdrawn_as_claimed)
    borrower = Borrower(1, (path,))
    assert _on_own_thread(lambda: borrower.update(wants_yield=True)) == 1
    assert not borrower.in_a_yield
    state = _state(path)
    assert state[core_sharing.CLAIM_SEQ] == 5 and state[core_sharing.DONE_SEQ] == 5


def test_a_yield_is_taken_only_while_asking_and_a_restarted_borrower_clears_a_stale_wish(
    tmp_path,
):
    path = _lender_file(tmp_path / "d0", core_sharing.YIELDING, 5, 4, wants=1)  # left by a dead one
    borrower = Borrower(1, (path,))
    assert _on_own_thread(lambda: borrower.update(wants_yield=False)) == 1
    state = _state(path)
    assert state[core_sharing.WANTS] == 0 and state[core_sharing.CLAIM_SEQ] == 0


def test_steps_are_limited_only_in_a_yield_or_while_waiting_for_one_on_a_busy_lender(tmp_path):
    busy = Lender(str(tmp_path / "d0"), threads=1)
    busy.set_idle(False)
    idle = Lender(str(tmp_path / "d1"), threads=1)

    def limits():
        waiting = Borrower(1, (busy.path,))
        waiting.update(wants_yield=True)
        lent = Borrower(1, (idle.path,))
        lent.update(wants_yield=True)
        elsewhere = Borrower(1, (str(tmp_path / "on-another-host"),))
        elsewhere.update(wants_yield=True)
        not_asking = Borrower(1, (busy.path,))
        not_asking.update(wants_yield=False)
        return [b.step_limit_s(2.0) for b in (waiting, lent, elsewhere, not_asking)]

    assert _on_own_thread(limits) == [core_sharing.UNYIELDED_STEP_S, None, None, None]


def test_a_borrower_with_no_long_prompt_never_waits_for_a_yield(tmp_path):
    lender = Lender(str(tmp_path / "d0"), threads=1)
    lender.set_idle(False)
    assert _on_own_thread(Borrower(1, (lender.path,)).update) == 1
    assert lender.yield_if_wanted(5.0) == 0.0


def test_the_cleanup_removes_only_this_clusters_files(tmp_path, monkeypatch):
    monkeypatch.setattr(core_sharing, "SHM_DIR", tmp_path)
    mine = [Lender(lending_path("abc", role, 0), 1) for role in ("prefill", "decode")]
    other = Lender(lending_path("xyz", "decode", 0), 1)
    remove_lendings("abc")
    assert not any(os.path.exists(lender.path) for lender in mine)
    assert os.path.exists(other.path)


def _planned(share: bool, cores: list[int] | None, **config):
    cluster = Cluster(ClusterConfig(share_idle_cores=share, **config))
    cluster._cores = cores
    one, cfg = ActorResources(1.0), cluster.config
    roles = cluster._role_cores([one] * cfg.num_prefill, [one] * cfg.num_decode)
    return roles, cluster._sharing(cfg.num_prefill, cfg.num_decode), cluster


def test_sharing_pins_each_worker_to_its_cores_and_the_other_roles():
    (prefill, decode), (lend_p, lend_d), cluster = _planned(
        True, [0, 1, 2], num_prefill=2, num_decode=1
    )
    assert prefill == [(0, 2), (1, 2)] and decode == [(0, 1, 2)]
    # each lender has one borrower: no core is lent twice
    assert [s.borrow_paths for s in lend_p] == [(lend_d[0].lend_path,), ()]
    assert lend_d[0].borrow_paths == tuple(s.lend_path for s in lend_p)
    assert all(s.low_priority for s in lend_p) and not lend_d[0].low_priority
    assert not any(s.yield_ms or s.asked_yield_ms for s in [*lend_p, *lend_d])
    assert all(cluster._id in s.lend_path for s in [*lend_p, *lend_d])


def test_decode_workers_yield_and_prefill_workers_ask_for_decode_yield_ms():
    _, (lend_p, lend_d), _ = _planned(True, [0, 1], decode_yield_ms=3000)
    assert lend_p[0].asked_yield_ms == 3000 and not lend_p[0].yield_ms
    assert lend_d[0].yield_ms == 3000 and not lend_d[0].asked_yield_ms


def test_without_sharing_each_worker_keeps_its_own_cores_and_lends_nothing():
    (prefill, decode), sharing, _ = _planned(False, [0, 1])
    assert prefill == [(0,)] and decode == [(1,)]
    assert sharing == ([None], [None])


def test_unpinned_workers_share_by_thread_count_alone():
    (prefill, decode), (lend_p, _), _ = _planned(True, None)
    assert prefill == [None] and decode == [None]
    assert lend_p[0] is not None and lend_p[0].borrow_paths


@pytest.mark.parametrize("raw", [True, False])
def test_the_backend_key_reaches_the_cluster_config(raw):
    from coordinator.config import defaults
    from coordinator.served_model import ServedModels, cluster_config

    overrides = {
        "backend_config.share_idle_cores": raw,
        "backend_config.decode_yield_ms": 250,
        "backend_config.decode_yield_percent": 35,
        "backend_config.decode_yield_tpot_ms": 120,
    }
    cluster = cluster_config(defaults().with_overrides(overrides), ServedModels(None, None))
    assert cluster.share_idle_cores is raw and cluster.decode_yield_ms == 250
    assert cluster.decode_yield_percent == 35 and cluster.decode_yield_tpot_ms == 120
    keys = {"decode_yield_ms": 250, "decode_yield_percent": 35, "decode_yield_tpot_ms": 120}
    _, (lend_p, lend_d), _ = _planned(True, [0, 1], **keys)
    assert lend_d[0].yield_share == pytest.approx(0.35) and lend_d[0].yield_tpot_ms == 120
    assert lend_d[0].yield_ms == 250 and not lend_d[0].low_priority and not lend_d[0].asked_yield_ms
    assert lend_p[0].asked_yield_ms == 250
