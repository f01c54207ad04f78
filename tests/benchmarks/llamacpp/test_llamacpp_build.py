"""The llama.cpp build's instruction sets: chosen from what the CPU executes (stand-in probe
results for the CPUs these benchmarks meet), never from cpuid or GGML_NATIVE; and the probe
itself, on this machine and on a program that faults."""

from __future__ import annotations

import platform
import shutil

import pytest

from benchmarks.harness import cpu_isa
from benchmarks.harness.cpu_isa import consistent, ggml_cmake_flags, isa_tag
from benchmarks.llamacpp import build as llamacpp_build

ZEN3 = {"avx": True, "avx2": True, "fma": True, "f16c": True, "bmi2": True}
# AVX-512 with VNNI and BF16 executing; AMX listed by cpuid, but its probe faults (or the kernel
# refuses the tile state), so it is False
XEON = ZEN3 | dict.fromkeys(
    ("avx_vnni", "avx512", "avx512_vbmi", "avx512_vnni", "avx512_bf16"), True
)
XEON_AMX_FAULTS = XEON | {"amx_tile": False, "amx_int8": False, "amx_bf16": False}


def _options(isa: dict[str, bool]) -> dict[str, str]:
    return dict(flag.removeprefix("-D").split("=") for flag in ggml_cmake_flags(isa))


def test_zen3_builds_avx2_and_nothing_of_avx512():
    options = _options(ZEN3)
    assert options["GGML_NATIVE"] == "OFF"
    assert {options[k] for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")} == {"ON"}
    assert {options[k] for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AMX_TILE")} == {"OFF"}


def test_a_xeon_whose_amx_faults_builds_avx512_vnni_bf16_without_amx():
    options = _options(XEON_AMX_FAULTS)
    assert options["GGML_AVX512"] == options["GGML_AVX512_VNNI"] == "ON"
    assert options["GGML_AVX512_BF16"] == "ON"
    assert options["GGML_AMX_TILE"] == options["GGML_AMX_INT8"] == options["GGML_AMX_BF16"] == "OFF"
    assert isa_tag(XEON_AMX_FAULTS).endswith("avx512vnni-avx512bf16")
    assert isa_tag(ZEN3) != isa_tag(XEON_AMX_FAULTS)  # each build in a folder of its own


def test_an_extension_without_its_base_is_left_out():
    # AMX instructions that run without AVX-512 (no such CPU), VNNI-512 without AVX-512F
    odd = ZEN3 | {"amx_tile": True, "avx512_vnni": True}
    assert not consistent(odd)["amx_tile"] and not consistent(odd)["avx512_vnni"]


def test_the_blas_variant_adds_openblas_and_the_folder_names_variant_and_isa(monkeypatch):
    monkeypatch.setattr(llamacpp_build, "probe_isa", lambda: ZEN3)
    blas = llamacpp_build.cmake_options("blas", ZEN3)
    assert "-DGGML_BLAS=ON" in blas and "-DGGML_BLAS_VENDOR=OpenBLAS" in blas
    assert "-DGGML_BLAS=OFF" in llamacpp_build.cmake_options("cpu", ZEN3)
    assert "-DGGML_NATIVE=ON" not in blas
    assert llamacpp_build.tools_dir("0.3.36", "blas").parent.name == "0.3.36-blas-" + isa_tag(ZEN3)
    with pytest.raises(ValueError, match="variant"):
        llamacpp_build.cmake_options("cuda", ZEN3)


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("cc"), reason="x86 + cc")
def test_the_probe_runs_what_it_names_and_a_faulting_program_is_not_granted(monkeypatch):
    assert cpu_isa.executes("avx2")  # every machine these benchmarks run on executes AVX2
    monkeypatch.setitem(cpu_isa.PROBES, "avx2", ("-mavx2", "", "__builtin_trap();"))  # SIGILL
    assert not cpu_isa.executes("avx2")
    monkeypatch.setitem(cpu_isa.PROBES, "avx2", ("-mno-such-flag", "", "return 0;"))
    assert not cpu_isa.executes("avx2")  # does not compile: not granted either


def _stand_in_build(folder, body: str) -> None:
    """A build folder whose ``llama-bench`` is a script running ``body``."""
    folder.mkdir(parents=True)
    bench = folder / "llama-bench"
    bench.write_text(f"#!/bin/sh\n{body}\n")
    bench.chmod(0o755)


def test_a_build_with_amx_that_dies_of_sigill_is_replaced_by_one_without(monkeypatch, tmp_path):
    """A Xeon whose AMX probes all run while ggml's AMX kernels die on their first tile load:
    the AMX build is run once, dies of SIGILL, AMX is marked as faulting here, and from then on
    the build without AMX is the one used."""
    xeon_amx = XEON | {"amx_tile": True, "amx_int8": True, "amx_bf16": True}
    monkeypatch.setattr(llamacpp_build, "probe_isa", lambda: xeon_amx)
    monkeypatch.setattr(llamacpp_build, "cache_root", lambda: tmp_path)
    with_amx = llamacpp_build.tools_dir()
    _stand_in_build(with_amx, 'kill -ILL "$$"')
    _stand_in_build(tmp_path / "llama.cpp" / f"0.3.36-cpu-{isa_tag(XEON)}" / "bin", "exit 0")
    assert llamacpp_build.dies_of_sigill(with_amx)
    without_amx = llamacpp_build.ensure_tools(tools=("llama-bench",))
    assert without_amx.parent.name == f"0.3.36-cpu-{isa_tag(XEON)}"
    assert llamacpp_build.tools_dir() == without_amx
    assert llamacpp_build.build_isa()["amx_int8"] is False


def test_a_build_with_amx_that_runs_is_kept_and_checked_once(monkeypatch, tmp_path):
    xeon_amx = XEON | {"amx_tile": True, "amx_int8": True, "amx_bf16": True}
    monkeypatch.setattr(llamacpp_build, "probe_isa", lambda: xeon_amx)
    monkeypatch.setattr(llamacpp_build, "cache_root", lambda: tmp_path)
    with_amx = llamacpp_build.tools_dir()
    runs = tmp_path / "runs"
    _stand_in_build(with_amx, f'echo run >> "{runs}"')
    assert llamacpp_build.ensure_tools(tools=("llama-bench",)) == with_amx
    assert llamacpp_build.ensure_tools(tools=("llama-bench",)) == with_amx
    assert runs.read_text() == "run\n"
