"""What ``pip install pdserve`` gets: the wheel built from this tree holds every package, the
native kernel sources and headers (enough to compile the kernels once installed), the generated
protobuf modules and the licence; and the generated modules are what ``protos/README.md``'s
command makes of ``protos/*.proto`` today.

The wheel is built offline (``pip wheel --no-build-isolation`` with the environment's setuptools)
from a copy of the tree, so the build leaves nothing behind in the repository: a few seconds.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_ROOTS = [
    p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
]
PROTO_DIR = "engine/transfer/proto"
VERSION_STAMP = re.compile(r"# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = '.*'|\s+\d+,")
SHIPPED_SUFFIXES = (".py", ".pyi", ".cpp", ".h")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for package in PACKAGE_ROOTS:
        shutil.copytree(ROOT / package, src / package, ignore=IGNORED)
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--quiet", "--wheel-dir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("pdserve-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


@cache
def source_files() -> list[str]:
    """Every source file (Python, stubs, the C++ kernels and their headers) of the packages in the
    tree."""
    return sorted(
        path.relative_to(ROOT).as_posix()
        for package in PACKAGE_ROOTS
        for path in (ROOT / package).rglob("*")
        if path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts
    )


def test_every_package_and_module_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    package_dirs = {str(Path(f).parent) for f in source_files() if f.endswith(".py")}
    for directory in package_dirs:
        assert f"{directory}/__init__.py" in names, f"{directory} is not a package in the wheel"
    missing = [f for f in source_files() if f not in names]
    assert not missing, f"files of the tree missing from the wheel: {missing}"


def test_the_native_kernel_source_ships(wheel):
    assert "engine/kernels/paged_attention_cpu.cpp" in wheel.namelist()
    shipped = wheel.read("engine/kernels/paged_attention_cpu.cpp")
    assert shipped == (ROOT / "engine/kernels/paged_attention_cpu.cpp").read_bytes()


# Run from outside the checkout with only the installed package on the path: compiles the kernel
# whose translation unit includes every header, then lists (``-M``, a preprocessor run with the
# build's include path and flags) the files every kernel source includes.
INSTALLED_KERNEL_CHECK = r"""
import json, subprocess
from pathlib import Path
import engine.kernels as kernels
from torch.utils.cpp_extension import include_paths
import sysconfig

here = Path(kernels.__file__).parent
module = kernels.build_extension(here / "decode_layers_cpu.cpp")
flags = [f"-I{p}" for p in [str(here), *include_paths(), sysconfig.get_paths()["include"]]]
includes = {}
for source in sorted(here.glob("*.cpp")):
    listed = subprocess.run(
        ["c++", "-std=c++17", *kernels._CFLAGS, *flags, "-M", str(source)],
        check=True, capture_output=True, text=True,
    ).stdout
    includes[source.name] = [word for word in listed.split()[1:] if word != "\\"]
print(json.dumps({"package": str(here), "library": module.__file__, "includes": includes}))
"""


@pytest.mark.slow
def test_the_installed_wheel_compiles_its_kernels(wheel, tmp_path):
    """``pip install`` of the wheel (not editable) is enough to build the native kernels: run with
    the installed package alone on the path (cwd outside the checkout), the kernel that includes
    every header compiles and imports, and every kernel source's own includes resolve to files
    of the installed package. Compiling all three would take minutes on a small machine; the one
    compile proves the toolchain path, the preprocessor runs prove no header is missing."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet"]
        + ["--target", str(target), str(wheel.filename)],
        check=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop("PDSERVE_NATIVE_KERNELS", None)
    result = subprocess.run(
        [sys.executable, "-c", INSTALLED_KERNEL_CHECK],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    package = target / "engine" / "kernels"
    assert Path(report["package"]) == package
    assert Path(report["library"]).is_relative_to(tmp_path / "ext")
    assert sorted(report["includes"]) == sorted(p.name for p in package.glob("*.cpp"))
    for source, included in report["includes"].items():
        local = [Path(p).resolve() for p in included if Path(p).name in _kernel_files()]
        assert local, f"{source} includes no kernel header"
        assert all(p.is_relative_to(package) for p in local), (source, local)


@cache
def _kernel_files() -> set[str]:
    return {p.name for p in (ROOT / "engine" / "kernels").iterdir() if p.suffix in (".h", ".cpp")}


def test_the_generated_protobuf_modules_ship(wheel):
    for name in ("kv_transfer_pb2.py", "kv_transfer_pb2_grpc.py", "kv_transfer_pb2.pyi"):
        assert f"{PROTO_DIR}/{name}" in wheel.namelist()


def test_metadata_licence_and_entry_points(wheel):
    info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    licence = wheel.read(f"{info}/licenses/LICENSE")
    assert licence == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in licence and b"END OF TERMS AND CONDITIONS" in licence
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "pdserve = coordinator.cli:main" in entry_points


def readme_protoc_command() -> list[str]:
    """The regeneration command of protos/README.md, as an argument list."""
    text = (ROOT / "protos" / "README.md").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("python -m grpc_tools.protoc")]
    return shlex.split(line)


def test_the_checked_in_protobuf_code_is_what_protos_readme_generates(tmp_path):
    """The command of protos/README.md, run with its outputs in a temporary directory, gives the
    checked-in modules."""
    command = [sys.executable]
    for arg in readme_protoc_command()[1:]:
        if arg.endswith("_out=."):
            arg = arg.removesuffix(".") + str(tmp_path)
        command += sorted(glob.glob(arg, root_dir=ROOT)) if "*" in arg else [arg]
    subprocess.run(command, cwd=ROOT, check=True, timeout=120)
    generated = sorted(p.name for p in (tmp_path / PROTO_DIR).iterdir())
    checked_in = sorted(p.name for p in (ROOT / PROTO_DIR).glob("*_pb2*"))
    assert generated == checked_in
    for name in generated:
        fresh = (tmp_path / PROTO_DIR / name).read_text()
        assert _body(fresh) == _body((ROOT / PROTO_DIR / name).read_text()), name


def test_runtime_floors_cover_the_generated_code():
    """Generated modules refuse to import on a protobuf or grpcio older than their generator."""
    dependencies = PYPROJECT["project"]["dependencies"]
    for module in (ROOT / PROTO_DIR).glob("*_pb2.py"):
        stamp = re.search(r"# Protobuf Python Version: (\S+)", module.read_text())
        assert f"protobuf>={stamp[1]}" in dependencies
    for module in (ROOT / PROTO_DIR).glob("*_pb2_grpc.py"):
        stamp = re.search(r"GRPC_GENERATED_VERSION = '(\S+)'", module.read_text())
        assert f"grpcio>={stamp[1]}" in dependencies


def _body(generated: str) -> list[str]:
    """Generated code less the lines that stamp the generator's version (the protobuf version and
    its major/minor/patch arguments, GRPC_GENERATED_VERSION): a newer grpcio-tools may stamp
    another on the same code."""
    return [line for line in generated.splitlines() if not VERSION_STAMP.fullmatch(line)]
