"""Where a prompt's time to first token goes, from pdserve's own metrics: before and after each
rate of a sweep, ``GET /metrics`` is read, and the difference of the queue and prefill
histograms (``request_queue_time_seconds``, ``request_prefill_time_seconds``, by the role of
the engine that computed the prompt) gives, per role, the prompts computed there and their mean
wait and compute; the KV hand-offs' mean transfer time beside them (modes_report.phases_table
prints them)."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUEUE, PREFILL, TRANSFER = (
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "kv_transfer_seconds",
)
ROLES = ("prefill", "decode", "colocated")


def scrape(url: str) -> dict[tuple[str, str], float]:
    """:func:`parse` of the metrics at ``url``."""
    return parse(httpx.get(url, timeout=10).text)


def parse(text: str) -> dict[tuple[str, str], float]:
    """``{(sample name, role): value}`` of the histograms' sums and counts in ``text``."""
    figures: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (QUEUE, PREFILL, TRANSFER):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                key = (sample.name, sample.labels.get("role", ""))
                figures[key] = figures.get(key, 0.0) + sample.value
    return figures


def phase_means(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, Any]:
    """Per role, the prompts computed between the two scrapes and their mean queue and prefill
    seconds; ``transfer``: the hand-offs and their mean seconds."""

    def gained(name: str, role: str) -> float:
        return after.get((name, role), 0.0) - before.get((name, role), 0.0)

    def mean(name: str, role: str) -> float | None:
        count = gained(f"{name}_count", role)
        return gained(f"{name}_sum", role) / count if count else None

    out: dict[str, Any] = {}
    for role in ROLES:
        count = gained(f"{QUEUE}_count", role)
        if count:
            out[role] = {
                "prompts": int(count),
                "queue_s": mean(QUEUE, role),
                "prefill_s": mean(PREFILL, role),
            }
    transfers = gained(f"{TRANSFER}_count", "")
    if transfers:
        out["transfer"] = {"handoffs": int(transfers), "seconds": mean(TRANSFER, "")}
    return out
