"""How the serving benchmarks' smoke tests run one: ``python -m benchmarks.serving.NAME`` in a
child process (a benchmark may pin its process to a core or start Ray of its own), writing to a
file of the test's, and the result file it wrote, checked to be complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness.provenance import ROOT


def run_benchmark(name: str, out: Path, *argv: str, timeout_s: float = 240) -> dict[str, Any]:
    command = [sys.executable, "-m", f"benchmarks.serving.{name}", "--out", str(out), *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env
    )
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-6000:])
    result = json.loads(out.read_text())
    meta = result["_meta"]
    assert meta["complete"] and meta["commit"] and f"benchmarks.serving.{name}" in meta["command"]
    return result
