"""Two modes of one served-stream run compared round by round: who is ahead is said only where
the interval of the per-round ratio excludes 1, and the direction follows the measure."""

from benchmarks.serving.mode_pair_report import pair_ratios, render_mode_pair


def _side(tokens_per_s, tpot, cpu):
    return {
        "tokens_per_s": {"rounds": tokens_per_s},
        "tpot_p50_ms": {"rounds": tpot},
        "cpu_ms_per_token:coordinator": {"rounds": cpu},
    }


DATA = {
    "sides": {
        "engine/single_node/32": {"tokens_per_s": {"rounds": [1, 1, 1, 1, 1]}},
        "served/single_node/openai/32": _side([100] * 5, [10, 11, 10, 11, 10], [0.2] * 5),
        "served/single_node_uvloop/openai/32": _side(
            [101, 99, 100, 102, 98], [9, 9.5, 9, 9.4, 9.1], [0.15, 0.16, 0.14, 0.15, 0.16]
        ),
        "served/single_node_uvloop/tgi/32": _side([1] * 5, [1] * 5, [1] * 5),  # no partner
    }
}


def test_each_measure_says_who_is_ahead_only_where_the_interval_excludes_one():
    rows = {row["measure"]: row for row in pair_ratios(DATA, "single_node_uvloop", "single_node")}
    assert set(rows) == {"tokens/s", "TPOT p50", "coordinator CPU ms/token"}
    assert rows["tokens/s"]["ahead"] == "undecided"
    assert rows["TPOT p50"]["ahead"] == "single_node_uvloop"  # a lower TPOT is better
    assert rows["coordinator CPU ms/token"]["ahead"] == "single_node_uvloop"
    assert rows["coordinator CPU ms/token"]["ratio"]["median"] == 0.75
    assert all(row["door"] == "openai" and row["n"] == 32 for row in rows.values())


def test_the_table_has_a_row_per_measure():
    table = render_mode_pair(DATA, "single_node_uvloop", "single_node", "header")
    assert table.startswith("header\n")
    assert table.count("| openai | 32 |") == 3


def test_a_figure_a_side_did_not_take_is_left_out():
    """A one-stream run reads TPOT 0 where it took none: no round with a 0 on either side makes
    a ratio (a 0 ratio would read as a side far ahead), and none left drops the row."""
    sides = {
        "served/single_node/infer/1": _side([10] * 5, [0, 30, 0, 0, 0], [1.0] * 5),
        "served/single_node_uvloop/infer/1": _side([10] * 5, [0] * 5, [0.9] * 5),
    }
    rows = pair_ratios({"sides": sides}, "single_node_uvloop", "single_node")
    assert [row["measure"] for row in rows] == ["tokens/s", "coordinator CPU ms/token"]
