"""The serving benchmark's arithmetic on synthetic timings: percentiles, TPOT, SLO attainment,
goodput, the sweep's max rate, arrival schedules and workloads."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from benchmarks.harness.load import run_load
from benchmarks.harness.record import RequestRecord
from benchmarks.serving.metrics import (
    SLO,
    attainment,
    max_rate_within_slo,
    percentile,
    summarize,
)
from benchmarks.serving.workload import (
    WorkItem,
    load_dataset,
    parse_mix,
    synthetic,
    write_dataset,
)


def record(ttft, e2e, tokens, error=None) -> RequestRecord:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestRecord(10, tokens, 0.0, ttft, e2e, tokens, gaps, error)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [random.Random(q).uniform(0, 10) for _ in range(37)]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 2.0], 50) == 1.5


def test_tpot_is_the_mean_gap_after_the_first_token():
    r = record(ttft=0.5, e2e=2.5, tokens=5)
    assert r.tpot_s == pytest.approx(0.5)
    assert record(0.5, 0.5, 1).tpot_s is None  # one token: no TPOT
    assert record(0.5, 2.5, 5, error="boom").tpot_s is None


def test_slo_needs_both_targets_and_success():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    good = record(0.9, 0.9 + 0.09 * 9, 10)
    slow_first = record(1.1, 1.1 + 0.05 * 9, 10)
    slow_tokens = record(0.2, 0.2 + 0.2 * 9, 10)
    one_token = record(0.3, 0.3, 1)
    failed = record(0.1, 0.2, 2, error="HTTP 500")
    records = [good, slow_first, slow_tokens, one_token, failed]
    assert [r.meets(slo.ttft_s, slo.tpot_s) for r in records] == [True, False, False, True, False]
    assert attainment(records, slo) == pytest.approx(2 / 5)


def test_an_inter_token_slo_judges_each_requests_p99_gap():
    smooth = record(0.5, 0.5 + 0.1 * 9, 10)  # gaps of 100 ms
    stalled = record(0.5, 0.5 + 0.1 * 9, 10)
    stalled.gaps_s = [0.05] * 8 + [0.5]  # the same TPOT, one 500 ms stall
    one_token = record(0.3, 0.3, 1)
    with_itl, without = SLO(1.0, 0.15, itl_s=0.25), SLO(1.0, 0.15)
    assert [r.meets(1.0, 0.15, 0.25) for r in (smooth, stalled, one_token)] == [True, False, True]
    assert attainment([smooth, stalled], with_itl) == pytest.approx(0.5)
    assert attainment([smooth, stalled], without) == pytest.approx(1.0)
    assert "p99 inter-token gap <= 250 ms" in with_itl.describe()
    assert "gap" not in without.describe()


def test_summary_throughput_and_goodput():
    slo = SLO(1.0, 0.1)
    records = [record(0.5, 1.4, 10), record(0.5, 1.4, 10), record(2.0, 3.0, 11), record(0, 0, 1)]
    records[-1].error, records[-1].ttft_s = "HTTP 429", None
    s = summarize(records, duration_s=4.0, slo=slo)
    assert (s["num_succeeded"], s["num_failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["total_output_tokens"] == 31
    assert s["output_token_throughput"] == pytest.approx(31 / 4)
    assert s["goodput"] == pytest.approx(2 / 4)
    assert s["slo_attainment"] == pytest.approx(2 / 4)
    assert (s["num_met"], s["num_requests"]) == (2, 4)
    low, high = s["slo_attainment_95ci"]
    assert low < 0.5 < high
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["tpot_s"]["p99"] == pytest.approx(np.percentile([0.1, 0.1, 0.1], 99))


def test_max_rate_stops_at_the_first_failing_rate():
    def run(rate, share):
        return {"request_rate": rate, "summary": {"slo_attainment": share}}

    assert max_rate_within_slo([run(2, 0.95), run(1, 1.0), run(3, 0.5), run(4, 0.95)]) == 2
    assert max_rate_within_slo([run(1, 0.8), run(2, 0.95)]) is None
    assert max_rate_within_slo([run(1, 0.9)]) == 1


def test_fixed_rate_arrivals_and_concurrency_limit():
    in_flight, peak = 0, 0

    async def send_one(item):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return RequestRecord(1, 1, ttft_s=0.01, e2e_s=0.05, output_tokens=1)

    items = [WorkItem("x", 1)] * 6
    records, duration = asyncio.run(run_load(items, send_one, 20.0, None, poisson=False))
    assert [round(r.sent_at, 2) for r in records] == pytest.approx(
        [0.0, 0.05, 0.1, 0.15, 0.2, 0.25], abs=0.02
    )
    assert duration == pytest.approx(0.3, abs=0.05)
    start = time.perf_counter()
    asyncio.run(run_load(items, send_one, None, 2))
    assert peak == 2 and time.perf_counter() - start >= 0.15


def test_poisson_arrivals_have_the_asked_rate():
    async def send_one(item):
        return RequestRecord(1, 1)

    items = [WorkItem("x", 1)] * 400

    async def schedule():
        # the schedule alone: run_load sleeps until each arrival, so measure sent_at offsets
        records, _ = await run_load(items, send_one, 2000.0, None, poisson=True, seed=3)
        return records

    records = asyncio.run(schedule())
    gaps = np.diff([r.sent_at for r in records])
    assert np.mean(gaps) == pytest.approx(1 / 2000, rel=0.35)


def test_synthetic_mix_and_dataset_round_trip(tmp_path, tiny_loaded):
    encode = lambda text: tiny_loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    items = synthetic(50, parse_mix("chat=0.5,summarise=0.5"), encode, seed=1)
    kinds = {i.kind for i in items}
    assert kinds == {"chat", "summarise"}
    for item in items:
        assert item.prompt_tokens == len(encode(item.prompt))
        assert item.prompt_tokens <= (1000 if item.kind == "summarise" else 64)
        assert item.prompt_tokens >= (900 if item.kind == "summarise" else 50)
    path = tmp_path / "mix.jsonl"
    write_dataset(items, path)
    assert load_dataset(path) == items
    with pytest.raises(ValueError, match="kind=weight"):
        parse_mix("poetry=1")
