"""Build llama.cpp's benchmark tools once, from the tree inside PyPI's ``llama-cpp-python`` sdist.

    python -m benchmarks.llamacpp.build              # prints the folder holding llama-bench
    python -m benchmarks.llamacpp.build --server     # ... and llama-server
    python -m benchmarks.llamacpp.build --quantize   # ... and llama-quantize
    python -m benchmarks.llamacpp.build --blas       # the build with ggml's BLAS backend

The sdist comes from the package index pip is configured with (no other network access); its
``vendor/llama.cpp`` tree is configured with CMake (Release, CPU only, no OpenSSL, no tests) and
only the tools asked for are built: ``llama-bench`` and ``llama-batched-bench`` for the engine
benchmark, ``llama-server`` for the serving comparison, ``llama-quantize`` for requantizing GGUF
files (``benchmarks/llamacpp/requantize.py``).

The instruction set is the one this CPU executes, probed by running each extension
(``benchmarks/harness/cpu_isa.py``), never ``GGML_NATIVE``: on a virtual machine whose cpuid
lists AMX while its instructions fault, ``-march=native`` compiles ggml's AMX kernels and the first
matrix product dies with SIGILL. A probe is not the whole proof: on one Xeon virtual machine every
AMX probe ran (tile loads and dot products, on several threads) while ggml's own AMX kernels died
on their first ``tileloadd``. So a new build runs ``llama-bench`` on the bundled GGUF once; one that
dies of SIGILL with AMX on marks AMX as faulting here (``amx-faults-<isa>`` beside the builds) and
is built again without it. The ``blas`` variant adds ggml's BLAS backend on Debian's OpenBLAS
(``apt-get install libopenblas-dev``), which often computes prompts faster. Each build lives in
``<cache>/llama.cpp/<version>-<variant>-<isa>/bin`` (the folder names the flags) and is reused by
every later run; a build takes about 8 minutes on two cores (the server about as long again).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.harness.cpu_isa import ggml_cmake_flags, isa_tag, probe_isa
from engine.model.gguf_cache import bundled_gguf_path, cache_root

SDIST_VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench")
SERVER = ("llama-server",)
QUANTIZE = ("llama-quantize",)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
)
VARIANTS = ("cpu", "blas")
AMX = ("amx_tile", "amx_int8", "amx_bf16")
BLAS_OPTIONS = ("-DGGML_BLAS=ON", "-DGGML_BLAS_VENDOR=OpenBLAS")
BLAS_HEADERS = (Path("/usr/include/x86_64-linux-gnu/cblas.h"), Path("/usr/include/cblas.h"))


def cmake_options(variant: str, isa: dict[str, bool]) -> list[str]:
    """Everything the configure step is given for ``variant`` on a CPU executing ``isa``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    blas = list(BLAS_OPTIONS) if variant == "blas" else ["-DGGML_BLAS=OFF"]
    return [*CMAKE_OPTIONS, *ggml_cmake_flags(isa), *blas]


def tools_dir(version: str = SDIST_VERSION, variant: str = "cpu") -> Path:
    """Where the build of ``variant`` for this CPU's instruction set lives."""
    return cache_root() / "llama.cpp" / f"{version}-{variant}-{isa_tag(build_isa())}" / "bin"


def build_isa() -> dict[str, bool]:
    """The extensions a build here uses: those the probes run, less AMX where a build with it
    was seen to die of SIGILL (module docstring)."""
    isa = probe_isa()
    if _amx_faults_mark(isa).is_file():
        isa = {**isa, **dict.fromkeys(AMX, False)}
    return isa


def _amx_faults_mark(isa: dict[str, bool]) -> Path:
    return cache_root() / "llama.cpp" / f"amx-faults-{isa_tag(isa)}"


def dies_of_sigill(folder: Path) -> bool:
    """Whether ``folder``'s ``llama-bench`` dies of SIGILL on a short run of the bundled GGUF."""
    command = [str(folder / "llama-bench"), "-m", str(bundled_gguf_path()), "-p", "64", "-n", "4"]
    done = subprocess.run([*command, "-r", "1"], capture_output=True, check=False)
    return done.returncode == -signal.SIGILL


