"""The soak test's report: samples folded into minutes, the PNG and the summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def per_minute(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per minute of the run (the ``start`` and ``end`` samples fall into the first and
    last): the peak RSS of each process, peak KV usage of each worker, peak client in-flight
    requests, and the outcomes that ended within that minute by cause."""
    rows: dict[int, dict[str, Any]] = {}
    previous: dict[str, int] = {}
    for sample in samples:
        minute = int(sample["t_s"] // 60)
        row = rows.setdefault(
            minute,
            {
                "minute": minute,
                "rss_mib_max": {},
                "kv_usage_max": {},
                "in_flight_max": 0,
                "by_cause": {},
            },
        )
        row["t_s_last"] = sample["t_s"]
        _keep_max(row["rss_mib_max"], sample["rss_mib"])
        _keep_max(row["kv_usage_max"], sample["kv_usage"])
        row["in_flight_max"] = max(row["in_flight_max"], sample["in_flight"])
        for cause, count in sample["by_cause"].items():
            row["by_cause"][cause] = row["by_cause"].get(cause, 0) + count - previous.get(cause, 0)
        previous = sample["by_cause"]
    for row in rows.values():
        row["requests"] = sum(row["by_cause"].values())
    return [rows[minute] for minute in sorted(rows)]


def _keep_max(into: dict[str, float], values: dict[str, float | None]) -> None:
    for name, value in values.items():
        if value is not None:
            into[name] = max(into.get(name, value), value)


def plot(samples: list[dict[str, Any]], warmup_s: float, path: Path) -> None:
    """RSS per process, KV usage per worker and requests in flight, against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, kv, flight) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    minutes = [s["t_s"] / 60 for s in samples]
    for name in sorted({n for s in samples for n in s["rss_mib"]}):
        rss.plot(minutes, [s["rss_mib"].get(name) for s in samples], marker=".", label=name)
    for name in sorted({n for s in samples for n in s["kv_usage"]}):
        kv.plot(minutes, [s["kv_usage"].get(name) for s in samples], marker=".", label=name)
    flight.plot(minutes, [s["in_flight"] for s in samples], marker=".", label="client")
    for name in sorted({n for s in samples for n in s["workers"]}):
        running = [s["workers"].get(name, {}).get("num_running") for s in samples]
        flight.plot(minutes, running, marker=".", label=f"{name} running")
    for ax, title in (
        (rss, "RSS (MiB)"),
        (kv, "KV usage (share of blocks)"),
        (flight, "requests in flight"),
    ):
        ax.axvline(warmup_s / 60, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    flight.set_xlabel("minutes (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(result: dict[str, Any]) -> None:
    print(
        f"{'process':<12} {'pid':>8} {'start':>8} {'peak':>8} {'last':>8} "
        f"{'MiB/min':>8} {'growth':>8}"
    )
    last = result["samples"][-1] if result["samples"] else {"pids": {}}
    for name, trend in result["rss"].items():
        print(
            f"{name:<12} {last['pids'].get(name) or '-':>8} {_f(trend['start_mib'])} "
            f"{_f(trend['peak_mib'])} {_f(trend['last_mib'])} "
            f"{_f(trend['slope_mib_per_min'])} {_f(trend['growth_mib'])}"
        )
    for name, figures in result.get("growth", {}).items():
        print(f"{name:<12} per request, fifths after warm-up: {_fifths(figures)}")
    for name, heap in result.get("heap", {}).items():
        print(
            f"{name:<12} C heap after warm-up: in use {heap.get('in_use_first_mib')} -> "
            f"{heap.get('in_use_last_mib')} MiB ({heap.get('in_use_slope_mib_per_min')} MiB/min), "
            f"free {heap.get('free_first_mib')} -> {heap.get('free_last_mib')} MiB"
        )
    requests = result["requests"]
    causes = ", ".join(f"{cause} {count}" for cause, count in requests["by_cause"].items())
    print(f"requests: {requests['total']} ({causes})")
    print(f"leftovers once idle: {result['leftovers'] or 'none'}")
    for failure in result["failures"]:
        print(f"FAIL: {failure}")
    print("PASS" if result["passed"] else f"FAILED ({len(result['failures'])} reason(s))")


def _fifths(figures: dict[str, Any]) -> str:
    units = {"rss_mib": "KiB RSS", "fds": "fds"}
    parts = []
    for key, trend in figures.items():
        segments = trend["segments"]
        rates = "/".join(f"{s['per_request']:g}" for s in segments) if segments else "-"
        parts.append(f"{units.get(key, key)} {rates}")
    return ", ".join(parts)


def _f(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>8.1f}"
