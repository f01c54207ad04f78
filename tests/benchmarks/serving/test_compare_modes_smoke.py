"""A short run of benchmarks/serving/compare_modes.py: pdserve started in the adaptive PD mode
(local prefill of short prompts, stepTargetMs) on the tiny model,
every request served, the report and plots written."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import compare_modes

pytestmark = pytest.mark.ray


def _run_the_sweep(out, tiny_model_dir) -> dict:
    """Run compare_modes on the adaptive mode, two draws and the closed loop; its JSON report."""
    args = ["--model", str(tiny_model_dir), "--modes", "pd_adaptive", "--single-node-budgets", ""]
    args += ["--draw-set", "tuning", "--draws", "2"]
    args += ["--request-rates", "4,inf", "--num-requests", "3", "--mix", "chat=1"]
    args += ["--closed-loop", "2", "--plots"]
    assert compare_modes.main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _assert_the_report_header(report: dict) -> None:
    """The draw set, seeds, machine, commit and offered load the report records."""
    assert report["draw_set"] == "tuning" and report["seeds"] == [0, 1]
    assert report["cpu"] and report["commit"] and "compare_modes" in report["command"]
    assert report["_meta"]["complete"] and report["_meta"]["commit"] == report["commit"]
    assert "failed_requests" not in report
    # every rate of a draw offered the same shapes: 3 chat requests of 64 + 64 tokens
    assert report["offered_load"]["0"] == {
        "4": {"prompt_tokens_per_s": 4 * 64.0, "output_tokens_per_s": 4 * 64.0},
        "inf": {"prompt_tokens_per_s": None, "output_tokens_per_s": None},
    }


def _assert_every_rate_served_every_request(result: dict) -> None:
    """Each rate's run served all 6 requests, each prompt timed by the engine computing it."""
    assert [run["request_rate"] for run in result["runs"]] == [4.0, float("inf")]
    assert result["given"]["backend_config"]["local_prefill_tokens"] == 96
    for run in result["runs"]:
        summary = run["summary"]
        assert summary["num_failed"] == 0 and summary["num_requests"] == 6  # 3 per draw
        assert summary["met_per_draw"] == [3, 3] and "requests" not in run
        assert summary["total_output_tokens"] == 6 * 64
        # every prompt of the rate timed by the engine that computed it, none of the warm-up's
        roles = {role: p for role, p in run["phases"].items() if role != "transfer"}
        assert sum(p["prompts"] for p in roles.values()) == 6 and set(roles) <= {
            "prefill",
            "decode",
        }


def _assert_the_workloads_and_closed_loop(result: dict) -> None:
    """The two draws' workloads, the ITL-SLO runs and the closed loop of each draw."""
    assert result["max_rate_own"] == float("inf")
    workloads = result["workload"]
    assert [w["seed"] for w in workloads] == [0, 1]
    assert all(
        w["same_shapes_every_rate"] and w["shapes"] == [["chat", 64, 64]] * 3 for w in workloads
    )
    assert len(result["with_itl_slo"]["runs"]) == 2
    loops = result["closed_loop_by_draw"]
    assert len(loops) == 2 and all(d["2"]["num_failed"] == 0 for d in loops)
    assert all(d["2"]["num_requests"] == 4 and d["2"]["output_token_throughput"] > 0 for d in loops)


def _assert_the_markdown_and_plots(out) -> None:
    """The Markdown report's spread, phase and closed-loop rows, and the goodput plot."""
    markdown = out.with_suffix(".md").read_text()
    assert "| pd_adaptive | 6/6 (61%-100%) | 6/6 (61%-100%) |" in markdown  # the spread
    assert "| prompts @ 1 req/s, by the engine computing them |" in markdown
    assert "| closed loop | N = 2: tok/s;" in markdown
    assert out.with_suffix(".goodput.png").stat().st_size > 0


def test_the_adaptive_mode_serves_the_sweep_on_two_draws_and_the_closed_loop(
    tmp_path, tiny_model_dir
):
    out = tmp_path / "modes.json"
    report = _run_the_sweep(out, tiny_model_dir)
    _assert_the_report_header(report)
    result = report["results"]["pd_adaptive"]
    _assert_every_rate_served_every_request(result)
    _assert_the_workloads_and_closed_loop(result)
    _assert_the_markdown_and_plots(out)
