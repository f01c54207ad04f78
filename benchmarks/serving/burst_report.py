"""The table of a burst run (``benchmarks/serving/burst.py``), for ``benchmarks/report.py``."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.stats import Goal, judge

OUTCOMES = ("200", "429", "408")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio_line(data: dict[str, Any]) -> list[str]:
    """The goal's line: the largest burst's served requests a second over the smallest's."""
    ratio = data.get("throughput_ratio")
    if ratio is None:
        return []
    goal = Goal(data["goal"]["at_least"])
    return [
        "",
        f"Served a second, {ratio['ours']} requests over {ratio['theirs']}, per round: median "
        f"{ratio['median']:.3f} [{ratio['low']:.3f}-{ratio['high']:.3f}] (95 % interval; rounds "
        f"{', '.join(f'{r:.3f}' for r in ratio['rounds'])}); {goal}: "
        f"{judge(ratio['rounds'], goal)}.",
    ]


def render(data: dict[str, Any], provenance: str) -> str:
    """One row per burst size (summed or medians over the kept rounds): what its requests heard,
    and when; the pool after it; then the throughput goal's verdict."""
    settings = data["settings"]
    rounds = settings.get("rounds", 1)
    lines = [
        provenance,
        "",
        f"`pd_separate`, {settings['kv_cache_mb']} MB of KV cache an engine, "
        f"`schedule_timeout` {settings['schedule_timeout_s']} s, ~100-token prompts, "
        f"{settings['new_tokens']} tokens an answer; {rounds} kept round(s) of each size, "
        "outcomes, lapsed leases summed over them, timings their medians, blocks the most any "
        "round left; seconds from a request's send to its answer.",
        "",
        "| requests | served (200) | refused (429) | timed out (408) | other | served a second "
        "| served p50 s | refused p50 s | refused max s | `Retry-After` p50 s "
        "| CPU s coordinator / workers | leases lapsed | blocks in use after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in data["bursts"]:
        outcomes = run["outcomes"]
        counts = [outcomes.get(name, 0) for name in OUTCOMES]
        other = sum(n for name, n in outcomes.items() if name not in OUTCOMES)
        cells = [
            *map(str, [run["requests"], *counts, other]),
            f"{run['served_per_s']:.2f}",
            _s(run["served_s_p50"]),
            _s(run["refused_s_p50"]),
            _s(run["refused_s_max"]),
            _s(run["retry_after_s_p50"]),
            f"{_s(run.get('coordinator_cpu_s'))} / {_s(run.get('workers_cpu_s'))}",
            str(run["leases_expired"]),
            str(run["blocks_in_use_after"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _ratio_line(data))
