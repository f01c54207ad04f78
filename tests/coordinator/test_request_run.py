"""RequestRun on its own: the phase order, attempts after migrations, tokens, and the end."""

from __future__ import annotations

import pytest

from coordinator.request_run import Migration, Outcome, RequestRun, RunPhase
from engine.outputs import TokenEvent
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest


def _run() -> RequestRun:
    return RequestRun(GenerationRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=8)))


def _token(n: int) -> TokenEvent:
    return TokenEvent("r", 100 + n, "", 3, n + 1, 0.0)


def test_the_phases_are_ordered_as_the_life_cycle_with_the_ends_last():
    assert list(RunPhase) == sorted(RunPhase)
    live = [p for p in RunPhase if p < RunPhase.FINISHED]
    assert [p.name for p in live] == ["QUEUED", "ROUTED", "PREFILLING", "HANDING_OFF", "DECODING"]


def test_within_an_attempt_the_phase_only_moves_forward():
    run = _run()
    run.route_to((0, 1))
    run.advance(RunPhase.DECODING)
    run.advance(RunPhase.HANDING_OFF)
    run.advance(RunPhase.FINISHED)  # only end() ends a run
    assert run.phase == RunPhase.DECODING and not run.is_finished


def test_a_migration_continues_after_the_tokens_relayed_so_far():
    run = _run()
    run.route_to((0, 0))
    assert run.attempt is run.request and run.attempt_id == "r"
    for n in range(2):
        run.record(_token(n))
    run.record(TokenEvent.failure("r", "worker died", "worker_lost"))
    run.migrate("worker_lost")
    assert (run.phase, run.route, run.failed_route) == (RunPhase.QUEUED, None, (0, 0))
    assert run.migrations == [Migration((0, 0), "worker_lost")]
    assert run.all_token_ids == [1, 2, 3, 100, 101]
    run.route_to((None, 1))
    assert run.attempt_id == "r-m1" and run.attempt.output_token_ids == (100, 101)
    assert run.first_token_at is not None


@pytest.mark.parametrize(
    "outcome, phase",
    [
        (Outcome.OK, RunPhase.FINISHED),
        (Outcome.ABORTED, RunPhase.ABORTED),
        (Outcome.TIMEOUT, RunPhase.FAILED),
        (Outcome.ERROR, RunPhase.FAILED),
        (Outcome.UNAVAILABLE, RunPhase.FAILED),
    ],
)
def test_the_first_end_holds(outcome, phase):
    run = _run()
    run.end(outcome)
    run.end(Outcome.ABORTED)
    run.abort()
    run.advance(RunPhase.DECODING)
    assert (run.outcome, run.phase, run.is_finished, run.aborted) == (outcome, phase, True, False)


def test_an_abort_is_recorded_until_the_end():
    run = _run()
    run.abort()
    run.record(TokenEvent.aborted("r"))
    assert run.aborted and run.output_token_ids == [] and run.first_token_at is None
