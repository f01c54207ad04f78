"""Whether a part of pdserve earns its lines, from one ``compare_modes`` result file: the mode
with the part against the same mode without it, rate by rate, under both SLOs.

Both modes served the same draws (the same requests, in one rotation), so the decision rests on
paired per-draw differences: at a rate, the requests within the SLO with the part minus without
it, draw by draw. The part *wins* there when the bootstrap interval of their median lies wholly
above zero, *loses* when wholly below (:func:`benchmarks.harness.stats.decided`). It is kept only
if it wins somewhere under one SLO and loses nowhere under the other; with fewer than
``MIN_KEPT_ROUNDS`` draws nothing is decided. A decision stands only when a second run gives
the same (``python -m benchmarks.verdicts``).

    python -m benchmarks.serving.part_decision RESULT.json "NAME=WITH,WITHOUT" ...

prints the decision table of each part NAME: mode WITH (the part on) against mode WITHOUT, both
served in RESULT.json (a ``compare_modes`` run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness.stats import MIN_KEPT_ROUNDS, decided, paired_differences
from benchmarks.serving.modes_report import at_rate

SLOS = {"TTFT+TPOT": None, "TTFT+TPOT+gap": "with_itl_slo"}


def compare_at(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> int:
    """+1 if ``ours`` met the SLO in more requests than ``theirs`` draw by draw (the paired
    differences' interval above zero), -1 if in fewer, 0 when undecided or not comparable."""
    mine, other = (s.get("met_per_draw") if s else None for s in (ours, theirs))
    if not mine or not other or len(mine) != len(other):
        return 0
    side = decided(paired_differences(mine, other))
    return 1 if side == "a" else -1 if side == "b" else 0


def decide(with_part: dict[str, Any], without: dict[str, Any]) -> dict[str, Any]:
    """Per SLO, the rates the part wins and loses at, and whether it is kept (None: too few
    draws to say)."""
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
    draws = min((len(r["summary"].get("met_per_draw") or []) for r in with_part["runs"]), default=0)
    verdict["draws"] = draws
    verdict["keep"] = (
        None
        if draws < MIN_KEPT_ROUNDS
        else bool((plain["wins"] and not gap["losses"]) or (gap["wins"] and not plain["losses"]))
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
        keep = verdict["keep"]
        kept = (
            f"undecided ({verdict['draws']} draws)"
            if keep is None
            else ("kept" if keep else "deleted")
        )
        lines.append(f"| {part} | {with_mode} / {without_mode} | {wins} | {losses} | {kept} |")
    return "\n".join(lines)


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{rate:g}" for rate in rates) or "none"


def parse_part(text: str) -> tuple[str, tuple[str, str]]:
    """``NAME=WITH,WITHOUT`` -> (NAME, (WITH, WITHOUT))."""
    name, _, modes = text.partition("=")
    with_mode, _, without_mode = modes.partition(",")
    if not (name and with_mode and without_mode):
        raise argparse.ArgumentTypeError(f"a part is NAME=WITH,WITHOUT, got {text!r}")
    return name, (with_mode, without_mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a compare_modes result file")
    parser.add_argument("parts", nargs="+", type=parse_part, help="NAME=WITH,WITHOUT")
    args = parser.parse_args(argv)
    results = json.loads(args.result.read_text())["results"]
    missing = sorted({mode for _, pair in args.parts for mode in pair} - set(results))
    if missing:
        parser.error(f"not in {args.result}: {', '.join(missing)} (has {', '.join(results)})")
    print(decision_table(results, dict(args.parts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
