"""What ``prompt_matmul_dtype`` runs: named dtypes as named, ``auto`` float32 (bfloat16 misses the
accuracy gate's top-1 floor); bfloat16 on a CPU whose bfloat16 GEMM would be emulated runs with a
warning, and where a GEMM run in a child faults, prompts stay float32."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine.kernels import isa


@pytest.fixture
def fresh_probe(monkeypatch):
    """The probe's verdict forgotten for the test (and restored after)."""
    monkeypatch.setattr(isa, "_bfloat16_gemm", None)


def test_named_dtypes_run_as_named_and_others_are_refused():
    cpu = torch.device("cpu")
    assert isa.resolved_prompt_matmul_dtype("float32", cpu) == "float32"
    assert isa.resolved_prompt_matmul_dtype("bfloat16", cpu) == "bfloat16"
    with pytest.raises(ValueError, match="prompt_matmul_dtype 'float16': one of auto"):
        isa.resolved_prompt_matmul_dtype("float16", cpu)


def test_auto_is_float32_on_every_device():
    assert isa.resolved_prompt_matmul_dtype("auto", torch.device("cpu")) == "float32"
    assert isa.resolved_prompt_matmul_dtype("auto", torch.device("cuda")) == "float32"


def test_the_gemm_is_native_where_torch_lists_bfloat16_instructions(fresh_probe):
    listed = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    # no faulting VM in CI: listed instructions run
    assert isa.bfloat16_gemm() == ("native" if listed else "emulated")


def test_bfloat16_where_torch_would_emulate_it_runs_with_a_warning(
    fresh_probe, monkeypatch, caplog
):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert isa.resolved_prompt_matmul_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    assert "torch emulates them" in caplog.text
    caplog.clear()
    assert isa.resolved_prompt_matmul_dtype("bfloat16", torch.device("cuda")) == "bfloat16"
    assert caplog.text == ""


def test_a_gemm_that_faults_kills_only_its_child_and_prompts_stay_float32(
    fresh_probe, monkeypatch, caplog
):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(
        isa, "_bfloat16_gemm_probe", lambda: os.kill(os.getpid(), signal.SIGILL) or True
    )
    assert isa.bfloat16_gemm() == "faulty"
    assert isa.resolved_prompt_matmul_dtype("bfloat16", torch.device("cpu")) == "float32"
    assert "prompts multiply in float32" in caplog.text


def test_the_probe_checks_the_product_it_computes(monkeypatch):
    assert isa._bfloat16_gemm_probe()  # emulated or not, torch's bfloat16 product is right
    wrong = torch.Tensor.__matmul__

    def off_by_one(a, b):
        return wrong(a, b) + 1

    monkeypatch.setattr(torch.Tensor, "__matmul__", off_by_one)
    assert not isa._bfloat16_gemm_probe()
