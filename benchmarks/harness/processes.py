"""The CPU a server's processes spend, read from ``/proc``: the process tree under a root (a
pdserve coordinator and everything it started: Ray's daemons, and its worker actors under the
raylet), each process's user + system time, and what a measurement cost each role per token.

    before = tree_cpu(coordinator_pid)
    ...                                   # the measurement
    costs = cpu_per_token(before, tree_cpu(coordinator_pid), tokens=n)

Roles: ``coordinator`` (the root itself), a Ray actor by its class (``ray::DecodeWorker``; its
process title), one of Ray's own processes by its program (``ray_daemon:raylet``,
``ray_daemon:gcs_server``, ``ray_daemon:dashboard``, ``ray_daemon:DashboardAgent``,
``ray_daemon:IDLE`` ...; all of them together ``ray_daemons``) and ``other`` (any other
process under the root). A process that ended between the readings counts nothing; one that
started counts from zero.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
RAY_ACTOR = "ray::"
# Ray's own processes under the raylet that carry an actor-like title
RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
RAY_DAEMON = "ray_daemon:"  # the role of one of Ray's own processes: ray_daemon:raylet


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    role: str
    cpu_ms: float


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command's closing parenthesis (state is field 0)."""
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_ms(pid: int) -> float:
    """User + system milliseconds of ``pid`` so far."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def parents() -> dict[int, int]:
    """Every live process's parent."""
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = int(stat_fields(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
    return out


def descendants(root: int, parent_of: dict[int, int]) -> list[int]:
    """``root`` and every process under it."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, parent in parent_of.items():
        children[parent].append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def role_of(pid: int, root: int, cmdline: str, root_role: str = "coordinator") -> str:
    """The role a process of the tree plays (module docstring)."""
    if pid == root:
        return root_role
    title = cmdline.split(" ")[0]
    if title.startswith(RAY_ACTOR) and not title.startswith(RAY_OWN):
        return title.split(".")[0]  # ray::DecodeWorker.method -> the class
    if title.startswith(RAY_ACTOR):
        return RAY_DAEMON + title.removeprefix(RAY_ACTOR)
    if "ray" in title or "/ray/" in cmdline:
        return RAY_DAEMON + program(cmdline)
    return "other"


def program(cmdline: str) -> str:
    """What a command runs: its Python script's name, else its executable's."""
    words = cmdline.split(" ")
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return (script or words[0]).rsplit("/", 1)[-1].removesuffix(".py")


def cmdline_of(pid: int) -> str:
    raw = (PROC / str(pid) / "cmdline").read_bytes()
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def tree_cpu(root: int, root_role: str = "coordinator") -> dict[int, ProcessCpu]:
    """Each live process under ``root`` (and ``root``, as ``root_role``): its role and CPU so
    far."""
    out = {}
    for pid in descendants(root, parents()):
        try:
            role = role_of(pid, root, cmdline_of(pid), root_role)
            out[pid] = ProcessCpu(pid, role, process_cpu_ms(pid))
        except OSError:
            continue
    return out


def cpu_per_token(
    before: dict[int, ProcessCpu], after: dict[int, ProcessCpu], tokens: int
) -> dict[str, float]:
    """Milliseconds of CPU per token by role between two readings, ``all`` of them, and where
    there are any, ``workers`` (every Ray actor's) and ``ray_daemons`` (Ray's own processes')."""
    spent: dict[str, float] = defaultdict(float)
    for pid, now in after.items():
        then = before.get(pid)
        spent[now.role] += now.cpu_ms - (then.cpu_ms if then is not None else 0.0)
    spent["all"] = sum(spent.values())
    for total, prefix in (("workers", RAY_ACTOR), ("ray_daemons", RAY_DAEMON)):
        parts = [ms for role, ms in spent.items() if role.startswith(prefix)]
        if parts:
            spent[total] = sum(parts)
    return {role: ms / max(tokens, 1) for role, ms in sorted(spent.items())}


def actor_pid(root: int, role: str) -> int | None:
    """The first process under ``root`` of ``role`` (e.g. ``ray::DecodeWorker``)."""
    return next((p.pid for p in tree_cpu(root).values() if p.role == role), None)
