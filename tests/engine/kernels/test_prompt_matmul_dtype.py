"""What ``prompt_matmul_dtype`` runs: named dtypes as named, ``auto`` bfloat16 only on a CPU
whose bfloat16 GEMM runs on its own instructions (probed in a child), float32 elsewhere."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine.kernels import isa


@pytest.fixture
def fresh_probe(monkeypatch):
    """The probe's verdict forgotten for the test (and restored after)."""
    monkeypatch.setattr(isa, "_bfloat16_gemm_runs", None)


def test_named_dtypes_run_as_named_and_others_are_refused():
    cpu = torch.device("cpu")
    assert isa.resolved_prompt_matmul_dtype("float32", cpu) == "float32"
    assert isa.resolved_prompt_matmul_dtype("bfloat16", cpu) == "bfloat16"
    with pytest.raises(ValueError, match="prompt_matmul_dtype 'float16': one of auto"):
        isa.resolved_prompt_matmul_dtype("float16", cpu)


def test_auto_is_float32_on_cuda_whatever_the_cpu():
    assert isa.resolved_prompt_matmul_dtype("auto", torch.device("cuda")) == "float32"


def test_auto_is_bfloat16_on_a_cpu_whose_bfloat16_gemm_runs(fresh_probe):
    runs = isa.bfloat16_gemm_runs()
    listed = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert runs == listed  # a CPU that lists the instructions runs them (no faulting VM in CI)
    expected = "bfloat16" if runs else "float32"
    assert isa.resolved_prompt_matmul_dtype("auto", torch.device("cpu")) == expected


def test_auto_is_float32_where_torch_would_emulate_bfloat16(fresh_probe, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert isa.resolved_prompt_matmul_dtype("auto", torch.device("cpu")) == "float32"


def test_a_probe_that_faults_kills_only_its_child_and_says_no(fresh_probe, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(
        isa, "_bfloat16_gemm_probe", lambda: os.kill(os.getpid(), signal.SIGILL) or True
    )
    assert not isa.bfloat16_gemm_runs()
    assert isa.resolved_prompt_matmul_dtype("auto", torch.device("cpu")) == "float32"


def test_the_probe_checks_the_product_it_computes(monkeypatch):
    assert isa._bfloat16_gemm_probe()  # emulated or not, torch's bfloat16 product is right
    wrong = torch.Tensor.__matmul__

    def off_by_one(a, b):
        return wrong(a, b) + 1

    monkeypatch.setattr(torch.Tensor, "__matmul__", off_by_one)
    assert not isa._bfloat16_gemm_probe()
