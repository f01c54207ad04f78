"""A least-squares line through samples that age: each older sample weighs ``decay`` times the
one after it, so the fit follows a figure that drifts (the planner's decode steps, the pull
cost model's transfers)."""

from __future__ import annotations


class DecayedLine:
    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def add(self, x: float, y: float) -> None:
        s = self._sums
        for i in range(5):
            s[i] *= self.decay
        s[0] += 1.0
        s[1] += x
        s[2] += y
        s[3] += x * x
        s[4] += x * y

    def moments(self) -> tuple[float, float, float, float] | None:
        """``(mean x, mean y, variance of x, covariance)`` of the weighted samples; None before
        any."""
        w, x, y, xx, xy = self._sums
        if w <= 0:
            return None
        mean_x, mean_y = x / w, y / w
        return mean_x, mean_y, xx / w - mean_x * mean_x, xy / w - mean_x * mean_y
