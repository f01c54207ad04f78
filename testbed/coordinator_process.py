"""Start real ``pdserve`` coordinator processes for tests (each with its own local Ray)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Below the kernel's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999): a
# coordinator binds its ports only after its Ray is up, and Ray's processes bind ephemeral ports
# meanwhile, which could take a port picked from that range.
PORT_RANGE = range(20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, outside the ranges other processes pick from, never handed out twice
    in this process."""
    for port in random.sample(PORT_RANGE, len(PORT_RANGE)):
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


@dataclass
class CoordinatorProcess:
    process: subprocess.Popen
    ports: dict[str, int]
    scheme: str
    log_path: Path
    verify: object = True
    headers: dict | None = None  # sent with every request (api keys)

    def url(self, port: str, path: str) -> str:
        scheme = self.scheme if port == "predict_port" else "http"
        return f"{scheme}://127.0.0.1:{self.ports[port]}{path}"

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(verify=self.verify, timeout=60, headers=self.headers, **kwargs)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"coordinator exited: {self.log_path.read_text()[-3000:]}")
            try:
                if (
                    httpx.get(self.url("status_port", "/v1/readiness"), timeout=2).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready in {timeout_s} s: {self.log_path.read_text()[-3000:]}")

    def stop(self, timeout_s: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


def start_coordinator(
    workdir: Path, config: dict, *args: str, env: dict[str, str] | None = None
) -> CoordinatorProcess:
    """A coordinator process on free ports; ``env``: extra environment variables."""
    ports = {
        name: free_port()
        for name in ("predict_port", "manage_port", "status_port", "external_port")
    }
    config = {**config, "http_config": {**config.get("http_config", {}), **ports}}
    path = workdir / "ms_coordinator.json"
    path.write_text(json.dumps(config))
    log_path = workdir / "coordinator.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, not the test session's
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "--config", str(path), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    tls = config.get("tls_config", {}).get("request_server_tls_enable", False)
    return CoordinatorProcess(process, ports, "https" if tls else "http", log_path)
