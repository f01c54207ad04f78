"""The tables and ratios of ``compare_modes.py``: each mode's highest rate within the SLO (with
and without the inter-token gap; the rate it holds on its own, and the monotone figure), its
latencies and goodput at a common rate, and the goals' ratios against the best-tuned
``single_node`` (the best of its budgets at each rate) and the best-tuned llama-server (the best
of its settings at each rate). Also the spread of each share within the SLO
(``attainment_table``), where prompts spent their time (``phases_table``) and the closed-loop
throughput (``closed_loop_table``)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.stats import spread
from benchmarks.serving.phases import ROLES

SINGLE = "single_node"
ADAPTIVE = "pd_adaptive"
PEER = "llama_server"
TUNED_BY = {SINGLE: "budget", PEER: "setting"}


def run_at(result: dict[str, Any], rate: float) -> dict[str, Any] | None:
    return next((r for r in result["runs"] if r["request_rate"] == rate), None)


def at_rate(result: dict[str, Any], rate: float) -> dict[str, Any] | None:
    run = run_at(result, rate)
    return None if run is None else run["summary"]


def best_tuned(results: dict[str, dict[str, Any]], family: str) -> dict[str, Any] | None:
    """The best-tuned ``family`` (its modes ``family`` and ``family@<setting>``): at each rate
    and SLO the setting with the most goodput; its highest rates within each SLO are the best
    any setting reached."""
    variants = {mode: r for mode, r in results.items() if mode.partition("@")[0] == family}
    if not variants:
        return None
    rates = sorted({run["request_rate"] for r in variants.values() for run in r["runs"]})
    runs = []
    for rate in rates:
        mode, summary = max(
            ((m, at_rate(r, rate)) for m, r in variants.items() if at_rate(r, rate)),
            key=lambda pair: pair[1]["goodput"],
        )
        runs.append({"request_rate": rate, "summary": summary, "mode": mode})

    def best(view: str | None, key: str = "max_rate_within_slo") -> float | None:
        maxima = [
            (r[view] if view else r).get(key)
            for r in variants.values()
            if view is None or view in r
        ]
        return max((m for m in maxima if m is not None), default=None)

    return {
        "runs": runs,
        "max_rate_within_slo": best(None),
        "max_rate_own": best(None, "max_rate_own"),
        "with_itl_slo": {
            "runs": _best_itl_runs(variants, rates),
            "max_rate_within_slo": best("with_itl_slo"),
            "max_rate_own": best("with_itl_slo", "max_rate_own"),
        },
        "closed_loop_by_draw": _best_loops(variants),
    }


def _best_itl_runs(variants: dict[str, dict[str, Any]], rates: list[float]) -> list[dict[str, Any]]:
    """Per rate, the variant's run with the most goodput under the SLO with the gap."""
    itl_runs = []
    for rate in rates:
        views = [r["with_itl_slo"] for r in variants.values() if "with_itl_slo" in r]
        scored = [s for s in (at_rate(view, rate) for view in views) if s]
        if scored:
            itl_runs.append({"request_rate": rate, "summary": max(scored, key=_goodput)})
    return itl_runs


