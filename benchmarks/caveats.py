"""What a committed result cannot say, read from the file itself and printed under its table:
runs made before the harness kept a sweep's workload fixed, put llama-server at parity in the
closed loop, or kept its held-out seeds unseen. A result re-measured with those fixed has none."""

from __future__ import annotations

from typing import Any

from benchmarks.llamacpp.server import ServerSetting
from benchmarks.serving.draws import HELD_OUT_SEEDS


def serving(data: dict[str, Any]) -> list[str]:
    """The caveats of a ``compare_modes``-style sweep."""
    settings = data.get("settings", {})
    notes = []
    if "offered_load" not in data:
        notes.append(
            "Each rate served its own slice of each draw's requests, so the request shapes (and "
            "the prompt tokens offered per second) differ from rate to rate: the rate axis "
            "compares different workloads."
        )
    seeds = data.get("seeds", [])
    if seeds and not set(seeds) <= set(HELD_OUT_SEEDS):
        notes.append(
            f"Seeds {', '.join(map(str, seeds))} are tuning seeds now (a shipping configuration "
            "was chosen on them): these figures are not held-out."
        )
    loops = [int(n) for n in str(settings.get("closed_loop", "")).split(",") if n]
    if loops:
        if settings.get("closed_loop_turns", 2) < 2:
            notes.append(
                "Closed loop with one request per stream: each N is one burst of N requests, "
                "not a loop."
            )
        slots = [ServerSetting.parse(s).slots for s in _settings(settings)]
        if slots and max(loops) > max(slots) and not _slot_per_stream(data):
            notes.append(
                f"llama-server's closed loop ran with its sweep settings' slots (at most "
                f"{max(slots)}) at N up to {max(loops)}: not at parity."
            )
    return notes


def _slot_per_stream(data: dict[str, Any]) -> bool:
    """Whether llama-server's closed loop had a slot per stream (the run records its slots)."""
    peers = [r for m, r in data.get("results", {}).items() if m.startswith("llama_server")]
    loops = [d for r in peers for d in r.get("closed_loop_by_draw") or []]
    return bool(loops) and all(
        figures.get("slots", 0) >= int(n) for d in loops for n, figures in d.items()
    )


def replicas(data: dict[str, Any]) -> list[str]:
    notes = []
    if "arrivals" not in data.get("setup", {}):
        notes.append(
            "The one- and two-coordinator sides did not share their arrival times; the kill "
            "figure stops its clock at the first lease expiry, so it measures the lease timer."
        )
    return notes


def _settings(settings: dict[str, Any]) -> list[str]:
    return [s for s in str(settings.get("llama_server_settings") or "").split(",") if s]


def lines(notes: list[str]) -> list[str]:
    """The notes as the lines that close a rendered block (none when there is nothing to say)."""
    return ["", *(f"> Caveat: {note}" for note in notes)] if notes else []
