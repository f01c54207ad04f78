"""llama.cpp's ``llama-server`` as a serving peer: the same GGUF pdserve serves, on the same
cores, behind its OpenAI-compatible ``/v1/completions`` route.

It is built once into the cache folder with the engine benchmark's tools
(``benchmarks/llamacpp/build.py --server``), or taken from ``--llama-cpp-dir``. A
``ServerSetting`` says what it is given: ``slots`` sequences decoded together (continuous
batching, each with ``CONTEXT_PER_SLOT`` tokens of KV), its logical and physical batch sizes
(``-b`` / ``-ub``) and its threads; with one thread it runs on the last core alone, so that the
load generator can have another.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.llamacpp.build import SERVER, TOOLS, ensure_tools, has_tools
from engine.model.loader import load_model

SLOTS = 8  # the workload's concurrency at its highest rate stays below this
CONTEXT_PER_SLOT = 2560  # pdserve's maxSeqLen


@dataclass(frozen=True)
class ServerSetting:
    """What llama-server is given: ``<slots>:<batch>:<ubatch>:<threads>`` in a mode's name."""

    slots: int = SLOTS
    batch: int = 2048  # -b, llama.cpp's default
    ubatch: int = 512  # -ub, llama.cpp's default
    threads: int = 2

    @classmethod
    def parse(cls, text: str) -> ServerSetting:
        """``slots:batch:ubatch:threads`` (a shorter form keeps the defaults of the rest)."""
        parts = [part for part in text.split(":") if part]
        if len(parts) > 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise ValueError(
                f"a llama-server setting is SLOTS[:BATCH[:UBATCH[:THREADS]]], got {text!r}"
            )
        return cls(*(int(part) for part in parts))

    def name(self) -> str:
        return f"{self.slots}:{self.batch}:{self.ubatch}:{self.threads}"

    def cpus(self) -> set[int] | None:
        """The cores it is pinned to: the last one alone with one thread, else unpinned."""
        if self.threads != 1:
            return None
        return {max(os.sched_getaffinity(0))}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cpus": sorted(self.cpus() or [])}


def sweep_settings(slots: str, batches: str, threads: str) -> list[str]:
    """Every ``slots:batch:ubatch:threads`` of the comma lists (batches as ``b/ub``)."""
    return [
        f"{n}:{b.replace('/', ':')}:{t}"
        for n in slots.split(",")
        for b in batches.split(",")
        for t in threads.split(",")
    ]


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
    """A running ``llama-server`` (``stop`` ends it); its log is ``log``; ``extra``: more of its
    options (e.g. its speculative decoding)."""

    def __init__(
        self,
        folder: Path,
        gguf: Path,
        port: int,
        log: Path,
        setting: ServerSetting,
        context_per_slot: int = CONTEXT_PER_SLOT,
        extra: tuple[str, ...] = (),
    ) -> None:
        command = [
            str(folder / SERVER[0]),
            "-m", str(gguf),
            "--host", "127.0.0.1",
            "--port", str(port),
            "-t", str(setting.threads),
            "-tb", str(setting.threads),
            "--parallel", str(setting.slots),
            "-c", str(setting.slots * context_per_slot),
            "-b", str(setting.batch),
            "-ub", str(setting.ubatch),
            "--no-webui",
            *extra,
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.command = command
        cpus = setting.cpus()
        self._log = log.open("w")
        try:
            self._process = subprocess.Popen(
                command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
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

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()
