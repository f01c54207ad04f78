"""A result file: provenance taken at the start, nothing written under benchmarks/results/ from
a tree with changes, ``--scratch`` writing elsewhere, the command recorded as ``python -m``."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys

import pytest

from benchmarks.harness import provenance, results


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    results.add_output_arguments(parser, "trial")
    return parser.parse_args(list(argv))


@pytest.fixture
def dirty(monkeypatch):
    monkeypatch.setattr(results, "uncommitted", lambda: ["engine/x.py"])
    monkeypatch.setattr(provenance, "uncommitted", lambda: ["engine/x.py"])


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(results, "uncommitted", lambda: [])
    monkeypatch.setattr(provenance, "uncommitted", lambda: [])


def test_a_dirty_tree_is_refused_at_the_start(dirty, tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    with pytest.raises(results.DirtyTree, match="engine/x.py.*--scratch"):
        results.ResultFile.start(_args())


def test_scratch_writes_elsewhere_whatever_the_tree(dirty, tmp_path, monkeypatch):
    monkeypatch.setattr(results, "SCRATCH", tmp_path)
    result = results.ResultFile.start(_args("--scratch"), argv=["benchmarks/x.py", "--scratch"])
    assert result.path == tmp_path / "trial.json"
    written = json.loads(result.write({"measure": 1.0}).read_text())
    assert written["measure"] == 1.0 and written["_meta"]["complete"] is True
    assert written["_meta"]["commit"].endswith("-dirty")
    with pytest.raises(SystemExit, match="outside"):
        results.ResultFile.start(_args("--scratch", "--out", str(results.RESULTS / "x.json")))


def test_a_clean_tree_writes_its_commit_and_a_commit_mid_run_is_refused(
    clean, tmp_path, monkeypatch
):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    result = results.ResultFile.start(_args())
    assert result.path == tmp_path / "trial.json"
    assert not result.meta["commit"].endswith("-dirty")
    result.write({"a": 1}, complete=False)
    result.write({"a": 1})
    monkeypatch.setattr(results, "head", lambda: "0123456789ab")
    with pytest.raises(results.DirtyTree, match="commit moved"):
        result.write({"a": 2})


def test_the_command_is_recorded_as_a_module():
    script = str(provenance.ROOT / "benchmarks" / "llamacpp" / "vs_llamacpp.py")
    line = provenance.command_line([script, "--gguf", "bundled"])
    assert line == "python -m benchmarks.llamacpp.vs_llamacpp --gguf bundled"


def test_the_result_file_itself_does_not_make_the_tree_dirty(monkeypatch):
    own = results.RESULTS / "trial.json"
    monkeypatch.setattr(results, "uncommitted", lambda: ["benchmarks/results/trial.json"])
    results.check_clean(own)  # the run's own partial writes
    monkeypatch.setattr(results, "uncommitted", lambda: ["benchmarks/results/trial.json", "x.py"])
    with pytest.raises(results.DirtyTree, match="x.py"):
        results.check_clean(own)


def test_porcelain_paths_keep_their_first_letter():
    status = " M benchmarks/results/x.json\n?? new.py\nR  old.py -> moved.py\n"
    assert provenance.porcelain_paths(status) == ["benchmarks/results/x.json", "new.py", "moved.py"]


SIGTERMED_RUN = """
import sys, time
from pathlib import Path
from benchmarks.harness.results import exit_on_sigterm
exit_on_sigterm()
try:
    print("started", flush=True)
    time.sleep(60)
finally:
    Path(sys.argv[1]).write_text("servers stopped")
"""


def test_a_run_ended_by_sigterm_goes_through_its_finally_blocks(tmp_path):
    marker = tmp_path / "stopped"
    run = subprocess.Popen(
        [sys.executable, "-c", SIGTERMED_RUN, str(marker)],
        cwd=provenance.ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert run.stdout is not None and run.stdout.readline() == "started\n"
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "servers stopped"
