"""A part is kept only if, draw by draw, it met the SLO in more requests than the mode without
it (the paired differences' interval above zero) under one SLO and in fewer nowhere under the
other; with fewer than five draws nothing is decided."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving.part_decision import compare_at, decide, decision_table, main


def _summary(*met: int) -> dict:
    return {"met_per_draw": list(met)}


def _result(plain: dict[float, list[int]], gap: dict[float, list[int]]) -> dict:
    def runs(counts):
        return [{"request_rate": r, "summary": _summary(*met)} for r, met in counts.items()]

    return {"runs": runs(plain), "with_itl_slo": {"runs": runs(gap)}}


BASE = [5, 6, 5, 4, 6]


def test_only_differences_wholly_on_one_side_count():
    assert compare_at(_summary(8, 9, 8, 7, 9), _summary(*BASE)) == 1
    assert compare_at(_summary(*BASE), _summary(8, 9, 8, 7, 9)) == -1
    assert compare_at(_summary(6, 5, 6, 4, 6), _summary(*BASE)) == 0  # +1, -1, +1, 0, 0
    assert compare_at(_summary(9, 9), _summary(1, 1)) == 0  # two draws decide nothing
    assert compare_at(None, _summary(*BASE)) == 0


def test_a_win_under_one_slo_keeps_a_part_unless_it_loses_under_the_other():
    more = [8, 9, 8, 7, 9]
    base = _result({0.5: BASE, 1.0: BASE}, {0.5: BASE, 1.0: BASE})
    wins = _result({0.5: more, 1.0: BASE}, {0.5: BASE, 1.0: BASE})
    assert decide(wins, base)["keep"] is True and decide(wins, base)["TTFT+TPOT"]["wins"] == [0.5]
    trades = _result({0.5: more, 1.0: BASE}, {0.5: BASE, 1.0: [1, 2, 1, 0, 2]})
    verdict = decide(trades, base)
    assert verdict["keep"] is False and verdict["TTFT+TPOT+gap"]["losses"] == [1.0]
    assert decide(base, base)["keep"] is False  # a tie everywhere: deleted
    few = _result({0.5: [9, 9]}, {0.5: [9, 9]})
    assert decide(few, _result({0.5: [1, 1]}, {0.5: [1, 1]}))["keep"] is None


def test_the_table_says_each_parts_verdict():
    base = _result({0.5: BASE}, {0.5: BASE})
    better = _result({0.5: [8, 9, 8, 7, 9]}, {0.5: BASE})
    table = decision_table({"a": better, "b": base}, {"lending": ("a", "b"), "gone": ("a", "x")})
    assert "| lending | a / b | TTFT+TPOT: 0.5; TTFT+TPOT+gap: none |" in table
    assert table.rstrip().endswith("| kept |") and "gone" not in table
    short = decision_table({"a": _result({0.5: [9]}, {0.5: [9]}), "b": base}, {"p": ("a", "b")})
    assert short.rstrip().endswith("| undecided (1 draws) |")


def test_the_command_line_prints_the_table_and_names_a_missing_mode(tmp_path, capsys):

    base = _result({0.5: BASE}, {0.5: BASE})
    better = _result({0.5: [8, 9, 8, 7, 9]}, {0.5: BASE})
    result = tmp_path / "modes.json"
    result.write_text(json.dumps({"results": {"a": better, "b": base}}))
    assert main([str(result), "lending=a,b"]) == 0
    assert "| lending | a / b |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(result), "lending=a,zzz"])
    error = capsys.readouterr().err
    assert "not in" in error and "zzz" in error
    with pytest.raises(SystemExit):
        main([str(result), "lending"])
