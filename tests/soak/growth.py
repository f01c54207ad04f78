"""The soak test's per-request growth gate: a figure that keeps rising with the work done.

A leak grows with the requests served (a few KiB of RSS, or a file descriptor, per request), so
after warm-up each process's RSS (KiB) and open file descriptors are fitted by least squares
against the number of requests finished so far, separately in each fifth of the samples after
warm-up (neighbouring fifths share a sample). A figure *leaks* when in all fifths but one it
rises by more than ``per_request`` per request and by more than ``floor`` in all (the jitter of
a reading). A leak lifts every fifth, and still four where the allocator hands memory back in
one; a one-off jump after warm-up (an arena, a buffer built for the largest batch yet) that then
stays flat lifts one, with the tail of the warm-up two or three.

A sample is the monitor's (``soak_monitor``): ``t_s``, ``rss_mib`` and ``fds`` per process,
``by_cause`` (requests finished so far, by cause).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FIGURES = {"rss_mib": 1024.0, "fds": 1.0}  # sample key: scale to the unit bounded (KiB, fds)
SEGMENTS = 5
MIN_POINTS = 2 * SEGMENTS + 1  # two in each segment, the shared ones counted once


@dataclass(frozen=True)
class GrowthBound:
    per_request: float  # most rise per request finished, in each segment
    floor: float  # a segment rising by no more than this in all does not count


@dataclass(frozen=True)
class GrowthBounds:
    """The defaults pass a healthy tiny-model cluster from its second minute on, whose workers
    still creep (allocator and caches: about 4 KiB of RSS per request in the second minute, 1
    after the sixth; the coordinator about 1.5, then under 0.5), and trip on a leak of a few KiB
    per request on top of that, or of a descriptor every few hundred requests."""

    coordinator_rss_kib: GrowthBound = GrowthBound(per_request=3.0, floor=512.0)
    worker_rss_kib: GrowthBound = GrowthBound(per_request=8.0, floor=512.0)
    fds: GrowthBound = GrowthBound(per_request=0.005, floor=2.0)

    def of(self, key: str, name: str) -> GrowthBound:
        if key == "fds":
            return self.fds
        return self.coordinator_rss_kib if name == "coordinator" else self.worker_rss_kib


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in points)
    if var_x == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var_x


def segment_trends(points: list[tuple[float, float]]) -> list[dict[str, float]] | None:
    """(slope per request, fitted rise) of each segment of (requests, value) points; None when
    there are fewer than ``MIN_POINTS``."""
    if len(points) < MIN_POINTS:
        return None
    ends = [round(i * (len(points) - 1) / SEGMENTS) for i in range(SEGMENTS + 1)]
    trends = []
    for first, last in zip(ends, ends[1:], strict=False):
        segment = points[first : last + 1]
        slope = least_squares_slope(segment)
        rise = slope * (segment[-1][0] - segment[0][0])
        trends.append({"per_request": round(slope, 4), "rise": round(rise, 2)})
    return trends


def served(sample: dict[str, Any]) -> int:
    return sum(sample.get("by_cause", {}).values())


def growth_points(samples: list[dict[str, Any]], key: str, name: str, warmup_s: float):
    """(requests finished, figure in the bounded unit) of ``name`` after warm-up."""
    scale = FIGURES[key]
    return [
        (served(s), s[key][name] * scale)
        for s in samples
        if s["t_s"] >= warmup_s and s.get(key, {}).get(name) is not None
    ]


def growth_trends(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per process, per figure: the number of its points after warm-up and the trend of each
    segment (None: too few points)."""
    trends: dict[str, dict[str, Any]] = {}
    for key in FIGURES:
        for name in sorted({n for s in samples for n in s.get(key, {})}):
            points = growth_points(samples, key, name, warmup_s)
            trend = {"num_points": len(points), "segments": segment_trends(points)}
            trends.setdefault(name, {})[key] = trend
    return trends


def leaks(segments: list[dict[str, float]], bound: GrowthBound) -> bool:
    rising = [s["per_request"] > bound.per_request and s["rise"] > bound.floor for s in segments]
    return sum(rising) >= len(segments) - 1


def growth_failures(trends: dict[str, dict[str, Any]], bounds: GrowthBounds) -> list[str]:
    """A figure never read is no failure here (RSS: ``soak_judge``; open fds may be another
    user's to read); one read too seldom after warm-up is."""
    failures = []
    for name, figures in trends.items():
        for key, trend in figures.items():
            unit = "KiB of RSS" if key == "rss_mib" else "open fds"
            segments, bound = trend["segments"], bounds.of(key, name)
            if trend["num_points"] and segments is None:
                failures.append(
                    f"{name}: {trend['num_points']} sample(s) of its {unit} after warm-up, "
                    f"the growth gate needs {MIN_POINTS}"
                )
            elif segments is not None and leaks(segments, bound):
                rates = ", ".join(f"{s['per_request']:g} (+{s['rise']:g})" for s in segments)
                failures.append(
                    f"{name} leaks {unit} per request: {rates} in the fifths after warm-up "
                    f"(bound {bound.per_request:g} per request, {bound.floor:g} in all)"
                )
    return failures
