"""What a process tree holds in memory, said per process: its role, RSS, PSS and USS.

RSS counts every page a process maps, so pages shared by several processes (the Python
interpreter, torch's libraries, a file every worker maps) are counted once per process and the
sum over a tree overstates it. PSS divides each shared page among the processes that map it, so
the PSS of a tree is what the tree really holds; USS is what a process alone holds (what ending
it would free). Both come from ``/proc/PID/smaps_rollup``.

A process's role comes from its command line: Ray names its services by their programs
(``gcs_server``, ``raylet``, the dashboard, the log monitor) and sets each worker's title to
``ray::<actor class>`` (``ray::IDLE`` for a worker that holds no actor yet; its two agents title
themselves the same way, ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

# (a fragment of the command line, the role it names), the first that matches wins
ROLE_MARKERS = (
    ("gcs_server", "gcs_server"),
    ("raylet/raylet", "raylet"),
    ("dashboard/agent.py", "dashboard_agent"),
    ("runtime_env/agent/main.py", "runtime_env_agent"),
    ("dashboard/dashboard.py", "dashboard"),
    ("log_monitor.py", "log_monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler_monitor"),
    ("llama-server", "llama-server"),
    ("-m coordinator", "coordinator"),
)
RAY_WORKER = "ray::"
# Ray services that title themselves as workers do
RAY_SERVICE_TITLES = {"DashboardAgent": "dashboard_agent", "RuntimeEnvAgent": "runtime_env_agent"}


@dataclass(frozen=True)
class ProcessMemory:
    """One process: its role and what it holds, in MiB."""

    pid: int
    role: str
    rss_mib: float
    pss_mib: float
    uss_mib: float


def classify(cmdline: str) -> str:
    """The role of the process with this command line (``other`` when none fits)."""
    if cmdline.startswith(RAY_WORKER):
        name = (cmdline[len(RAY_WORKER) :].split() or [""])[0].split(".")[0]
        return RAY_SERVICE_TITLES.get(name) or f"worker:{name or 'IDLE'}"
    for marker, role in ROLE_MARKERS:
        if marker in cmdline:
            return role
    return "other"


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """The ``kB`` fields of an ``smaps_rollup`` file, in bytes."""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[name] = int(parts[0]) * 1024
    return fields


def memory_of(pid: int, role: str, rollup: str) -> ProcessMemory:
    """``pid``'s figures from its ``smaps_rollup`` text."""
    fields = parse_smaps_rollup(rollup)
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    mib = 2**20
    return ProcessMemory(
        pid,
        role,
        round(fields.get("Rss", 0) / mib, 1),
        round(fields.get("Pss", 0) / mib, 1),
        round(uss / mib, 1),
    )


def tree_pids(root: int) -> list[int]:
    """``root`` and every process below it."""
    top = psutil.Process(root)
    return [top.pid, *(child.pid for child in top.children(recursive=True))]


def measure(pids: Iterable[int]) -> list[ProcessMemory]:
    """Each of ``pids`` still alive, with its role and memory."""
    found = []
    for pid in pids:
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (psutil.Error, OSError):
            continue  # ended while we looked
        found.append(memory_of(pid, classify(cmdline), rollup))
    return found


def summarize(processes: list[ProcessMemory]) -> dict[str, Any]:
    """The processes (largest PSS first) and the tree's sums."""
    ordered = sorted(processes, key=lambda p: -p.pss_mib)
    total = {
        f"{kind}_mib": round(sum(getattr(p, f"{kind}_mib") for p in processes), 1)
        for kind in ("rss", "pss", "uss")
    }
    return {"processes": [asdict(p) for p in ordered], "total": total}