def has_tools(folder: Path, tools: tuple[str, ...] = TOOLS) -> bool:
    return all(os.access(folder / tool, os.X_OK) for tool in tools)


def _run(command: list[str], log: Path) -> None:
    with log.open("a") as sink:
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); end of {log}:\n{tail}")


def _fetch_sdist(version: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (into / name).exists():
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(into)],
            into / "download.log",
        )  # fmt: skip
    return into / name


def _extract_tree(sdist: Path, into: Path) -> Path:
    prefix = sdist.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(into, members=members, filter="data")
    return into / prefix


def ensure_tools(
    version: str = SDIST_VERSION,
    jobs: int | None = None,
    tools: tuple[str, ...] = TOOLS,
    variant: str = "cpu",
) -> Path:
    """The folder holding ``tools`` (by default ``llama-bench`` and ``llama-batched-bench``) of
    ``variant``'s build, building those not there yet."""
    isa = build_isa()
    options = cmake_options(variant, isa)
    target = tools_dir(version, variant)
    missing = tuple(tool for tool in tools if not has_tools(target, (tool,)))
    if not missing:
        return _runs_or_rebuilt(target, isa, version, jobs, tools, variant)
    if variant == "blas" and not any(header.is_file() for header in BLAS_HEADERS):
        raise RuntimeError("the blas build needs OpenBLAS: apt-get install libopenblas-dev")
    work = target.parent / "work"
    log = target.parent / "build.log"
    tree = _extract_tree(_fetch_sdist(version, work), work)
    build = work / "build"
    print(
        f"building {', '.join(missing)} of llama.cpp {version} into {target} "
        f"(about 8 minutes on two cores; log {log})",
        flush=True,
    )
    _run(["cmake", "-S", str(tree), "-B", str(build), *options], log)
    jobs = jobs or os.cpu_count() or 1
    _run(["cmake", "--build", str(build), "--target", *missing, "-j", str(jobs)], log)
    target.mkdir(parents=True, exist_ok=True)
    for tool in missing:
        shutil.copy2(next(build.rglob(f"bin/{tool}")), target / tool)
    (target.parent / "cmake_options.txt").write_text("\n".join(options) + "\n")
    shutil.rmtree(work)
    return _runs_or_rebuilt(target, isa, version, jobs, tools, variant)


def _runs_or_rebuilt(
    target: Path,
    isa: dict[str, bool],
    version: str,
    jobs: int | None,
    tools: tuple[str, ...],
    variant: str,
) -> Path:
    """``target``, once its ``llama-bench`` ran on this CPU (checked once per build, where AMX
    is on); a build with AMX that dies of SIGILL is replaced by one without (module docstring)."""
    checked = target.parent / "runs_here"
    if checked.is_file() or not any(isa[amx] for amx in AMX):
        return target
    if not has_tools(target, ("llama-bench",)):
        return target  # nothing to run yet: checked once llama-bench is built
    if dies_of_sigill(target):
        print("ggml's AMX kernels die of SIGILL here: building again without AMX", flush=True)
        _amx_faults_mark(isa).touch()
        return ensure_tools(version, jobs, tools, variant)
    checked.touch()
    return target


def build_options(folder: Path) -> list[str]:
    """The CMake options a cached build was configured with (empty for a folder not ours)."""
    recorded = folder.parent / "cmake_options.txt"
    return recorded.read_text().split() if recorded.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", default=SDIST_VERSION, help="llama-cpp-python sdist version")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--server", action="store_true", help="build llama-server too")
    parser.add_argument("--quantize", action="store_true", help="build llama-quantize too")
    parser.add_argument("--blas", action="store_true", help="the build with the BLAS backend")
    args = parser.parse_args()
    tools = TOOLS + (SERVER if args.server else ()) + (QUANTIZE if args.quantize else ())
    print(ensure_tools(args.version, args.jobs, tools, "blas" if args.blas else "cpu"))


if __name__ == "__main__":
    main()
