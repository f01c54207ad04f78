"""Native CPU kernels, compiled once on first use (cached by torch in
``~/.cache/torch_extensions``).

The module's name carries a hash of its source and flags, and once built it is imported straight
from the cache: a worker that starts never takes torch's build lock, so one killed while starting
(a chaos test, an OOM kill) cannot leave a lock that hangs every later start.

Where the toolchain is missing (no C++ compiler, no ninja, no Python headers) pdserve runs the plain
torch path. Where the toolchain is there, the kernel must build: a compile error raises
``KernelBuildError`` rather than slowing every decode step down unnoticed
(``PDSERVE_NATIVE_KERNELS=0`` chooses the torch path explicitly).

The first call logs one line saying which decode attention the process runs:
``attention: native CPU kernel (paged_attention_cpu, ...)`` or ``attention: torch fallback
(reason)``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sysconfig
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_ENV = "PDSERVE_NATIVE_KERNELS"


class KernelBuildError(RuntimeError):
    """The toolchain is present but the native kernel does not compile or load."""


def missing_toolchain() -> str | None:
    """What this machine lacks to build the kernel, in words, or None when nothing is missing."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")  # what torch's extension builder runs
    if shutil.which(compiler) is None:
        return f"a C++ compiler ({compiler} is not on PATH)"
    if not is_ninja_available():
        return "ninja (torch builds extensions with it)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"Python's C headers ({headers})"
    return None


def build_cpu_kernels() -> ModuleType:
    """The paged-attention kernel (see ``build_extension``)."""
    return build_extension(_SOURCE)


def build_extension(source: Path) -> ModuleType:
    """The module compiled from ``source`` (``pdserve_<stem>_<hash>``): imported from an earlier
    build of this very source, else compiled (under torch's build lock); any build error
    propagates."""
    from torch.utils.cpp_extension import get_default_build_root, load

    digest = hashlib.sha256(source.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()
    name = f"pdserve_{source.stem}_{digest[:12]}"
    built = Path(get_default_build_root()) / name / f"{name}.so"
    if built.is_file():
        try:
            return _import_extension(name, built)
        except ImportError:
            log.warning("%s does not load; building it again", built)
    return load(name=name, sources=[str(source)], extra_cflags=_CFLAGS, verbose=False)


def _import_extension(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module spec for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled (``PDSERVE_NATIVE_KERNELS=0``) or when the
    toolchain is missing; raises ``KernelBuildError`` when the toolchain fails on the source."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("attention: torch fallback (native kernel disabled by %s=0)", DISABLE_ENV)
        return None
    missing = missing_toolchain()
    if missing is not None:
        log.warning("attention: torch fallback (no native kernel: missing %s)", missing)
        return None
    start = time.monotonic()
    try:
        module = build_cpu_kernels()
    except Exception as exc:
        raise KernelBuildError(
            f"{_SOURCE.name} failed to build ({_first_line(exc)}); "
            f"{DISABLE_ENV}=0 runs the torch path instead"
        ) from exc
    log.info(
        "attention: native CPU kernel (%s, ready in %.1f s)",
        _SOURCE.stem,
        time.monotonic() - start,
    )
    return module


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
