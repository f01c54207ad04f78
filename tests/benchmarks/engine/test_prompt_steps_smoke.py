"""``python -m benchmarks.engine.prompt_steps`` at toy size (the tiny model, four short prompts,
two kept rounds): the code path of a real run (paired rounds, ratios, verdicts, the result file)
in seconds."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.engine.prompt_steps import SIDES
from benchmarks.harness.provenance import ROOT
from benchmarks.report import render_prompt_steps
from engine.config import SchedulerConfig


def test_prompt_steps_toy_run(tmp_path, tiny_model_dir):
    out = tmp_path / "prompt_steps.json"
    command = [sys.executable, "-m", "benchmarks.engine.prompt_steps", "--out", str(out)]
    command += ["--model", str(tiny_model_dir), "--prompts", "4", "--prompt-tokens", "8"]
    command += ["--rounds", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["_meta"]["prompts"] == 4
    for side in SIDES:
        for figure in ("ttft_p50_s", "burst_s"):
            rounds = result["sides"][side][figure]["rounds"]
            assert len(rounds) == 2 and all(v > 0 for v in rounds), (side, figure)
    for figure in ("ttft_p50_s", "burst_s"):
        ratio = result["ratios"][figure]
        assert len(ratio["rounds"]) == 2 and ratio["verdict"] == "undecided"  # 2 rounds kept
    assert (
        result["sides"]["bounded"]["ttft_p50_s"]["median"]
        <= (result["sides"]["bounded"]["burst_s"]["median"])
    )
    text = render_prompt_steps(result)
    assert "| TTFT p50 |" in text and "| the burst's last first token |" in text
    assert f"`prompt_step_target_ms` {SchedulerConfig.prompt_step_target_ms}" in text
    assert "undecided" in text