def _best_loops(variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per draw and concurrency, the variant with the most output tokens/s."""
    loops = [r.get("closed_loop_by_draw") or [] for r in variants.values()]
    draws = min((len(by_draw) for by_draw in loops), default=0)
    best: list[dict[str, Any]] = []
    for index in range(draws):
        merged: dict[str, Any] = {}
        for by_draw in loops:
            for n, figures in by_draw[index].items():
                if figures.get("num_failed") and n in merged:
                    continue  # a setting that failed requests is never the best
                if (
                    n not in merged
                    or merged[n].get("num_failed")
                    or figures["output_token_throughput"] > merged[n]["output_token_throughput"]
                ):
                    merged[n] = figures
        best.append(merged)
    return best


def _goodput(summary: dict[str, Any]) -> float:
    return summary["goodput"]


def table(results: dict[str, dict[str, Any]], common_rate: float) -> str:
    at = f"@ {common_rate:g} req/s"
    lines = [
        "| mode | highest rate >= 90 % within TTFT+TPOT (req/s) | monotone: every lower rate "
        "too (req/s) | highest rate, with p99 gap too (req/s) | "
        f"p99 TPOT {at} (ms) | p99 TTFT {at} (s) | p99 inter-token gap {at} (ms) | "
        f"goodput {at} (req/s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, result in _with_best_tuned(results).items():
        summary = at_rate(result, common_rate) or {}
        p99 = {key: (summary.get(key) or {}).get("p99") for key in ("tpot_s", "ttft_s", "itl_s")}
        ttft = "-" if p99["ttft_s"] is None else f"{p99['ttft_s']:.2f}"
        gap = result.get("with_itl_slo") or {}
        lines.append(
            f"| {mode} | {_rate(result.get('max_rate_own'))} | "
            f"{_rate(result['max_rate_within_slo'])} | {_rate(gap.get('max_rate_own'))} | "
            f"{_ms(p99['tpot_s'])} | {ttft} | {_ms(p99['itl_s'])} | "
            f"{summary.get('goodput', 0):.2f} |"
        )
    return "\n".join(lines)


def _rate(rate: float | None) -> str:
    return "none" if rate is None else f"{rate:g}"


def closed_loop_table(results: dict[str, dict[str, Any]]) -> str:
    """Per mode (and best-tuned family) and concurrency: output tokens/s, median [min-max] over
    the draws, and the median over draws of TTFT p50/p99 (s) and TPOT p50/p99 (ms)."""
    rows = {m: r for m, r in _with_best_tuned(results).items() if r.get("closed_loop_by_draw")}
    counts = sorted({int(n) for r in rows.values() for d in r["closed_loop_by_draw"] for n in d})
    if not counts:
        return ""
    head = " | ".join(f"N = {n}: tok/s; TTFT p50/p99 (s); TPOT p50/p99 (ms)" for n in counts)
    lines = [f"| closed loop | {head} |", "|---" * (len(counts) + 1) + "|"]
    for mode, result in rows.items():
        cells = [_loop_cell([d.get(str(n)) for d in result["closed_loop_by_draw"]]) for n in counts]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _loop_cell(draws: list[dict[str, Any] | None]) -> str:
    """Draws with a failed request count as failed, never as slow or absent: the cell says how
    many requests failed in all, and the figures are those of the clean draws."""
    ran = [d for d in draws if d]
    runs = [d for d in ran if not d.get("num_failed")]
    failed = sum(d.get("num_failed") or 0 for d in ran)
    sent = sum(d.get("num_requests") or 0 for d in ran)
    note = f"; {failed} of {sent} requests failed" if failed else ""
    if not runs:
        return f"all draws failed{note}" if ran else "-"
    rates = [d["output_token_throughput"] for d in runs]

    def median(key: str, q: str) -> float:
        return statistics.median(d[key][q] or 0.0 for d in runs)

    return (
        f"{statistics.median(rates):.1f} [{min(rates):.1f}-{max(rates):.1f}]; "
        f"{median('ttft_s', 'p50'):.2f}/{median('ttft_s', 'p99'):.2f}; "
        f"{median('tpot_s', 'p50') * 1000:.0f}/{median('tpot_s', 'p99') * 1000:.0f}{note}"
    )


def attainment_table(results: dict[str, dict[str, Any]], with_gap: bool = False) -> str:
    """Per mode (and best-tuned family) and rate: the requests within the SLO (with the p99
    gap too, ``with_gap``) out of those sent, and the 95 % interval of that share: the spread
    one run's sample leaves, which says how far two runs may differ."""
    rows = _with_best_tuned(results)
    rates = sorted({run["request_rate"] for r in rows.values() for run in r["runs"]})
    slo = "TTFT + TPOT + p99 gap" if with_gap else "TTFT + TPOT"
    lines = [
        f"| within {slo}: requests (95 % interval) | "
        + " | ".join(f"{rate:g} req/s" for rate in rates)
        + " |",
        "|---" * (len(rates) + 1) + "|",
    ]
    for mode, result in rows.items():
        view = result.get("with_itl_slo") if with_gap else result
        cells = [_attained(at_rate(view, rate) if view else None) for rate in rates]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_best_tuned(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rows = dict(results)
    for family, setting in TUNED_BY.items():
        best = best_tuned(results, family)
        if best and f"{family}@" in "".join(results):
            rows[f"{family} (best {setting} per rate)"] = best
    return rows


def _attained(summary: dict[str, Any] | None) -> str:
    if not summary or "num_met" not in summary:
        return "-"
    low, high = summary["slo_attainment_95ci"]
    return f"{summary['num_met']}/{summary['num_requests']} ({low:.0%}-{high:.0%})"


def phases_table(results: dict[str, dict[str, Any]], rate: float) -> str:
    """Per mode at ``rate`` (serving_phases.phase_means), per role of the engine that computed
    the prompts: how many, their mean queueing and compute (ms); on the prefill row, the KV
    hand-offs and their mean transfer (after the first token: it delays the second)."""
    lines = [
        f"| prompts @ {rate:g} req/s, by the engine computing them | prompts | mean queue (ms) | "
        "mean compute (ms) | KV hand-offs | mean transfer (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, result in results.items():
        phases = (run_at(result, rate) or {}).get("phases") or {}
        transfer = phases.get("transfer")
        for role in ROLES:
            if role not in phases:
                continue
            p = phases[role]
            handoffs = "| - | - |"
            if role == "prefill" and transfer:
                handoffs = f"| {transfer['handoffs']} | {_ms(transfer['seconds'])} |"
            lines.append(
                f"| {mode}: {role} | {p['prompts']} | {_ms(p['queue_s'])} | "
                f"{_ms(p['prefill_s'])} {handoffs}"
            )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def ratios(results: dict[str, dict[str, Any]], common_rate: float) -> dict[str, Any]:
    """The goals: adaptive PD against the best-tuned single_node (goodput at every rate, the
    highest rate within the SLO with the gap), the fixed PD likewise, and pdserve's best mode
    against llama-server."""
    single = best_tuned(results, SINGLE)
    out: dict[str, Any] = {}
    if single is None:
        return out
    rates = [run["request_rate"] for run in single["runs"]]
    out["single_node_budget_by_rate"] = {run["request_rate"]: run["mode"] for run in single["runs"]}
    adaptive = best_tuned(results, ADAPTIVE)
    for mode, ours in ((ADAPTIVE, adaptive), ("pd_separate", results.get("pd_separate"))):
        if ours is None:
            continue
        goodput = {}
        for rate in rates:
            a, s = at_rate(ours, rate), at_rate(single, rate)
            goodput[rate] = _ratio(a and a["goodput"], s and s["goodput"])
        out[f"goodput_{mode}_over_single_by_rate"] = goodput
        out[f"max_rate_{mode}_over_single"] = _ratio(
            ours["max_rate_within_slo"], single["max_rate_within_slo"]
        )
        out[f"max_rate_with_gap_{mode}_over_single"] = _ratio(
            ours["with_itl_slo"]["max_rate_within_slo"],
            single["with_itl_slo"]["max_rate_within_slo"],
        )
    peer = best_tuned(results, PEER)
    if peer is not None:
        out |= _against_peer(results, peer, common_rate)
    return out


def _against_peer(
    results: dict[str, dict[str, Any]], peer: dict[str, Any], common_rate: float
) -> dict[str, Any]:
    """pdserve's best mode against the best-tuned llama-server: the highest rates, the
    settings chosen, the goodput at the common rate and the closed-loop ratios."""
    out: dict[str, Any] = {}
    ours = {m: r for m, r in results.items() if m.partition("@")[0] != PEER}
    views = ((None, "max_rate"), ("with_itl_slo", "max_rate_with_gap"))
    for view, key in views:
        for rule, suffix in (("max_rate_own", ""), ("max_rate_within_slo", "_monotone")):
            maxima = [(r[view] if view else r).get(rule) for r in ours.values()]
            best = max((m for m in maxima if m is not None), default=None)
            theirs = (peer[view] if view else peer).get(rule)
            out[f"{key}{suffix}_pdserve_best_over_llama_server"] = _ratio(best, theirs)
    out["llama_server_setting_by_rate"] = {run["request_rate"]: run["mode"] for run in peer["runs"]}
    out["goodput_at_common_rate_by_mode"] = {
        m: (at_rate(r, common_rate) or {}).get("goodput") for m, r in results.items()
    }
    out["closed_loop_pdserve_best_over_llama_server"] = _loop_ratios(ours, peer)
    return out


def _loop_ratios(ours: dict[str, dict[str, Any]], peer: dict[str, Any]) -> dict[str, Any]:
    """Per concurrency, a ratio per draw (the sides served it in one rotation, so a draw is a
    paired round): pdserve's best mode's output tokens/s over the best peer setting's on that
    draw, with the interval over draws; a draw where either side failed a request is left out
    (and the table says so)."""
    counts = {n for d in peer.get("closed_loop_by_draw") or [] for n in d}
    out: dict[str, Any] = {}
    for n in sorted(counts, key=int):
        rounds = []
        for index, theirs in enumerate(peer.get("closed_loop_by_draw") or []):
            mine = [
                _clean_rate((o.get("closed_loop_by_draw") or [])[index:], n) for o in ours.values()
            ]
            best, peer_rate = max((r for r in mine if r), default=None), _clean_rate([theirs], n)
            if best and peer_rate:
                rounds.append(best / peer_rate)
        out[n] = spread(rounds) if rounds else None
    return out


def _clean_rate(draws: list[dict[str, Any]], n: str) -> float | None:
    """The first draw's tokens/s at ``n`` streams, None when absent or a request failed."""
    figures = draws[0].get(n) if draws else None
    if not figures or figures.get("num_failed"):
        return None
    return figures["output_token_throughput"]


def render(results: dict[str, dict[str, Any]], common_rate: float) -> str:
    """Every table compare_modes prints, from its pooled results."""
    spread = [attainment_table(results, with_gap) for with_gap in (False, True)]
    tables = [table(results, common_rate), *spread, phases_table(results, common_rate)]
    return "\n\n".join(t for t in [*tables, closed_loop_table(results)] if t)
