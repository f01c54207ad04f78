"""A server's process tree from ``/proc`` and what each role spent per token: the tree under a
root, roles from process titles, CPU differences between two readings (a process that started
between them counts from zero)."""

from __future__ import annotations

import os

from benchmarks.harness.processes import (
    ProcessCpu,
    cpu_per_token,
    descendants,
    role_of,
    tree_cpu,
)


def test_the_tree_under_a_root():
    parent_of = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1}
    assert sorted(descendants(10, parent_of)) == [10, 11, 12, 13]


def test_roles_from_process_titles():
    assert role_of(5, 5, "python -m coordinator --config x") == "coordinator"
    assert role_of(6, 5, "ray::DecodeWorker.generate") == "ray::DecodeWorker"
    assert role_of(6, 5, "ray::IDLE") == "ray_daemon:IDLE"
    assert role_of(6, 5, "ray::DashboardAgent") == "ray_daemon:DashboardAgent"
    raylet = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x"
    assert role_of(7, 5, raylet) == "ray_daemon:raylet"
    dashboard = "/venv/bin/python /venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py --x"
    assert role_of(7, 5, dashboard) == "ray_daemon:dashboard"
    assert role_of(8, 5, "/usr/bin/sleep 5") == "other"
    assert role_of(5, 5, "llama-server -m x", root_role="llama_server") == "llama_server"


def test_cpu_per_token_by_role():
    before = {1: ProcessCpu(1, "coordinator", 100.0), 2: ProcessCpu(2, "ray::DecodeWorker", 50.0)}
    after = {
        1: ProcessCpu(1, "coordinator", 110.0),
        2: ProcessCpu(2, "ray::DecodeWorker", 250.0),
        3: ProcessCpu(3, "ray_daemon:raylet", 10.0),  # started in between
    }
    costs = cpu_per_token(before, after, tokens=100)
    assert costs["coordinator"] == 0.1 and costs["ray::DecodeWorker"] == 2.0
    assert costs["ray_daemon:raylet"] == costs["ray_daemons"] == 0.1 and costs["workers"] == 2.0
    assert round(costs["all"], 6) == 2.2


def test_this_process_is_read_from_proc():
    mine = tree_cpu(os.getpid())
    assert mine[os.getpid()].role == "coordinator" and mine[os.getpid()].cpu_ms >= 0
