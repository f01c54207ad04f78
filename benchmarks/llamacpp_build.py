"""Build llama.cpp's benchmark tools once, from the tree inside PyPI's ``llama-cpp-python`` sdist.

    python benchmarks/llamacpp_build.py              # prints the folder holding llama-bench
    python benchmarks/llamacpp_build.py --server     # ... and llama-server

The sdist comes from the package index pip is configured with (no other network access); its
``vendor/llama.cpp`` tree is configured with CMake (Release, CPU only, ``GGML_NATIVE`` for this
machine's instruction set, no OpenSSL, no tests) and only the tools asked for are built:
``llama-bench`` and ``llama-batched-bench`` for the engine benchmark, ``llama-server`` for the
serving comparison. The result lives in ``<cache>/llama.cpp/<version>/bin`` and is reused by every
later run; a build takes about 8 minutes on two cores (the server about as long again).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.gguf_cache import cache_root  # noqa: E402

SDIST_VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench")
SERVER = ("llama-server",)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
)


def tools_dir(version: str = SDIST_VERSION) -> Path:
    return cache_root() / "llama.cpp" / version / "bin"


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
    version: str = SDIST_VERSION, jobs: int | None = None, tools: tuple[str, ...] = TOOLS
) -> Path:
    """The folder holding ``tools`` (by default ``llama-bench`` and ``llama-batched-bench``),
    building those not there yet."""
    target = tools_dir(version)
    missing = tuple(tool for tool in tools if not has_tools(target, (tool,)))
    if not missing:
        return target
    work = target.parent / "work"
    log = target.parent / "build.log"
    tree = _extract_tree(_fetch_sdist(version, work), work)
    build = work / "build"
    print(
        f"building {', '.join(missing)} of llama.cpp {version} into {target} "
        f"(about 8 minutes on two cores; log {log})",
        flush=True,
    )
    _run(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_OPTIONS], log)
    jobs = jobs or os.cpu_count() or 1
    _run(["cmake", "--build", str(build), "--target", *missing, "-j", str(jobs)], log)
    target.mkdir(parents=True, exist_ok=True)
    for tool in missing:
        shutil.copy2(next(build.rglob(f"bin/{tool}")), target / tool)
    shutil.rmtree(work)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", default=SDIST_VERSION, help="llama-cpp-python sdist version")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--server", action="store_true", help="build llama-server too")
    args = parser.parse_args()
    print(ensure_tools(args.version, args.jobs, TOOLS + SERVER if args.server else TOOLS))


if __name__ == "__main__":
    main()
