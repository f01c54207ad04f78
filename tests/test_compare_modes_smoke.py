"""A short run of benchmarks/compare_modes.py: pdserve started in the adaptive PD mode (local
prefill of short prompts, stepTargetMs, shared idle cores, decode yields) on the tiny model,
every request served, the report and plots written."""

from __future__ import annotations

import json

import pytest

from benchmarks import compare_modes

pytestmark = pytest.mark.ray


def test_the_adaptive_mode_serves_the_sweep(tmp_path, tiny_model_dir):
    out = tmp_path / "modes.json"
    args = ["--model", str(tiny_model_dir), "--modes", "pd_adaptive", "--single-node-budgets", ""]
    args += ["--adaptive-yields", "3000"]
    args += ["--request-rates", "4,inf", "--num-requests", "3", "--mix", "chat=1"]
    assert compare_modes.main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    result = report["results"]["pd_adaptive@3000"]
    assert [run["request_rate"] for run in result["runs"]] == [4.0, float("inf")]
    for run in result["runs"]:
        assert run["summary"]["num_failed"] == 0 and run["summary"]["num_requests"] == 3
        assert all(r["output_tokens"] == 64 for r in run["requests"])
        # every prompt of the rate timed by the engine that computed it, none of the warm-up's
        roles = {role: p for role, p in run["phases"].items() if role != "transfer"}
        assert sum(p["prompts"] for p in roles.values()) == 3 and set(roles) <= {
            "prefill",
            "decode",
        }
    prompts = [r["prompt_tokens"] for run in result["runs"] for r in run["requests"]]
    assert len(prompts) == 6 and all(0 < p <= 64 for p in prompts)
    assert len(result["with_itl_slo"]["runs"]) == 2
    markdown = out.with_suffix(".md").read_text()
    assert "| pd_adaptive@3000 |" in markdown
    assert "| pd_adaptive@3000 | 3/3 (44%-100%) | 3/3 (44%-100%) |" in markdown  # the spread
    assert "| prompts @ 1 req/s, by the engine computing them |" in markdown
    assert out.with_suffix(".goodput.png").stat().st_size > 0
