"""What every result file under ``benchmarks/results/`` records about the run that wrote it: the
CPU (model, the ISA flags cpuid lists, the extensions it really executes), the commit, the date and
the command, so a figure is compared only with figures of the same machine and code."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.cpu_isa import cpu_model, cpuid_flags, probe_isa

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The checked-out commit, with ``-dirty`` when tracked files differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_meta(argv: list[str] | None = None) -> dict:
    """The machine, code and command of this run."""
    import torch

    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return {
        "cpu": cpu_model(),
        "cores": len(_affinity()),
        "cpuid_flags": cpuid_flags(),
        "isa_executes": sorted(name for name, on in probe_isa().items() if on),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "command": shlex.join(["python", str(shown), *argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return {0}
