"""Starting pdserve for a benchmark: a coordinator process on this machine in a deploy mode, with
the ``backend_config`` keys that name what a benchmark's mode means (whatever pdserve's defaults
become), and free ports for it.

    process, ports = start_pdserve("pd_separate", "bundled", workdir, FIXED)
    ...
    stop_pdserve(process)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

DEPLOY_MODES = ("pd_separate", "single_node")  # what pdserve's deploy_mode takes
MODES = ("pd_separate", "pd_adaptive", "single_node")  # the modes the serving benchmarks name
# pd_separate whose decode worker prefills short prompts itself (and those behind a long prefill
# queue), in chunks sized to keep its steps within stepTargetMs (docs/architecture.md#routing):
# pdserve's defaults, written out so that a run means the same whatever they become
ADAPTIVE = {
    "local_prefill_tokens": 96,
    "local_prefill_queue_tokens": 1024,
    "stepTargetMs": 100,
}
# the fixed split, whatever the defaults: every prompt handed off, no shared core
FIXED = {
    "local_prefill_tokens": 0,
    "local_prefill_queue_tokens": 0,
    "stepTargetMs": 0,
}
# mode -> (deploy mode, backend_config keys)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "pd_separate": ("pd_separate", FIXED),
    "single_node": ("single_node", {"stepTargetMs": 0}),
    # the same with the engine's OpenMP threads spinning 10000 turns, not 300000, once idle
    "single_node_spin10k": ("single_node", {"stepTargetMs": 0, "omp_spin_count": 10000}),
    "pd_adaptive": ("pd_separate", ADAPTIVE),
    # single_node with the coordinator on uvloop (HTTP_SETTINGS)
    "single_node_uvloop": ("single_node", {"stepTargetMs": 0}),
}
# mode -> http_config keys, for the modes that set any
HTTP_SETTINGS: dict[str, dict[str, Any]] = {"single_node_uvloop": {"event_loop": "uvloop"}}
READY_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_pdserve(
    mode: str,
    model: str,
    workdir: Path,
    backend: dict[str, Any] | None = None,
    http: dict[str, Any] | None = None,
    sections: dict[str, dict[str, Any]] | None = None,
) -> tuple[subprocess.Popen, dict]:
    """pdserve in deploy mode ``mode`` on this machine, once ready; ``backend`` adds
    ``backend_config`` keys, ``http`` ``http_config`` keys, ``sections`` other sections (e.g.
    ``{"request_limit": {...}}``). Its config and log are ``workdir/{mode}.json`` and ``.log``."""
    names = ("predict_port", "manage_port", "status_port", "external_port")
    ports = {name: free_port() for name in names}
    backend = {"model_path": model, "embedding_model_path": "", "device": "cpu", **(backend or {})}
    config = {
        "http_config": {**ports, **(http or {})},
        "digs_scheduler_config": {"deploy_mode": mode},
        "backend_config": backend,
        **(sections or {}),
    }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{mode}.json"
    path.write_text(json.dumps(config))
    log = open(workdir / f"{mode}.log", "w")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _wait_ready(process, mode, workdir, ports["status_port"])
    return process, ports


def _wait_ready(process: subprocess.Popen, mode: str, workdir: Path, status_port: int) -> None:
    """Until pdserve's readiness answers 200 (within ``READY_S``); stopped if it fails to."""
    deadline = time.monotonic() + READY_S
    ready = f"http://127.0.0.1:{status_port}/v1/readiness"
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"pdserve ({mode}) exited; see {workdir / f'{mode}.log'}")
            try:
                if httpx.get(ready, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"pdserve ({mode}) not ready in {READY_S} s")
    except BaseException:
        stop_pdserve(process, 30)
        raise


def stop_pdserve(process: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``timeout_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
