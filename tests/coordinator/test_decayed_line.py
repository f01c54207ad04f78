"""The decayed least-squares line: exact on a line, and following a drift."""

from __future__ import annotations

import pytest

from coordinator.decayed_line import DecayedLine


def test_it_is_exact_on_a_line_and_follows_a_drift():
    line = DecayedLine(0.9)
    assert line.moments() is None
    for x in (1, 2, 3, 4) * 5:
        line.add(x, 2 + 3 * x)
    mean_x, mean_y, spread, covariance = line.moments()
    assert covariance / spread == pytest.approx(3) and mean_y - 3 * mean_x == pytest.approx(2)
    for x in (1, 2, 3, 4) * 30:  # the line moved: the old samples fade
        line.add(x, 5 + 3 * x)
    mean_x, mean_y, spread, covariance = line.moments()
    assert mean_y - covariance / spread * mean_x == pytest.approx(5, abs=0.01)
