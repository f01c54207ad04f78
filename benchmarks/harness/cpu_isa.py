"""Which x86 instruction-set extensions this CPU really executes, probed by running them.

cpuid is not enough: a virtual machine may list AMX while its instructions fault (SIGILL), and
``GGML_NATIVE`` trusts the compiler's ``-march=native``, which trusts cpuid. Each extension here is
a tiny C program using one of its instructions, compiled with its ``-m`` flag and run in a child
process: the extension counts only if the program exits 0. AMX also needs the kernel's permission
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) before its first tile instruction.

    python -m benchmarks.harness.cpu_isa   # what executes here, and the llama.cpp CMake flags
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_MAIN = "int main(void) {{ {body} }}\n"
_AMX_PERMISSION = """
#include <sys/syscall.h>
#include <unistd.h>
static int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
static struct { unsigned char palette, start; unsigned char pad[14];
                unsigned short colsb[16]; unsigned char rows[16]; } cfg;
static void tiles(void) {
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}
"""

# extension -> (gcc flags, declarations, body of main returning 0 when the instruction ran)
PROBES: dict[str, tuple[str, str, str]] = {
    "avx": ("-mavx", "", "volatile float a = 1; __m256 v = _mm256_set1_ps(a);"
            " v = _mm256_add_ps(v, v); return _mm256_cvtss_f32(v) == 2 ? 0 : 1;"),
    "avx2": ("-mavx2", "", "volatile int a = 1; __m256i v = _mm256_set1_epi32(a);"
             " v = _mm256_add_epi32(v, v); return _mm256_extract_epi32(v, 0) == 2 ? 0 : 1;"),
    "fma": ("-mfma", "", "volatile float a = 1; __m256 v = _mm256_set1_ps(a);"
            " v = _mm256_fmadd_ps(v, v, v); return _mm256_cvtss_f32(v) == 2 ? 0 : 1;"),
    "f16c": ("-mf16c", "", "volatile unsigned short h = 0x3c00;"
             " __m128 v = _mm_cvtph_ps(_mm_set1_epi16(h)); return _mm_cvtss_f32(v) == 1 ? 0 : 1;"),
    "bmi2": ("-mbmi2", "", "volatile unsigned a = 5; return _pdep_u32(a, 0xff) == 5 ? 0 : 1;"),
    "avx_vnni": ("-mavxvnni", "", "volatile int a = 1; __m256i v = _mm256_set1_epi32(a);"
                 " v = _mm256_dpbusd_avx_epi32(v, v, v);"
                 " return _mm256_extract_epi32(v, 0) == 2 ? 0 : 1;"),
    "avx512": ("-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw", "",
               "volatile int a = 1; __m512i v = _mm512_set1_epi32(a);"
               " v = _mm512_add_epi32(v, v); __m512i b = _mm512_set1_epi8((char)a);"
               " b = _mm512_add_epi8(b, b); __m256i h = _mm256_maskz_add_epi32(0xff,"
               " _mm256_set1_epi32(a), _mm256_set1_epi32(a));"
               " return _mm512_reduce_add_epi32(v) == 32 && _mm256_extract_epi32(h, 0) == 2"
               " && _mm512_reduce_add_epi32(b) == 0x02020202 * 16 ? 0 : 1;"),
    "avx512_vbmi": ("-mavx512f -mavx512vbmi", "", "volatile char a = 1;"
                    " __m512i v = _mm512_set1_epi8(a); v = _mm512_permutexvar_epi8(v, v);"
                    " return _mm512_reduce_add_epi32(v) == 0x01010101 * 16 ? 0 : 1;"),
    "avx512_vnni": ("-mavx512f -mavx512vnni", "", "volatile int a = 1;"
                    " __m512i v = _mm512_set1_epi32(a); v = _mm512_dpbusd_epi32(v, v, v);"
                    " return _mm512_reduce_add_epi32(v) == 32 ? 0 : 1;"),
    "avx512_bf16": ("-mavx512f -mavx512bf16", "", "volatile float a = 1;"
                    " __m512 v = _mm512_set1_ps(a); __m512bh b = _mm512_cvtne2ps_pbh(v, v);"
                    " v = _mm512_dpbf16_ps(v, b, b);"
                    " return _mm512_reduce_add_ps(v) == 48 ? 0 : 1;"),
    "amx_tile": ("-mamx-tile", _AMX_PERMISSION,
                 "if (!amx_permitted()) return 2; tiles(); _tile_zero(0);"
                 " _tile_release(); return 0;"),
    "amx_int8": ("-mamx-tile -mamx-int8", _AMX_PERMISSION,
                 "if (!amx_permitted()) return 2; tiles(); _tile_zero(0); _tile_zero(1);"
                 " _tile_zero(2); _tile_dpbssd(0, 1, 2); _tile_release(); return 0;"),
    "amx_bf16": ("-mamx-tile -mamx-bf16", _AMX_PERMISSION,
                 "if (!amx_permitted()) return 2; tiles(); _tile_zero(0); _tile_zero(1);"
                 " _tile_zero(2); _tile_dpbf16ps(0, 1, 2); _tile_release(); return 0;"),
}  # fmt: skip

# llama.cpp's CMake switch for each extension (GGML_AVX512 is F, CD, VL, DQ and BW together)
GGML_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512": "GGML_AVX512",
    "avx512_vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "amx_tile": "GGML_AMX_TILE",
    "amx_int8": "GGML_AMX_INT8",
    "amx_bf16": "GGML_AMX_BF16",
}
# an extension counts only with those it builds on (ggml's kernels assume them)
REQUIRES = {
    "avx2": ("avx",),
    "fma": ("avx",),
    "f16c": ("avx",),
    "avx_vnni": ("avx2",),
    "avx512": ("avx2", "fma", "f16c"),
    "avx512_vbmi": ("avx512",),
    "avx512_vnni": ("avx512",),
    "avx512_bf16": ("avx512",),
    "amx_tile": ("avx512",),
    "amx_int8": ("amx_tile",),
    "amx_bf16": ("amx_tile",),
}


def _source(declarations: str, body: str) -> str:
    return "#include <immintrin.h>\n" + declarations + _MAIN.format(body=body)


def executes(extension: str, compiler: str = "cc") -> bool:
    """Whether a program using ``extension`` compiles here and runs to a clean exit."""
    flags, declarations, body = PROBES[extension]
    with tempfile.TemporaryDirectory(prefix="pdserve-isa-") as folder:
        source, binary = Path(folder) / "probe.c", Path(folder) / "probe"
        source.write_text(_source(declarations, body))
        built = subprocess.run(
            [compiler, "-O1", *flags.split(), str(source), "-o", str(binary)],
            capture_output=True,
            check=False,
        )
        if built.returncode != 0:
            return False
        try:
            ran = subprocess.run([str(binary)], capture_output=True, check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return ran.returncode == 0


def consistent(found: Mapping[str, bool]) -> dict[str, bool]:
    """``found`` with every extension whose prerequisites are missing turned off."""
    kept: dict[str, bool] = {}
    for extension in GGML_OPTIONS:
        needs = REQUIRES.get(extension, ())
        kept[extension] = bool(found.get(extension)) and all(kept.get(n) for n in needs)
    return kept


@functools.cache
def probe_isa(compiler: str = "cc") -> dict[str, bool]:
    """Every extension of ``GGML_OPTIONS``: True where this CPU executes it (and its
    prerequisites); the probes compile and run a core each at a time."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return dict.fromkeys(GGML_OPTIONS, False)
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        runs = pool.map(lambda extension: executes(extension, compiler), GGML_OPTIONS)
        return consistent(dict(zip(GGML_OPTIONS, runs, strict=True)))


