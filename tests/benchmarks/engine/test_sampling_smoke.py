"""``python -m benchmarks.engine.sampling`` at toy size (two rows of logits, two kept rounds): the
code path of a real run (paired rounds, spreads, the result file) in seconds."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.engine.sampling import SETTINGS
from benchmarks.harness.provenance import ROOT


def test_sampling_toy_run(tmp_path):
    out = tmp_path / "sampling.json"
    command = [sys.executable, "-m", "benchmarks.engine.sampling", "--out", str(out)]
    command += ["--rows", "2", "--rounds", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["_meta"]["rounds"] == 2
    assert set(result) == {"_meta", *SETTINGS}
    for name in SETTINGS:
        for key in ("pdserve_us", "reference_us", "speedup"):
            figures = result[name][key]
            assert len(figures["rounds"]) == 2 and all(v > 0 for v in figures["rounds"]), name
            assert figures["low"] <= figures["median"] <= figures["high"], (name, key)
