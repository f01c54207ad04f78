"""Native CPU kernels, compiled once on first use into pdserve's folder of torch's extension
cache (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, then ``pdserve/``).

Each module's name carries a hash of its source, headers, flags, torch and Python versions and
the CPU it is compiled for (``-march=native`` targets this CPU's model and feature flags: a build
made on an AVX-512 machine must not be imported on an AVX2-only one sharing the cache), and its
build folder is that name. A build that completed leaves a ``ready`` file naming the library;
when it is there the module is imported straight from it: no lock, no compiler, whatever checkout
or path the source comes from, provided no other user could have put or changed the library
(``engine.kernels.build_trust``: folder and library owned by this user and writable by no one
else, the library directly in the folder); otherwise it is built again, with a warning (a build
leaves its folder and library writable by their owner only, whatever the umask). Only a build
takes a lock, ``<name>.lock`` beside the folder: an advisory ``flock`` that the kernel releases
when its holder dies, so a start killed mid-build (a chaos test, an OOM kill) never leaves a lock
that a later start waits on. Whoever holds it clears
torch's own ``lock`` file in the build folder, which a killed build leaves behind and torch would
wait on forever. A wait for a live builder is bounded (``BUILD_WAIT_S``) and names the file.

Where the toolchain is missing (no C++ compiler, no ninja, no Python headers) pdserve runs the plain
torch path. Where the toolchain is there, the kernel must build: a compile error raises
``KernelBuildError`` rather than slowing every decode step down unnoticed
(``PDSERVE_NATIVE_KERNELS=0`` chooses the torch path explicitly).

The first call logs one line saying which decode attention the process runs:
``attention: native CPU kernel (paged_attention_cpu, ..., cached build)`` or ``attention: torch
fallback (reason)``; a module with quantized kernels is first given its instruction set
(``engine.kernels.isa``), which its line names. ``kernel_origins()`` says for every module loaded
whether it was imported from the cache or compiled by this process.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

from engine.kernels.build_trust import make_private, untrusted_reason

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_ENV = "PDSERVE_NATIVE_KERNELS"
BUILD_WAIT_S = 600.0  # the longest a start waits for another process's build of the same kernel
READY_FILE = "ready"  # in a build folder: the library's file name, written once it has loaded
_loaded: dict[str, ModuleType] = {}  # module name -> module, for this process
_origins: dict[str, str] = {}  # source stem -> "cached" or "built", for this process
# One load at a time in a process: two threads importing one extension at once can each get a
# module holding only part of its functions (CPython initialises it twice, concurrently)
_loading = threading.Lock()


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


def kernel_build_root() -> Path:
    """The folder holding every pdserve kernel build (one subfolder per module name)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "pdserve"


def module_name(source: Path) -> str:
    """``pdserve_<stem>_<hash>``: the hash over the source, the headers beside it, the flags, the
    compiler, torch's version, Python's ABI and the CPU (``cpu_identity``), so a build is reused
    only where it would load and run."""
    import torch

    headers = sorted(source.parent.glob("*.h"))
    code = b"".join(path.read_bytes() for path in [source, *headers])
    toolchain = [
        *_CFLAGS,
        os.environ.get("CXX", "c++"),
        torch.__version__,
        sys.implementation.cache_tag,
        cpu_identity(),
    ]
    digest = hashlib.sha256(code + " ".join(toolchain).encode()).hexdigest()
    return f"pdserve_{source.stem}_{digest[:12]}"


