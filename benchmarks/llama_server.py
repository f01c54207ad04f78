"""llama.cpp's ``llama-server`` as a serving peer: the same GGUF pdserve serves, on the same
cores, behind its OpenAI-compatible ``/v1/completions`` route.

It is built once into the cache folder with the engine benchmark's tools
(``benchmarks/llamacpp_build.py --server``), or taken from ``--llama-cpp-dir``. ``slots``
sequences are decoded together (continuous batching), each with ``context`` tokens of KV.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.llamacpp_build import SERVER, TOOLS, ensure_tools, has_tools
from engine.model.loader import load_model

SLOTS = 8  # the workload's concurrency at its highest rate stays below this
CONTEXT_PER_SLOT = 2560  # pdserve's maxSeqLen


def server_folder(given: Path | None) -> Path:
    """The folder holding ``llama-server``: ``given``, else the cache (built if missing)."""
    if given is None:
        return ensure_tools(tools=TOOLS + SERVER)
    if not has_tools(given, SERVER):
        raise SystemExit(f"--llama-cpp-dir {given} must hold {SERVER[0]}")
    return given


def gguf_of(model: str) -> Path:
    path = load_model(model).gguf_path
    if path is None:
        raise SystemExit(f"{model}: no GGUF file to serve with llama-server")
    return path


class LlamaServer:
    """A running ``llama-server`` (``stop`` ends it); its log is ``log``."""

    def __init__(
        self, folder: Path, gguf: Path, port: int, threads: int, log: Path, slots: int = SLOTS
    ) -> None:
        command = [
            str(folder / SERVER[0]),
            "-m", str(gguf),
            "--host", "127.0.0.1",
            "--port", str(port),
            "-t", str(threads),
            "-tb", str(threads),
            "--parallel", str(slots),
            "-c", str(slots * CONTEXT_PER_SLOT),
            "--no-webui",
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.command = command
        self._log = log.open("w")
        try:
            self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        except OSError:
            self._log.close()
            raise
        self._wait_ready(log)

    def _wait_ready(self, log: Path, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"llama-server exited ({self._process.returncode}); see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"llama-server not ready in {timeout_s:.0f} s; see {log}")

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()
