"""The one way a benchmark writes its result: ``--out`` and ``--scratch`` on its command line, the
run's provenance taken at the start, and a file under ``benchmarks/results/`` only from a clean
tree (the figures there are rendered into the documents, so each must name the code that made it).

    parser = argparse.ArgumentParser(...)
    add_output_arguments(parser, "vs_llamacpp")
    args = parser.parse_args()
    result = ResultFile.start(args)         # refuses at once what it would refuse at the end
    ...
    result.write({...}, complete=False)     # what is measured so far
    result.write({...})                     # done
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.provenance import ROOT, head, run_meta, uncommitted

RESULTS = ROOT / "benchmarks" / "results"
SCRATCH = Path(tempfile.gettempdir()) / "pdserve-benchmarks"


def exit_on_sigterm() -> None:
    """A SIGTERM (``timeout``, a scheduler) exits the run through its ``finally`` blocks, which
    stop the servers it started, instead of leaving them running (Python's default ends the
    process at once). Only from the main thread, and only where nothing else handles it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class DirtyTree(SystemExit):
    """A run that would write under ``benchmarks/results/`` from a tree that is not committed."""


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--out", type=Path, help=f"the result file (default: benchmarks/results/{name}.json, or "
        f"{SCRATCH}/{name}.json with --scratch)",
    )  # fmt: skip
    parser.add_argument(
        "--scratch", action="store_true",
        help="a trial run: write outside benchmarks/results/, whatever the tree's state",
    )  # fmt: skip
    parser.set_defaults(result_name=name)


def in_results(path: Path) -> bool:
    return path.resolve().is_relative_to(RESULTS.resolve())


def check_clean(path: Path) -> None:
    """Refuse a result file under ``benchmarks/results/`` while the tree has changes (other than
    that file itself, which the run rewrites as it goes)."""
    own = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else ""
    changed = [name for name in uncommitted() if name != own]
    if in_results(path) and changed:
        shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
        raise DirtyTree(
            f"refusing to write {path}: the tree has uncommitted changes ({shown}); commit "
            "them, or pass --scratch for a trial run"
        )


@dataclass
class ResultFile:
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, args: argparse.Namespace, argv: list[str] | None = None) -> ResultFile:
        """The result file ``args`` names, its provenance taken now."""
        path = args.out or (SCRATCH if args.scratch else RESULTS) / f"{args.result_name}.json"
        if args.scratch and in_results(path):
            raise SystemExit(f"--scratch writes outside benchmarks/results/, not to {path}")
        check_clean(path)
        exit_on_sigterm()
        return cls(path, run_meta(argv))

    def write(self, data: dict[str, Any], complete: bool = True) -> Path:
        """``data`` with the run's provenance under ``_meta`` (``complete`` False while the run
        goes on). The tree is checked again: a commit made mid-run is refused too."""
        if in_results(self.path) and complete:
            check_clean(self.path)
            if head() != self.meta["commit"].removesuffix("-dirty"):
                raise DirtyTree(f"refusing to write {self.path}: the commit moved during the run")
        body = {"_meta": {**self.meta, **data.get("_meta", {}), "complete": complete}}
        body.update((key, value) for key, value in data.items() if key != "_meta")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(body, indent=2) + "\n")
        return self.path