@functools.cache
def cpu_identity() -> str:
    """The CPU ``-march=native`` compiles for: its model name and feature flags as the kernel
    reports them (``/proc/cpuinfo``), or the platform's machine name where that is unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in wanted]
    return " | ".join(dict.fromkeys(line.split(":", 1)[1].strip() for line in lines))


def build_extension(source: Path, wait_s: float = BUILD_WAIT_S) -> ModuleType:
    """The module compiled from ``source``: imported from a finished build of this very code with
    no lock taken, else compiled under the build lock (waiting up to ``wait_s`` for another
    process's build of it); any build error propagates."""
    with _loading:
        name = module_name(source)
        if name in _loaded:
            return _loaded[name]
        folder = kernel_build_root() / name
        module = _import_ready(folder)
        if module is None:
            with _build_lock(folder.with_suffix(".lock"), wait_s):
                module = _import_ready(folder) or _compile(name, source, folder)
        else:
            _origins[source.stem] = "cached"
        _loaded[name] = module
        return module


def kernel_origins() -> dict[str, str]:
    """For each native module this process loaded (by source stem): ``cached`` when imported
    from an earlier build, ``built`` when this process compiled it."""
    return dict(_origins)


def _import_ready(folder: Path) -> ModuleType | None:
    """The module of the finished build in ``folder``, or None when there is none that loads or
    none that may be trusted (``engine.kernels.build_trust``)."""
    try:
        library_name = (folder / READY_FILE).read_text().strip()
    except OSError:
        return None
    refused = untrusted_reason(folder, library_name)
    if refused is not None:
        log.warning("cached kernel build %s not imported: %s; building it again", folder, refused)
        return None
    library = folder / library_name
    try:
        return _import_extension(library.name.removesuffix(".so"), library)
    except ImportError as exc:
        log.warning("%s does not load (%s); building it again", library, exc)
        return None


def _compile(name: str, source: Path, folder: Path) -> ModuleType:
    """Build ``source`` into ``folder`` (the caller holds the build lock) and mark it ready."""
    from torch.utils.cpp_extension import load

    folder.mkdir(parents=True, exist_ok=True)
    if folder.stat().st_uid != os.geteuid():
        raise KernelBuildError(
            f"the kernel build folder {folder} belongs to another user; set TORCH_EXTENSIONS_DIR "
            "to a folder of this user's"
        )
    make_private(folder)
    (folder / READY_FILE).unlink(missing_ok=True)
    (folder / "lock").unlink(missing_ok=True)  # torch's, left by a build killed mid-way
    module = load(
        name=name,
        sources=[str(source)],
        extra_cflags=_CFLAGS,
        extra_include_paths=[str(source.parent)],
        build_directory=str(folder),
        verbose=False,
    )
    library = Path(module.__file__ or "")
    if library.parent == folder:
        make_private(library)
        (folder / READY_FILE).write_text(library.name)
    _origins[source.stem] = "built"
    return module


class _build_lock:  # noqa: N801 - used as a context manager, reads as a phrase
    """An exclusive ``flock`` on ``path``, waited for up to ``wait_s`` seconds; released by the
    kernel if this process dies, so a dead holder's lock is simply taken over."""

    def __init__(self, path: Path, wait_s: float) -> None:
        self.path, self.wait_s = path, wait_s

    def __enter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip()
                    os.close(self.fd)
                    raise TimeoutError(
                        f"waited {self.wait_s:.0f} s for the kernel build lock {self.path} "
                        f"(held by pid {holder or 'unknown'}, still building)"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing the descriptor releases the flock


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
    return load_native(SOURCE, "attention", log)


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
    if hasattr(module, "avx512_probe"):
        from engine.kernels.isa import apply_activation_dtype, apply_isa

        apply_isa(module)
        apply_activation_dtype(module)
    isa = f", {module.isa()}" if hasattr(module, "isa") else ""
    logger.info(
        "%s: native CPU kernel (%s%s, %s, ready in %.1f s)",
        role,
        source.stem,
        isa,
        "compiled now" if _origins.get(source.stem) == "built" else "cached build",
        time.monotonic() - start,
    )
    return module


def set_activation_dtype(name: str) -> str:
    """This process's activation dtype for decode rows (``engine.kernels.isa``), given to every
    native module loaded now or later; returns the one that runs (``int8`` or ``float32``)."""
    from engine.kernels.isa import set_activation_dtype as set_for

    return set_for(name, _loaded.values())


def set_batch_invariant(on: bool) -> None:
    """Keep every decode row's result independent of the rows beside it (``engine.kernels.isa``),
    in every native module loaded now or later."""
    from engine.kernels.isa import set_batch_invariant as set_for

    set_for(on, _loaded.values())


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
