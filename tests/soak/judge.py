"""The soak test's verdict, from plain JSON samples (see ``soak_monitor``).

A run fails when

- a process's RSS grows after warm-up: the slope of a least-squares line through its samples
  after warm-up is above ``max_slope_mib_per_min`` AND it grew by more than ``max_growth_mib``
  from the first to the last of those samples (both must hold, so allocator noise on a short run
  and a slow drift that stays small both pass);
- a process's RSS or open file descriptors rise with the requests served after warm-up, in all
  fifths of that window but one (``soak_growth``: the gate a leak of a few KiB of RSS per
  request, or of a descriptor every few hundred, trips within a two-minute run);
- a process could not be measured (too few samples), or a worker's pid changed (it restarted);
- once idle, a worker still holds KV blocks, reservations, held requests or open streams, or
  does not report one of those figures, or never became idle;
- any request ended in an unexpected way (a 5xx, an error event, a refusal of a valid request),
  or none succeeded at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.soak.growth import (
    GrowthBounds,
    growth_failures,
    growth_trends,
    least_squares_slope,
)
from tests.soak.monitor import ACTIVITY_FIELDS, LEAK_FIELDS, MIB

DEFAULT_GROWTH = GrowthBounds()


@dataclass(frozen=True)
class RssBounds:
    max_slope_mib_per_min: float = 2.0
    max_growth_mib: float = 64.0
    warmup_s: float = 60.0


def default_warmup_s(duration_s: float) -> float:
    """The longer of the first minute and the first 20 % of the run, but at most half of it."""
    return min(max(60.0, 0.2 * duration_s), 0.5 * duration_s)


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    return least_squares_slope(points) * 60.0


def rss_trends(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per process: its RSS first/last/peak after warm-up, slope and growth."""
    names = sorted({name for s in samples for name in s.get("rss_mib", {})})
    trends = {}
    for name in names:
        every = [(s["t_s"], s["rss_mib"][name]) for s in samples if s["rss_mib"].get(name)]
        after = [(t, v) for t, v in every if t >= warmup_s]
        trend: dict[str, Any] = {
            "num_points": len(after),
            "start_mib": every[0][1] if every else None,
            "peak_mib": max((v for _, v in every), default=None),
            "first_after_warmup_mib": after[0][1] if after else None,
            "last_mib": every[-1][1] if every else None,
            "slope_mib_per_min": None,
            "growth_mib": None,
        }
        if len(after) >= 2:
            trend["slope_mib_per_min"] = round(slope_per_minute(after), 3)
            trend["growth_mib"] = round(after[-1][1] - after[0][1], 2)
        trends[name] = trend
    return trends


def heap_trends(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per worker that reports its C heap (``workers/heap.py``): the bytes in use and free, first
    and last after warm-up and their slopes, in MiB. Not a gate: what tells an RSS creep apart,
    the allocator keeping free pages (in use flat) from a leak (in use rising)."""
    names = sorted({name for s in samples for name in s.get("workers", {})})
    trends = {}
    for name in names:
        trend: dict[str, Any] = {}
        for key, label in (("heap_in_use_bytes", "in_use"), ("heap_free_bytes", "free")):
            points = [
                (s["t_s"], s["workers"][name][key] / MIB)
                for s in samples
                if s["t_s"] >= warmup_s and (s["workers"].get(name) or {}).get(key)
            ]
            if len(points) >= 2:
                trend[f"{label}_first_mib"] = round(points[0][1], 2)
                trend[f"{label}_last_mib"] = round(points[-1][1], 2)
                trend[f"{label}_slope_mib_per_min"] = round(slope_per_minute(points), 3)
        if trend:
            trends[name] = trend
    return trends


def pid_changes(samples: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Processes whose pid changed during the run, with every pid seen in order."""
    seen: dict[str, list[int]] = {}
    for sample in samples:
        for name, pid in sample.get("pids", {}).items():
            if pid is not None and (name not in seen or seen[name][-1] != pid):
                seen.setdefault(name, []).append(pid)
    return {name: pids for name, pids in seen.items() if len(pids) > 1}


def leftovers(workers: dict[str, dict[str, Any]]) -> dict[str, dict[str, int | None]]:
    """Per worker, each held-resource or activity figure that is not zero (None: not reported)."""
    found = {}
    for name, figures in sorted(workers.items()):
        left = {key: figures.get(key) for key in (*LEAK_FIELDS, *ACTIVITY_FIELDS)}
        left = {key: value for key, value in left.items() if value != 0}
        if left:
            found[name] = left
    return found


def rss_failures(trends: dict[str, dict[str, Any]], bounds: RssBounds) -> list[str]:
    failures = []
    for name, trend in trends.items():
        slope, growth = trend["slope_mib_per_min"], trend["growth_mib"]
        if trend["start_mib"] is None:
            failures.append(f"RSS of {name} was never read (pid unknown or not on this host)")
        elif slope is None:
            failures.append(
                f"RSS of {name}: {trend['num_points']} sample(s) after the "
                f"{bounds.warmup_s:.0f} s warm-up, at least 2 are needed"
            )
        elif slope > bounds.max_slope_mib_per_min and growth > bounds.max_growth_mib:
            failures.append(
                f"RSS of {name} grows: {slope:.2f} MiB/min (bound {bounds.max_slope_mib_per_min})"
                f" and +{growth:.1f} MiB after warm-up (bound {bounds.max_growth_mib})"
            )
    return failures


def leftover_failures(left: dict[str, dict[str, int | None]], idle: bool) -> list[str]:
    failures = []
    if not idle:
        failures.append("the workers did not become idle after the load stopped")
    for name, figures in left.items():
        for key, value in figures.items():
            if value is None:
                failures.append(f"{name} does not report {key} in /v1/instances")
            elif key in LEAK_FIELDS:
                failures.append(f"{name} still has {key} = {value} once idle")
            else:
                failures.append(f"{name} still has {key} = {value} after the load stopped")
    return failures


def judge(
    samples: list[dict[str, Any]],
    bounds: RssBounds,
    final_workers: dict[str, dict[str, Any]],
    idle: bool,
    by_cause: dict[str, int],
    growth: GrowthBounds = DEFAULT_GROWTH,
) -> list[str]:
    """Every reason the run fails (empty: it passed)."""
    failures = rss_failures(rss_trends(samples, bounds.warmup_s), bounds)
    failures += growth_failures(growth_trends(samples, bounds.warmup_s), growth)
    for name, pids in pid_changes(samples).items():
        failures.append(f"{name} restarted during the run: pids {pids}")
    if not final_workers:
        failures.append("no worker listed by /v1/instances at the end")
    failures += leftover_failures(leftovers(final_workers), idle)
    if by_cause.get("unexpected", 0):
        failures.append(f"{by_cause['unexpected']} request(s) ended unexpectedly")
    if not by_cause.get("ok", 0):
        failures.append("no request succeeded")
    return failures
