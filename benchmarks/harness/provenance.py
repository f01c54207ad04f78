"""What every result file records about the run that wrote it, taken when the run starts: the CPU
(model, the ISA flags cpuid lists, the extensions it really executes), the cores, the commit, the
date, the command and the Python and torch versions, so a figure is compared only with figures of
the same machine and code."""

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


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def uncommitted() -> list[str]:
    """The tracked files that differ from the commit and the untracked files not ignored."""
    done = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    )
    return porcelain_paths(done.stdout) if done.returncode == 0 else []


def porcelain_paths(status: str) -> list[str]:
    """The paths of ``git status --porcelain`` lines (``XY path``; a rename's new path)."""
    return [line[3:].split(" -> ")[-1] for line in status.splitlines() if len(line) > 3]


def head() -> str:
    """The checked-out commit."""
    return _git("rev-parse", "--short=12", "HEAD") or "unknown"


def commit() -> str:
    """The checked-out commit, with ``-dirty`` when the tree differs from it."""
    return head() + ("-dirty" if uncommitted() else "")


def command_line(argv: list[str]) -> str:
    """``argv`` as the command that runs it again: a module of this repository as ``python -m``."""
    script = Path(argv[0]).resolve()
    if script.suffix == ".py" and script.is_relative_to(ROOT):
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join(["python", argv[0], *argv[1:]])


def run_meta(argv: list[str] | None = None) -> dict:
    """The machine, code and command of this run."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": len(_affinity()),
        "cpuid_flags": cpuid_flags(),
        "isa_executes": sorted(name for name, on in probe_isa().items() if on),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(sys.argv if argv is None else argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return {0}
