"""The native quantized-kernel module, built once per module, and each of its SIMD paths."""

from __future__ import annotations

import pytest

from engine import kernels
from engine.kernels import isa, quantized
from tests.support.prerequisites import require


@pytest.fixture(scope="module")
def native():
    """The module (a compile error fails every user), left as it was found: its ISA the
    probed one, float32 activations, batch invariance off."""
    missing = kernels.missing_toolchain()
    require(missing is None, f"{missing}: the native kernel cannot be built here")
    module = kernels.build_extension(quantized.SOURCE)
    yield module
    isa.apply_isa(module)
    module.set_activation_dtype("float32")
    module.set_batch_invariant(False)


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def native_path(request, native):
    """The native module, running the AVX-512, the AVX2 or the portable scalar path."""
    if request.param == "avx512" and not isa.avx512_runs(native):
        pytest.skip("AVX-512 F/BW/VL does not run here (cpuid or the probe says no)")
    if request.param == "avx2" and not native.avx2_supported():
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    native.set_isa(request.param)
    assert native.isa() == request.param
    yield native
    isa.apply_isa(native)
