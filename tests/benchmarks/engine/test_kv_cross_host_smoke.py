"""``python -m benchmarks.engine.kv_cross_host`` at toy size (the tiny model, blocks of 4 tokens,
two rounds) on a real two-host bed (network namespaces; root): the code path of a real run in
seconds. Where namespaces cannot be made it skips locally and fails in CI, as the multi-host
tests do (``tests/support/prerequisites.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.engine.kv_cross_host import CROSS_HOST, RATIOS, SAME_HOST
from benchmarks.harness.provenance import ROOT
from testbed.netns import available
from tests.benchmarks.engine.kv_toy import SIZES, assert_measured, toy_argv
from tests.support.prerequisites import require

pytestmark = pytest.mark.multihost


def test_kv_cross_host_toy_run_measures_every_plane(tiny_model_dir, tmp_path):
    why = available()
    require(why is None, f"a multi-host test bed ({why})")
    out = tmp_path / "x.json"
    command = [sys.executable, "-m", "benchmarks.engine.kv_cross_host"]
    command += toy_argv(tiny_model_dir, out)
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["shape"] == "none"
    for name in (*SAME_HOST, *CROSS_HOST):
        assert set(result[name]) == set(SIZES), name
        for size in SIZES:
            assert_measured(result[name][size], f"{name} at {size}")
    for size in SIZES:
        ratios = result["ratios"][size]
        assert set(ratios) == {f"{a}/{b}" for a, b in RATIOS.items()}
        assert all(r is not None and r["median"] > 0 for r in ratios.values()), ratios
