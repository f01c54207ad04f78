"""Whether two runs of one benchmark reach the same verdicts: each goal judged in both files by
the rule of :mod:`benchmarks.harness.stats`, side by side.

    python -m benchmarks.verdicts benchmarks/results/vs_llamacpp.json /tmp/vs_llamacpp-later.json

Exit 1 when a goal's verdict differs between the two (a verdict that does not survive a re-run
of the same code is no verdict), 2 when the files share no judged measure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness.stats import Goal, Judgement, judge
from benchmarks.report import engine_goal, vs_llamacpp_measures


def judged(data: dict[str, Any]) -> Iterator[tuple[str, Judgement]]:
    """(measure, verdict) for each measure of an engine-style result with a goal and rounds."""
    for file, measure, entry in vs_llamacpp_measures(data):
        goal = engine_goal(file, measure)
        rounds = entry.get("ratio", {}).get("rounds") if isinstance(entry, dict) else None
        if goal is not None and rounds:
            name = measure if file is None else f"{file} {measure}"
            yield name, judge(rounds, Goal(goal))
    for streams, row in data.get("serving", {}).get("streams", {}).items():
        goal = data.get("goals", {}).get("tpot_ratio_at_most", {}).get(streams)
        if goal is not None and row["ratio"].get("rounds"):
            yield f"structured {streams} streams", judge(row["ratio"]["rounds"], Goal(goal, False))


def side_by_side(
    first: dict[str, Any], second: dict[str, Any]
) -> list[tuple[str, Judgement, Judgement]]:
    """(measure, first run's verdict, second run's) for the measures both files judge."""
    a, b = dict(judged(first)), dict(judged(second))
    return [(name, a[name], b[name]) for name in a if name in b]


def compare(first: dict[str, Any], second: dict[str, Any]) -> tuple[list[str], int]:
    """Lines for the measures both files judge, and how many verdicts differ."""
    lines, differ = [], 0
    for name, a, b in side_by_side(first, second):
        same = a.verdict == b.verdict
        differ += not same
        lines.append(f"{'same' if same else 'DIFFER':<7}{name:<36}{a!s:<48}{b!s}")
    return lines, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    lines, differ = compare(json.loads(args.first.read_text()), json.loads(args.second.read_text()))
    print("\n".join(lines) or "no measure judged in both files")
    return 2 if not lines else 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
