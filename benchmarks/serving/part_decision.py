"""Whether a part of pdserve earns its lines, from one ``compare_modes.py`` result file: the mode
with the part against the same mode without it, rate by rate, under both SLOs.

A part *wins* at a rate under an SLO when its pooled share of requests within that SLO has a
95 % interval wholly above the other's, and *loses* when wholly below. It is kept only if it wins
somewhere under one SLO and loses nowhere under the other:

    keep = any(wins[a] and not losses[b] for a, b in ((TTFT+TPOT, +gap), (+gap, TTFT+TPOT)))
"""

from __future__ import annotations

from typing import Any

from benchmarks.serving.modes_report import at_rate

SLOS = {"TTFT+TPOT": None, "TTFT+TPOT+gap": "with_itl_slo"}


def compare_at(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> int:
    """+1 if ``ours`` is within the SLO beyond ``theirs``'s interval, -1 if below, 0 else."""
    if not ours or not theirs:
        return 0
    low, high = ours["slo_attainment_95ci"]
    their_low, their_high = theirs["slo_attainment_95ci"]
    return 1 if low > their_high else -1 if high < their_low else 0


def decide(with_part: dict[str, Any], without: dict[str, Any]) -> dict[str, Any]:
    """Per SLO, the rates the part wins and loses at, and whether it is kept."""
    rates = [run["request_rate"] for run in with_part["runs"]]
    verdict: dict[str, Any] = {}
    for slo, view in SLOS.items():
        ours = with_part.get(view, {}) if view else with_part
        theirs = without.get(view, {}) if view else without
        signs = {rate: compare_at(at_rate(ours, rate), at_rate(theirs, rate)) for rate in rates}
        verdict[slo] = {
            "wins": [rate for rate, sign in signs.items() if sign > 0],
            "losses": [rate for rate, sign in signs.items() if sign < 0],
        }
    plain, gap = (verdict[slo] for slo in SLOS)
    verdict["keep"] = bool(
        (plain["wins"] and not gap["losses"]) or (gap["wins"] and not plain["losses"])
    )
    return verdict


def decision_table(results: dict[str, dict[str, Any]], parts: dict[str, tuple[str, str]]) -> str:
    """``parts``: name -> (mode with it, mode without it), both in ``results``."""
    lines = [
        "| part | with / without | wins at (req/s) | loses at (req/s) | verdict |",
        "|---|---|---|---|---|",
    ]
    for part, (with_mode, without_mode) in parts.items():
        if with_mode not in results or without_mode not in results:
            continue
        verdict = decide(results[with_mode], results[without_mode])
        wins = "; ".join(f"{slo}: {_rates(verdict[slo]['wins'])}" for slo in SLOS)
        losses = "; ".join(f"{slo}: {_rates(verdict[slo]['losses'])}" for slo in SLOS)
        kept = "kept" if verdict["keep"] else "deleted"
        lines.append(f"| {part} | {with_mode} / {without_mode} | {wins} | {losses} | {kept} |")
    return "\n".join(lines)


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{rate:g}" for rate in rates) or "none"
