"""Serving figures from per-request timings: percentiles, throughput, SLO attainment, goodput.

TTFT is the time from sending a request to its first token; TPOT the mean gap between its later
tokens, ``(e2e - ttft) / (output_tokens - 1)``; its inter-token gap (ITL) the 99th percentile of
the gaps between consecutive token arrivals. A request meets the SLOs when it succeeded, its
TTFT is within ``ttft_s``, its TPOT within ``tpot_s`` and, when ``itl_s`` is set, its p99 gap
within ``itl_s`` (a one-token answer has no TPOT or gap and meets those parts). Goodput is the
number of such requests per second of the run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness.record import RequestRecord, percentile

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 3.0
    tpot_s: float = 0.150
    itl_s: float | None = None  # a request's p99 gap between tokens; None: not an SLO

    def describe(self) -> str:
        itl = f", p99 inter-token gap <= {self.itl_s * 1000:.0f} ms" if self.itl_s else ""
        return f"TTFT <= {self.ttft_s} s, TPOT <= {self.tpot_s * 1000:.0f} ms{itl}"


def failed_requests(records: list[RequestRecord], examples: int = 5) -> dict[str, Any] | None:
    """How many of ``records`` failed and a few of their distinct errors (None: none failed). A
    request that ended with no token and no error says so."""
    failed = [r for r in records if not r.ok]
    if not failed:
        return None
    texts = sorted({r.error or "no token received" for r in failed})
    return {"count": len(failed), "examples": texts[:examples]}


def distribution(values: list[float]) -> dict[str, float | None]:
    summary: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    summary["mean"] = sum(values) / len(values) if values else None
    return summary


def attainment(records: list[RequestRecord], slo: SLO) -> float:
    """Share of all sent requests that met both SLOs (failures count against it)."""
    return _attained(records, slo, 0.0)["slo_attainment"]


def wilson_interval(met: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95 % with ``z`` 1.96) of the share ``met / n``: how far the
    SLO attainment of ``n`` requests may be from the rate's true one."""
    if n <= 0:
        return 0.0, 1.0
    share, z2 = met / n, z * z
    centre = (share + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _attained(records: list[RequestRecord], slo: SLO, duration_s: float) -> dict[str, Any]:
    """The requests of a run within ``slo``: how many, their share (and its 95 % interval), and
    per second of the run (goodput)."""
    met = sum(r.meets(slo.ttft_s, slo.tpot_s, slo.itl_s) for r in records)
    return {
        "num_requests": len(records),
        "num_met": met,
        "slo_attainment": met / len(records) if records else 0.0,
        "slo_attainment_95ci": list(wilson_interval(met, len(records))),
        "goodput": met / duration_s if duration_s else 0.0,
    }


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """Throughput, latency percentiles, SLO attainment (and its 95 % interval) and goodput of
    one run."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "num_succeeded": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_token_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "ttft_s": distribution([r.ttft_s for r in done]),
        "tpot_s": distribution([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_s": distribution([g for r in done for g in r.gaps_s]),
        "e2e_s": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "slo": asdict(slo),
        "failed_requests": failed_requests(records),
        **_attained(records, slo, duration_s),
    }


def max_rate_within_slo(runs: list[dict[str, Any]], target: float = 0.9) -> float | None:
    """The highest request rate of a sweep whose SLO attainment is at least ``target``, where
    every lower rate passed too (None when the lowest already fails)."""
    best = None
    for run in sorted(runs, key=lambda r: r["request_rate"]):
        if run["summary"]["slo_attainment"] < target:
            break
        best = run["request_rate"]
    return best


def highest_rate_holding(runs: list[dict[str, Any]], target: float = 0.9) -> float | None:
    """The highest request rate whose own SLO attainment is at least ``target``, whatever the
    lower rates did (None when no rate holds it)."""
    held = [run["request_rate"] for run in runs if run["summary"]["slo_attainment"] >= target]
    return max(held, default=None)


def record_from_dict(row: dict[str, Any]) -> RequestRecord:
    """A :class:`RequestRecord` back from its ``to_dict`` form."""
    fields = {k: v for k, v in row.items() if k != "tpot_s"}
    return RequestRecord(**fields)


def rescore(runs: list[dict[str, Any]], slo: SLO) -> dict[str, Any]:
    """A sweep's runs judged against another ``slo`` from their requests: attainment and
    goodput per rate, and the highest rate within it."""
    scored = []
    for run in runs:
        records = [record_from_dict(row) for row in run["requests"]]
        summary = _attained(records, slo, run["summary"]["duration_s"])
        scored.append({"request_rate": run["request_rate"], "summary": summary})
    return {"slo": asdict(slo), "runs": scored, "max_rate_within_slo": max_rate_within_slo(scored)}
