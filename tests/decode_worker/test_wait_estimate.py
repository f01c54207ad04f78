"""The pace of a full decode worker's grants (decode_worker/wait_estimate.py), and the queue that
refuses at once, on it, the hand-offs it could not serve in time (decode_worker/reservations.py)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from decode_worker.reservations import NoRoom, ReservationQueue
from decode_worker.wait_estimate import GrantPace
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.inprocess_workers import _config


def test_no_estimate_before_enough_grants():
    pace = GrantPace(min_grants=3)
    pace.waiting(0.0, True)
    pace.granted(1.0, 4)
    pace.granted(2.0, 4)
    assert pace.blocks_per_s(3.0) is None and pace.wait_s(3.0, 8) is None
    pace.granted(3.0, 4)
    assert pace.blocks_per_s(3.0) == pytest.approx(8 / 2)
    assert pace.wait_s(3.0, 8) == pytest.approx(2.0)
    assert pace.wait_s(3.0, -5) == 0.0  # room now


def test_only_waiting_time_counts_and_the_pace_falls_while_no_grant_comes():
    pace = GrantPace(min_grants=3)
    pace.waiting(0.0, True)
    pace.granted(0.0, 3)
    pace.granted(1.0, 3)
    pace.waiting(1.0, False)  # idle for 100 s: counts nothing
    pace.waiting(101.0, True)
    pace.granted(102.0, 3)
    assert pace.blocks_per_s(102.0) == pytest.approx(6 / 2)
    assert pace.blocks_per_s(106.0) == pytest.approx(6 / 6)  # 4 s more without a grant


def test_grants_into_an_empty_queue_say_nothing_of_the_pace():
    pace = GrantPace(min_grants=1)
    pace.granted(0.0, 50)  # fit at once: nobody waited
    pace.waiting(1.0, True)
    assert pace.blocks_per_s(2.0) is None
    pace.granted(2.0, 3)
    assert pace.blocks_per_s(2.0) is None  # one grant: no span yet
    pace.granted(3.0, 3)
    assert pace.blocks_per_s(3.0) == pytest.approx(3 / 1)


def test_grants_older_than_the_window_leave_it():
    pace = GrantPace(window_s=10.0, min_grants=2)
    pace.waiting(0.0, True)
    for at in (0.0, 1.0, 2.0):
        pace.granted(at, 100)
    pace.granted(20.0, 1)
    pace.granted(21.0, 1)
    assert pace.blocks_per_s(21.0) == pytest.approx(1 / 1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _new(engine: LLMEngine, request_id: str, tokens: int):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return engine.request(request_id, list(range(5, 5 + tokens)), params, True)


def test_waiters_the_pace_cannot_serve_in_time_are_refused_at_once_with_the_estimate(
    tiny_model_dir,
):
    """16 blocks of 4 tokens; a 50-token hand-off takes 13, each 10-token one 3. Three grants a
    second apart set the pace; once it is known, a waiter whose blocks are expected later than
    1.25 times the time it may still wait is refused as no room with the estimate, and the
    waiters behind it move up."""
    engine = LLMEngine(_config(tiny_model_dir, 16))
    clock = FakeClock()
    queue = ReservationQueue(timeout_s=120.0, clock=clock)
    answers: dict[str, Future] = {}

    def add(request_id: str, tokens: int, wait_s: float) -> None:
        answers[request_id] = Future()
        new = _new(engine, request_id, tokens)
        queue.add(engine, new, request_id, answers[request_id], clock.now + wait_s)

    add("fill", 50, 10.0)
    for i in range(9):
        add(f"w{i}", 10, 10.0)
    assert [answers[f"w{i}"].done() for i in range(2)] == [True, False]  # w0 took the last 3
    for i in range(3):  # w(i)'s blocks go to w(i + 1), a second apart
        clock.now += 1.0
        assert engine.abort(f"w{i}")
        queue.grant(engine)
        assert answers[f"w{i + 1}"].result() == 0
    assert queue.pace.blocks_per_s(clock.now) == pytest.approx(6 / 2)  # after the first grant
    assert queue.num_refused_early == 0  # w8, last, expects its blocks in 15 / 3 s: in time
    assert queue.drain_s == pytest.approx(15 / 3)  # a hint for the refusals past the cap
    clock.now += 4.0  # no grant for 4 s: 6 blocks in 6 s
    add("late_comer", 10, 10.0)
    # w4 expects its 3 blocks in 3 s, within 1.25 x its 3 s left; w5..w8 (6 s each) are
    # refused, so the late comer, with 10 s left, is next after w4: 6 s
    refused = [f"w{i}" for i in range(5, 9)]
    assert all(answers[name].done() for name in refused)
    for name in refused:
        answer = answers[name].result()
        assert isinstance(answer, NoRoom) and "expected in" in answer
        assert answer.retry_after_s == pytest.approx(6.0)
    assert not answers["w4"].done() and not answers["late_comer"].done()
    assert queue.num_refused_early == 4 and len(queue) == 2
    assert queue.drain_s == pytest.approx(6 / 1)
