"""Two modes of one served-stream run side by side (``served_stream.py`` with, e.g.,
``--modes single_node,single_node_uvloop``): per door and N, ``ours / theirs`` round by round for
tokens/s, TPOT p50 and the coordinator's CPU per token, each with its 95 % interval and which side
the interval says is ahead (undecided while it holds 1)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.stats import bootstrap_interval, spread

# (title, figure, whether a higher figure is better)
MEASURES: tuple[tuple[str, str, bool], ...] = (
    ("tokens/s", "tokens_per_s", True),
    ("TPOT p50", "tpot_p50_ms", False),
    ("coordinator CPU ms/token", "cpu_ms_per_token:coordinator", False),
)


def pair_ratios(data: dict[str, Any], ours: str, theirs: str) -> list[dict[str, Any]]:
    """A row per door, N and measure: ``ours / theirs`` over rounds and who is ahead."""
    rows = []
    for name, figures in data["sides"].items():
        kind, mode, door, n = (name.split("/") + ["", "", ""])[:4]
        other = data["sides"].get(f"served/{theirs}/{door}/{n}")
        if kind != "served" or mode != ours or other is None:
            continue
        for title, key, higher_better in MEASURES:
            a, b = figures[key]["rounds"], other[key]["rounds"]
            ratios = [x / y for x, y in zip(a, b, strict=True) if x and y]
            if not ratios:  # a figure the run did not take at this N (0: none)
                continue
            low, high = bootstrap_interval(ratios)
            if low > 1 or high < 1:
                ahead = ours if (low > 1) == higher_better else theirs
            else:
                ahead = "undecided"
            row = {"door": door, "n": int(n), "measure": title, "ratio": spread(ratios, 3)}
            rows.append(row | {"low": low, "high": high, "ahead": ahead})
    return rows


def render_mode_pair(data: dict[str, Any], ours: str, theirs: str, header: str = "") -> str:
    lines = [
        f"| door | N | measure | `{ours}` / `{theirs}`, median [95 % interval] | ahead |",
        "|---|---|---|---|---|",
    ]
    for row in pair_ratios(data, ours, theirs):
        shown = f"{row['ratio']['median']:.3f} [{row['low']:.3f}-{row['high']:.3f}]"
        lines.append(f"| {row['door']} | {row['n']} | {row['measure']} | {shown} | "
                     f"{row['ahead']} |")  # fmt: skip
    return "\n".join([*([header, ""] if header else []), *lines])