def ggml_cmake_flags(isa: Mapping[str, bool]) -> list[str]:
    """llama.cpp's CMake options for a build that uses exactly the extensions ``isa`` grants:
    ``GGML_NATIVE=OFF`` and every switch set on or off explicitly."""
    kept = consistent(isa)
    return ["-DGGML_NATIVE=OFF"] + [
        f"-D{option}={'ON' if kept[extension] else 'OFF'}"
        for extension, option in GGML_OPTIONS.items()
    ]


def isa_tag(isa: Mapping[str, bool]) -> str:
    """A short name for a set of extensions, for folder names: ``avx2-fma-f16c-...``."""
    names = [extension.replace("_", "") for extension, on in consistent(isa).items() if on]
    return "-".join(names) or "baseline"


def cpuid_flags() -> list[str]:
    """The ISA flags the kernel lists for CPU 0 (from cpuid), the interesting ones only."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    wanted = ("avx", "fma", "f16c", "bmi2", "amx", "vnni", "bf16", "sse4_2")
    return sorted(flag for flag in line.split(":", 1)[-1].split() if flag.startswith(wanted))


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else platform's word)."""
    try:
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith("model name"):
                return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    isa = probe_isa()
    print(json.dumps({"cpu": cpu_model(), "cpuid": cpuid_flags(), "executes": isa}, indent=2))
    print(" ".join(ggml_cmake_flags(isa)), file=sys.stderr)


if __name__ == "__main__":
    main()
