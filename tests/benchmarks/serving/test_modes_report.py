"""compare_modes' report on made-up sweeps: the best-tuned single_node takes the best budget at
each rate, the gap SLO is judged from the requests, and the goals' ratios follow."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.harness.record import RequestRecord
from benchmarks.llamacpp.server import ServerSetting, sweep_settings
from benchmarks.serving.compare_modes import (
    draw_set_of,
    expand_modes,
    llama_server_setting,
    settings,
)
from benchmarks.serving.draws import HELD_OUT_SEEDS, TUNING_SEEDS, draw_seeds, pool_draws, rotated
from benchmarks.serving.metrics import (
    SLO,
    highest_rate_holding,
    max_rate_within_slo,
    record_from_dict,
    rescore,
    summarize,
    wilson_interval,
)
from benchmarks.serving.modes_report import (
    attainment_table,
    best_tuned,
    closed_loop_table,
    ratios,
    table,
)


def _request(ttft: float, gap: float, tokens: int = 5) -> dict:
    record = RequestRecord(10, tokens, ttft_s=ttft, output_tokens=tokens)
    record.gaps_s = [gap] * (tokens - 1)
    record.e2e_s = ttft + gap * (tokens - 1)
    return record.to_dict()


def _result(rates_to_requests: dict[float, list[dict]]) -> dict:
    slo, runs = SLO(), []
    for rate, requests in rates_to_requests.items():
        summary = summarize([record_from_dict(r) for r in requests], 10.0, slo)
        runs.append({"request_rate": rate, "summary": summary, "requests": requests})
    result = {"runs": runs, "max_rate_within_slo": max_rate_within_slo(runs)}
    result["max_rate_own"] = highest_rate_holding(runs)
    result["with_itl_slo"] = rescore(runs, SLO(itl_s=0.25))
    result["with_itl_slo"]["max_rate_own"] = highest_rate_holding(result["with_itl_slo"]["runs"])
    return result


GOOD, SLOW_START, JERKY = _request(1.0, 0.05), _request(5.0, 0.05), _request(1.0, 0.05, tokens=20)
JERKY["gaps_s"][0] = 0.9  # one long gap: fine on average, not at p99
JERKY["e2e_s"] = 1.0 + sum(JERKY["gaps_s"])


def test_the_gap_slo_is_judged_from_each_requests_gaps():
    result = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 5 + [JERKY] * 5})
    assert result["max_rate_within_slo"] == 1.0  # TTFT and TPOT only: all met
    view = result["with_itl_slo"]
    assert [run["summary"]["slo_attainment"] for run in view["runs"]] == [1.0, 0.5]
    assert view["max_rate_within_slo"] == 0.5


def test_the_best_single_node_takes_the_best_budget_at_each_rate():
    small = _result({0.5: [GOOD] * 10, 1.0: [SLOW_START] * 10})
    large = _result({0.5: [GOOD] * 9 + [SLOW_START], 1.0: [GOOD] * 10})
    results = {"single_node@256": small, "single_node@8192": large, "pd": small}
    best = best_tuned(results, "single_node")
    assert [run["mode"] for run in best["runs"]] == ["single_node@256", "single_node@8192"]
    assert [run["summary"]["goodput"] for run in best["runs"]] == [1.0, 1.0]
    assert best["max_rate_within_slo"] == 1.0  # the best any budget reached


def test_ratios_against_the_best_single_node_and_the_peer():
    single = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 5 + [SLOW_START] * 5})
    adaptive = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 10})
    peer = _result({0.5: [GOOD] * 5 + [SLOW_START] * 5, 1.0: [SLOW_START] * 10})
    results = {"pd_adaptive": adaptive, "single_node@512": single, "llama_server": peer}
    out = ratios(results, 1.0)
    assert out["goodput_pd_adaptive_over_single_by_rate"] == {0.5: 1.0, 1.0: 2.0}
    assert out["max_rate_pd_adaptive_over_single"] == 2.0
    assert out["max_rate_with_gap_pd_adaptive_over_single"] == 2.0
    assert out["max_rate_pdserve_best_over_llama_server"] is None  # the peer never made 90 %
    text = table(results, 1.0)
    assert "| single_node (best budget per rate) | 0.5 | 0.5 | 0.5 |" in text
    assert "| pd_adaptive | 1 | 1 | 1 |" in text


def test_the_spread_table_counts_each_rates_requests_with_their_95_percent_interval():
    single = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 9 + [SLOW_START]})
    jerky = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 5 + [JERKY] * 5})
    results = {"single_node@512": single, "pd_adaptive": jerky}
    plain, gap = attainment_table(results), attainment_table(results, with_gap=True)
    assert plain.splitlines()[0].endswith("| 0.5 req/s | 1 req/s |")
    assert "| single_node@512 | 10/10 (72%-100%) | 9/10 (60%-98%) |" in plain
    assert "| pd_adaptive | 10/10 (72%-100%) | 10/10 (72%-100%) |" in plain
    assert "| pd_adaptive | 10/10 (72%-100%) | 5/10 (24%-76%) |" in gap  # the jerky ones
    assert "| single_node (best budget per rate) | 10/10 (72%-100%) | 9/10 (60%-98%) |" in gap


def test_the_wilson_interval_narrows_with_the_sample_and_stays_within_0_and_1():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(27, 30) == pytest.approx((0.7438, 0.9654), abs=1e-4)
    low_30, high_30 = wilson_interval(27, 30)
    low_60, high_60 = wilson_interval(54, 60)  # the same share, twice the requests
    assert low_30 < low_60 < 0.9 < high_60 < high_30
    assert wilson_interval(0, 0) == (0.0, 1.0)


def _args(**overrides) -> argparse.Namespace:
    base = {
        "modes": "pd_separate,single_node",
        "single_node_budgets": "256,1024",
        "peer": None,
        "llama_server_settings": "",
    }
    return argparse.Namespace(**(base | overrides))


def test_tuned_modes_expand_into_their_settings_and_the_peer_comes_last():
    assert expand_modes(_args()) == ["pd_separate", "single_node@256", "single_node@1024"]
    assert expand_modes(_args(single_node_budgets="", peer="llamacpp")) == [
        "pd_separate",
        "single_node",
        "llama_server",
    ]
    budget = {"stepTargetMs": 0, "maxPrefillTokens": 256}
    assert settings("single_node@256") == ("single_node", budget)
    assert expand_modes(_args(modes="pd_adaptive")) == ["pd_adaptive"]
    deploy_mode, keys = settings("pd_adaptive")
    assert deploy_mode == "pd_separate" and keys["local_prefill_tokens"] == 96
    assert settings("pd_separate")[1]["local_prefill_tokens"] == 0  # fixed, whatever the defaults
    with pytest.raises(ValueError, match="unknown mode"):
        expand_modes(_args(modes="pd_separate@5"))
    for unknown in (
        "single_node@256:40",
        "single_node@x",
        "pd_adaptive@3000",
    ):
        with pytest.raises(ValueError, match="unknown mode"):
            settings(unknown)


def test_a_rate_held_on_its_own_counts_beside_the_monotone_figure():
    # the draw at 0.5 req/s happened to hold many long prompts; 1.0 req/s held 90 %
    result = _result({0.5: [GOOD] * 8 + [SLOW_START] * 2, 1.0: [GOOD] * 10})
    assert result["max_rate_within_slo"] is None  # monotone: the lowest rate failed
    assert result["max_rate_own"] == 1.0
    assert "| x | 1 | none | 1 |" in table({"x": result}, 1.0)


def test_draws_are_pooled_per_rate_with_each_draws_count_kept():
    first = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 9 + [SLOW_START]})
    second = _result({0.5: [GOOD] * 10, 1.0: [GOOD] * 7 + [SLOW_START] * 3})
    pooled = pool_draws([first, second], SLO(), SLO(itl_s=0.25))
    at_one = pooled["runs"][1]["summary"]
    assert (at_one["num_met"], at_one["num_requests"], at_one["met_per_draw"]) == (16, 20, [9, 7])
    assert at_one["slo_attainment_95ci"] == pytest.approx(list(wilson_interval(16, 20)))
    assert at_one["goodput"] == pytest.approx(16 / 20.0)  # over both draws' run time
    assert pooled["max_rate_own"] == 0.5 and pooled["draws"] == 2
    assert all("requests" not in run for run in pooled["runs"])  # the result stays small
    assert "| x | 20/20 (84%-100%) | 16/20 (58%-92%) |" in attainment_table({"x": pooled})


def test_held_out_seeds_are_never_tuning_seeds_and_the_order_rotates_per_draw():
    assert not set(TUNING_SEEDS) & set(HELD_OUT_SEEDS)
    assert draw_seeds("held-out", 3) == list(HELD_OUT_SEEDS[:3])
    assert 0 in TUNING_SEEDS  # every earlier run's seed
    with pytest.raises(ValueError, match="--draws"):
        draw_seeds("held-out", 0)
    modes = ["a", "b", "c"]
    assert [rotated(modes, d)[0] for d in range(3)] == ["a", "b", "c"]
    assert draw_set_of(list(HELD_OUT_SEEDS[:2])) == "held-out"
    assert draw_set_of([1001, 1002]) == "tuning"  # used to choose a shipping configuration
    assert draw_set_of([0, HELD_OUT_SEEDS[0]]) == "custom"


def test_llama_server_is_swept_over_slots_batches_and_threads():
    sweep = sweep_settings("4,8,16", "512/128,2048/512", "2,1")
    assert len(sweep) == 12 and "16:512:128:1" in sweep
    assert ServerSetting.parse("16:512:128:1") == ServerSetting(16, 512, 128, 1)
    assert ServerSetting.parse("") == ServerSetting()  # 8 slots, -b 2048, -ub 512, 2 threads
    assert ServerSetting(threads=2).cpus() is None  # the two threads are not pinned
    with pytest.raises(ValueError, match="SLOTS"):
        ServerSetting.parse("8:0")
    modes = expand_modes(_args(peer="llamacpp", llama_server_settings="4:512:128:2,8"))
    assert modes[-2:] == ["llama_server@4:512:128:2", "llama_server@8"]
    assert llama_server_setting("llama_server@8").slots == 8


def _loops(*rates: float) -> list[dict]:
    figures = {"ttft_s": {"p50": 0.1, "p99": 0.2}, "tpot_s": {"p50": 0.02, "p99": 0.03}}
    return [{"8": {"output_token_throughput": r, "num_failed": 0, **figures}} for r in rates]


def test_the_closed_loop_is_reported_per_draw_and_against_the_best_tuned_peer():
    ours = _result({0.5: [GOOD] * 10}) | {"closed_loop_by_draw": _loops(300, 320, 310)}
    slow = _result({0.5: [GOOD] * 10}) | {"closed_loop_by_draw": _loops(100, 110, 90)}
    fast = _result({0.5: [GOOD] * 10}) | {"closed_loop_by_draw": _loops(150, 140, 160)}
    results = {"single_node": ours, "llama_server@4": slow, "llama_server@16": fast}
    text = closed_loop_table(results)
    assert "| single_node | 310.0 [300.0-320.0]; 0.10/0.20; 20/30 |" in text
    assert "| llama_server (best setting per rate) | 150.0 [140.0-160.0];" in text
    out = ratios(results, 0.5)
    # a ratio per draw (a paired round) over the best clean setting: 300/150, 320/140, 310/160
    per_draw = out["closed_loop_pdserve_best_over_llama_server"]["8"]
    assert per_draw["rounds"] == pytest.approx([2.0, 320 / 140, 1.9375], abs=1e-3)
    results["llama_server@16"]["closed_loop_by_draw"][1]["8"]["num_failed"] = 1
    per_draw = ratios(results, 0.5)["closed_loop_pdserve_best_over_llama_server"]["8"]
    assert per_draw["rounds"] == pytest.approx([2.0, 320 / 110, 1.9375], abs=1e-3)  # @4 is clean


def test_a_closed_loop_draw_with_failures_is_counted_not_dropped():
    loops = _loops(300, 320, 310)
    loops[1]["8"] |= {"num_failed": 2, "num_requests": 16}
    loops[0]["8"]["num_requests"] = loops[2]["8"]["num_requests"] = 16
    ours = _result({0.5: [GOOD] * 10}) | {"closed_loop_by_draw": loops}
    text = closed_loop_table({"single_node": ours})
    assert (
        "| single_node | 305.0 [300.0-310.0]; 0.10/0.20; 20/30; 2 of 48 requests failed |" in text
    )
    for draw in loops:
        draw["8"]["num_failed"] = 1
    assert "all draws failed; 3 of 48 requests failed" in closed_loop_table({"single_node": ours})
