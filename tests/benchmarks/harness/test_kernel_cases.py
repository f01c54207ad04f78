import torch

from benchmarks.harness.kernel_cases import kernel_rounds, micros_per_call, speedup_cases
from benchmarks.harness.stats import Goal


def _case(name: str, rows: int):
    return (name, "q8_0", torch.zeros(rows, 32), torch.zeros(1))


def test_every_side_of_every_case_is_timed_each_kept_round_with_its_repeats():
    calls = []

    def time_side(side, case, n):
        calls.append((side, case[0], n))
        return {"a": 1.0, "b": 2.0}[side]

    kept = kernel_rounds(
        [_case("one", 1), _case("eight", 8)], ["a", "b"], time_side, rounds=3,
        repeats=lambda rows: 80 // rows,
    )  # fmt: skip
    each = {"a": [1.0] * 3, "b": [2.0] * 3}
    assert kept == {"one": each, "eight": each}
    assert len(calls) == 2 * 2 * 4  # a warm-up round dropped
    assert {n for _, name, n in calls if name == "eight"} == {10}
    first = [side for side, name, _ in calls if name == "one"][::2]
    assert first == ["a", "b", "a", "b"]  # the side going first alternates


def test_the_speed_up_is_the_slower_sides_time_over_the_faster_sides_and_is_judged():
    kept = {"case": {"fast": [1.0, 1.0, 1.0, 1.0, 1.0], "slow": [2.0, 2.1, 1.9, 2.0, 2.0]}}
    result = speedup_cases(kept, "fast", "slow", Goal(1.5))["case"]
    assert result["fast_speedup"]["median"] == 2.0
    assert result["slow_us"]["median"] == 2.0
    assert result["verdict"] == "met"
    missed = speedup_cases(kept, "fast", "slow", Goal(3.0))["case"]
    assert missed["verdict"] != "met"


def test_micros_per_call_counts_every_call():
    count = []
    assert micros_per_call(lambda: count.append(1), 5) >= 0
    assert len(count) == 6  # one untimed first
