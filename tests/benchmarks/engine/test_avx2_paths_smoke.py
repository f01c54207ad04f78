"""``python -m benchmarks.engine.avx2_paths`` at toy size: the simd-only build really takes the
other path and computes the same products, and a run writes every case with its verdict."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.engine import avx2_paths
from engine.kernels.quantized import quantize, quantized_kernels

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def modules():
    shipped = quantized_kernels()
    if shipped is None or not shipped.avx2_supported():
        pytest.skip("needs the native kernels on a CPU with AVX2, FMA and F16C")
    return {"legacy": shipped, "simd": avx2_paths.simd_only_module()}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", avx2_paths.KINDS)
def test_the_simd_build_runs_a_vector_path_with_the_same_products(modules, kind, rows):
    torch.manual_seed(1)
    blocks, x = quantize(torch.randn(64, 96), kind).blocks, torch.randn(rows, 96)
    out = {}
    for side, module in modules.items():
        module.set_isa("avx2")
        out[side] = module.quantized_linear(x, blocks, kind)
    assert modules["simd"].__name__ != modules["legacy"].__name__
    torch.testing.assert_close(out["simd"], out["legacy"], rtol=1e-5, atol=1e-4)
    modules["simd"].set_isa("scalar")  # the scalar code sums in another order: not what ran
    assert not torch.equal(modules["simd"].quantized_linear(x, blocks, kind), out["simd"])


def test_a_toy_run_writes_every_case_with_its_verdict(modules, tmp_path, monkeypatch):
    monkeypatch.setattr(avx2_paths, "SHAPES", ((64, 96),))
    out = tmp_path / "avx2_paths.json"
    avx2_paths.main(["--scratch", "--out", str(out), "--rounds", "2", "--repeats", "4"])
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["goal"] == ">= 1.03x"
    names = [f"{kind} 64x96 M={rows}" for kind in avx2_paths.KINDS for rows in avx2_paths.ROWS]
    assert [key for key in result if key in names] == names
    for name in names:
        case = result[name]
        assert len(case["legacy_speedup"]["rounds"]) == 2 and case["verdict"] == "undecided"
        assert case["legacy_us"]["median"] > 0 and case["simd_us"]["median"] > 0
