"""The memory benchmark's accounting of a process tree: each process's role from its command line,
its RSS/PSS/USS from ``smaps_rollup``, and the tree's sums."""

from __future__ import annotations

import os

import pytest

from testbed.process_tree import (
    ProcessMemory,
    classify,
    measure,
    memory_of,
    summarize,
    tree_pids,
)

ROLLUP = """00400000-7ffd0000 ---p 00000000 00:00 0                          [rollup]
Rss:              204800 kB
Pss:              153600 kB
Shared_Clean:      51200 kB
Private_Clean:     10240 kB
Private_Dirty:    133120 kB
Swap:                  0 kB
"""
RAY = "/venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("/venv/bin/python -m coordinator --config /tmp/single_node.json", "coordinator"),
        (f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", "gcs_server"),
        (f"{RAY}/core/src/ray/raylet/raylet --raylet_socket_name=x", "raylet"),
        (f"/venv/bin/python {RAY}/dashboard/dashboard.py --host=127.0.0.1", "dashboard"),
        (f"/venv/bin/python -u {RAY}/_private/log_monitor.py --session-dir=x", "log_monitor"),
        (f"/venv/bin/python -u {RAY}/autoscaler/_private/monitor.py", "autoscaler_monitor"),
        ("ray::DashboardAgent", "dashboard_agent"),
        ("ray::RuntimeEnvAgent", "runtime_env_agent"),
        ("ray::ColocatedWorker", "worker:ColocatedWorker"),
        ("ray::PrefillWorker.generate", "worker:PrefillWorker"),
        ("ray::IDLE", "worker:IDLE"),
        ("ray::", "worker:IDLE"),
        ("/cache/llama.cpp/bin/llama-server -m x.gguf --parallel 32", "llama-server"),
        ("/bin/sh -c true", "other"),
    ],
)
def test_a_process_is_named_by_its_command_line(cmdline, role):
    assert classify(cmdline) == role


def test_pss_and_uss_come_from_smaps_rollup():
    process = memory_of(7, "raylet", ROLLUP)
    assert (process.rss_mib, process.pss_mib, process.uss_mib) == (200.0, 150.0, 140.0)


def test_the_tree_sums_its_processes_largest_first():
    small, large = memory_of(1, "raylet", ROLLUP), ProcessMemory(2, "worker:X", 400.0, 300.0, 280.0)
    summary = summarize([small, large])
    assert [p["pid"] for p in summary["processes"]] == [2, 1]
    assert summary["total"] == {"rss_mib": 600.0, "pss_mib": 450.0, "uss_mib": 420.0}


def test_this_process_is_measured():
    assert tree_pids(os.getpid())[0] == os.getpid()
    (me,) = measure([os.getpid()])
    assert me.role == "other" and 0 < me.uss_mib <= me.pss_mib <= me.rss_mib
