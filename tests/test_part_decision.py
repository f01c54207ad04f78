"""A part is kept only if it wins beyond the 95 % intervals under one SLO and loses nowhere
beyond them under the other."""

from __future__ import annotations

from benchmarks.serving.part_decision import compare_at, decide, decision_table


def _summary(low: float, high: float) -> dict:
    return {"slo_attainment_95ci": [low, high]}


def _result(plain: dict[float, tuple[float, float]], gap: dict[float, tuple[float, float]]):
    def runs(shares):
        return [{"request_rate": r, "summary": _summary(*ci)} for r, ci in shares.items()]

    return {"runs": runs(plain), "with_itl_slo": {"runs": runs(gap)}}


def test_only_intervals_apart_count():
    assert compare_at(_summary(0.7, 0.9), _summary(0.3, 0.6)) == 1
    assert compare_at(_summary(0.3, 0.6), _summary(0.7, 0.9)) == -1
    assert compare_at(_summary(0.5, 0.8), _summary(0.3, 0.6)) == 0  # overlapping: a tie
    assert compare_at(None, _summary(0.3, 0.6)) == 0


def test_a_win_under_one_slo_keeps_a_part_unless_it_loses_under_the_other():
    base = _result({0.5: (0.3, 0.5), 1.0: (0.2, 0.4)}, {0.5: (0.3, 0.5), 1.0: (0.2, 0.4)})
    wins = _result({0.5: (0.6, 0.8), 1.0: (0.2, 0.4)}, {0.5: (0.3, 0.5), 1.0: (0.2, 0.4)})
    assert decide(wins, base)["keep"] and decide(wins, base)["TTFT+TPOT"]["wins"] == [0.5]
    trades = _result({0.5: (0.6, 0.8), 1.0: (0.2, 0.4)}, {0.5: (0.3, 0.5), 1.0: (0.0, 0.1)})
    verdict = decide(trades, base)
    assert not verdict["keep"] and verdict["TTFT+TPOT+gap"]["losses"] == [1.0]
    assert not decide(base, base)["keep"]  # a tie everywhere: deleted


def test_the_table_says_each_parts_verdict():
    base = _result({0.5: (0.3, 0.5)}, {0.5: (0.3, 0.5)})
    better = _result({0.5: (0.6, 0.8)}, {0.5: (0.3, 0.5)})
    table = decision_table({"a": better, "b": base}, {"lending": ("a", "b"), "gone": ("a", "x")})
    assert "| lending | a / b | TTFT+TPOT: 0.5; TTFT+TPOT+gap: none |" in table
    assert table.rstrip().endswith("| kept |") and "gone" not in table
