"""PNG plots of serving results: latency CDFs, goodput against request rate, TTFT by turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.serving.metrics import percentile

FIGURES = (("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"), ("e2e_s", "end-to-end (s)"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(results: dict[str, dict[str, Any]], path: Path) -> None:
    """One panel per latency; a line per deployment and rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(5 * len(FIGURES), 4))
    for ax, (key, title) in zip(axes, FIGURES, strict=True):
        for label, result in results.items():
            for run in result["runs"]:
                values = sorted(r[key] for r in run["requests"] if r.get(key) is not None)
                if values:
                    shares = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, shares, where="post", label=f"{label} @ {run['request_rate']}")
        ax.set_xlabel(title)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_goodput(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Goodput and SLO attainment against the offered request rate."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, result in results.items():
        runs = [r for r in result["runs"] if r["request_rate"] != float("inf")]
        rates = [r["request_rate"] for r in runs]
        left.plot(rates, [r["summary"]["goodput"] for r in runs], marker="o", label=label)
        right.plot(rates, [r["summary"]["slo_attainment"] for r in runs], marker="o", label=label)
    right.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    left.set_ylabel("goodput (req/s within SLO)")
    right.set_ylabel("SLO attainment")
    for ax in (left, right):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ttft_by_turn(requests: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """For multi-turn runs (requests with ``turn`` and ``ttft_s``): the TTFT CDF, and the
    median TTFT of each turn; a line per deployment."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, rows in requests.items():
        done = [r for r in rows if r.get("ttft_s") is not None]
        values = sorted(r["ttft_s"] for r in done)
        if not values:
            continue
        left.step(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        turns = sorted({r["turn"] for r in done})
        medians = [percentile([r["ttft_s"] for r in done if r["turn"] == t], 50) for t in turns]
        right.plot([t + 1 for t in turns], medians, marker="o", label=label)
    left.set_xlabel("TTFT (s)")
    left.set_ylabel("share of requests")
    right.set_xlabel("turn")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set_ylabel("median TTFT (s)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
