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
    """The module compiled from ``source`` (``pdserve_<stem>_<hash>``, the hash over the source,
    the kernel headers beside it and the flags): imported from an earlier build of this very
    code, else compiled (under torch's build lock); any build error propagates."""
    from torch.utils.cpp_extension import get_default_build_root, load

    headers = sorted(source.parent.glob("*.h"))
    code = b"".join(path.read_bytes() for path in [source, *headers])
    digest = hashlib.sha256(code + " ".join(_CFLAGS).encode()).hexdigest()
    name = f"pdserve_{source.stem}_{digest[:12]}"
    built = Path(get_default_build_root()) / name / f"{name}.so"
    if built.is_file():
        try:
            return _import_extension(name, built)
        except ImportError:
            log.warning("%s does not load; building it again", built)
    return load(
        name=name,
        sources=[str(source)],
        extra_cflags=_CFLAGS,
        extra_include_paths=[str(source.parent)],
        verbose=False,
    )


def _import_extension(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module spec for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The paged-attention module (see ``load_native``)."""
    return load_native(_SOURCE, "attention", log)


def load_native(source: Path, role: str, logger: logging.Logger) -> ModuleType | None:
    """The module built from ``source``, or None when disabled (``PDSERVE_NATIVE_KERNELS=0``) or
    when the toolchain is missing; raises ``KernelBuildError`` when the toolchain fails on the
    source. Logs to ``logger`` one line starting with ``role`` that says which path runs."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s: torch fallback (native kernel disabled by %s=0)", role, DISABLE_ENV)
        return None
    missing = missing_toolchain()
    if missing is not None:
        logger.warning("%s: torch fallback (no native kernel: missing %s)", role, missing)
        return None
    start = time.monotonic()
    try:
        module = build_extension(source)
    except Exception as exc:
        raise KernelBuildError(
            f"{source.name} failed to build ({_first_line(exc)}); "
            f"{DISABLE_ENV}=0 runs the torch path instead"
        ) from exc
    isa = f", {module.isa()}" if hasattr(module, "isa") else ""
    logger.info(
        "%s: native CPU kernel (%s%s, ready in %.1f s)",
        role,
        source.stem,
        isa,
        time.monotonic() - start,
    )
    return module


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
