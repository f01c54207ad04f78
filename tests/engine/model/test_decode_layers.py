"""The fused native decode layers against the op-by-op path: the same logits at every step (to
float32 rounding), the same greedy tokens and the same KV cache, for dense, int8 and int4
weights, with and without q/k/v biases, on every instruction-set path; and a GGUF K-quant mixture
(q5_0, q8_0, q6_k, q4_k projections, as llama-quantize writes them)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.kernels import isa as kernel_isa
from engine.kernels import quantized, set_activation_dtype
from engine.llm_engine import LLMEngine
from engine.model import decode_layers
from engine.model.linear import PartsLinear, QuantizedLinear
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams
from testbed.tiny_model import build_tiny_model
from tests.support.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(
    decode_layers.decode_layer_kernels() is None, reason="needs the native kernels"
)

PROMPTS = [[5 + i for i in range(n)] for n in (3, 9, 17, 30, 4)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return load_model(str(build_tiny_model(path, model_type=request.param, initializer_range=0.3)))


def _engine(
    loaded, weight_dtype: str, activation_dtype: str = "float32", kv_cache_dtype: str = "float32"
) -> LLMEngine:
    config = EngineConfig(
        model_path=str(loaded.path),
        device="cpu",
        weight_dtype=weight_dtype,
        activation_dtype=activation_dtype,
        kv_cache_dtype=kv_cache_dtype,
        cache=CacheConfig(block_size=4, num_blocks=128),
    )
    return LLMEngine(config, loaded)


def _run(engine: LLMEngine) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """Every step's logits, the tokens, and how many steps ran fused."""
    steps: list[torch.Tensor] = []
    fused = 0
    run, fusable = engine.runner.run, engine.model._fusable

    def recording_run(scheduled, *hooks):
        logits, samplers = run(scheduled, *hooks)
        steps.append(logits.clone())
        return logits, samplers

    def counting(batch):
        nonlocal fused
        taken = fusable(batch)
        fused += taken
        return taken

    engine.runner.run = recording_run
    engine.model._fusable = counting
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return steps, outputs, fused


@pytest.mark.parametrize(
    "weight_dtype, isa",
    # dense projections run torch's GEMM whatever the quantized kernels' path
    [
        ("fp32", "auto"),
        ("int8", "auto"),
        ("int4", "auto"),
        ("int8", "scalar"),
        ("int4", "scalar"),
        ("int8", "avx512"),
        ("int4", "avx512"),
    ],
)
def test_fused_decode_matches_op_by_op(loaded, weight_dtype, isa):
    module = decode_layers.decode_layer_kernels()
    if isa == "avx512" and not kernel_isa.avx512_runs(module):
        pytest.skip("AVX-512 F/BW/VL does not run here")
    module.set_isa(isa)
    try:
        fused = _engine(loaded, weight_dtype)
        plain = _engine(loaded, weight_dtype)
        plain.model.fused = None
        fused_steps, fused_tokens, fused_count = _run(fused)
        plain_steps, plain_tokens, plain_count = _run(plain)
    finally:
        kernel_isa.apply_isa(module)
    _assert_same_decode(fused, plain, fused_steps, plain_steps, fused_tokens, plain_tokens)
    assert fused_count >= 10 and plain_count == 0


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "int8"])
def test_fused_decode_on_a_16_bit_cache_matches_op_by_op(loaded, weight_dtype, kv_cache_dtype):
    """Both paths round keys and values to the cache's dtype as they store them and widen them
    as attention reads them (the fused layers in C++, the op-by-op path in torch)."""
    fused = _engine(loaded, weight_dtype, kv_cache_dtype=kv_cache_dtype)
    plain = _engine(loaded, weight_dtype, kv_cache_dtype=kv_cache_dtype)
    plain.model.fused = None
    assert fused.kv_cache.data.dtype == getattr(torch, kv_cache_dtype)
    fused_steps, fused_tokens, fused_count = _run(fused)
    plain_steps, plain_tokens, _ = _run(plain)
    # a value a hair either side of a 16-bit rounding boundary lands one step of that dtype
    # apart, and what later layers compute from it moves with it (more on 8-bit activations)
    tolerance = 1e-2 if kv_cache_dtype == "bfloat16" else 1e-3
    _assert_same_decode(
        fused,
        plain,
        fused_steps,
        plain_steps,
        fused_tokens,
        plain_tokens,
        tolerance,
        cache_atol=tolerance,
    )
    assert fused_count >= 10


def _assert_same_decode(
    fused,
    plain,
    fused_steps,
    plain_steps,
    fused_tokens,
    plain_tokens,
    tolerance=1e-4,
    cache_atol=1e-5,
):
    assert fused_tokens == plain_tokens
    assert len(fused_steps) == len(plain_steps)
    for ours, theirs in zip(fused_steps, plain_steps, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    for ours, theirs in zip(fused.kv_cache.layers, plain.kv_cache.layers, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=cache_atol)


# Each projection's GGUF kind in a K-quant mixture (256-weight kinds where k allows them); qkv
# keeps v in a format of its own, as Q4_K_M files do: one fused projection in two parts.
MIXTURE = {"qkv": ("q5_0", "q8_0"), "o_proj": "q8_0", "gate_up": "q6_k", "down": "q4_k"}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny llama whose hidden size (256) and MLP width (512) are whole K-quant blocks."""
    path = tmp_path_factory.mktemp("tiny-wide")
    return load_model(str(build_tiny_model(path, hidden_size=256, initializer_range=0.3)))


def _with_mixture(engine: LLMEngine, fused: bool) -> LLMEngine:
    """``engine`` with every projection replaced by random blocks of its ``MIXTURE`` kind."""
    shape = engine.model.shape
    v_rows = shape.num_kv_heads * shape.head_dim
    for index, layer in enumerate(engine.model.layers):
        for seed, (name, kind) in enumerate(MIXTURE.items()):
            old = getattr(layer, name)
            n, k = (old.weight_t.shape[1], old.weight_t.shape[0])
            if isinstance(kind, tuple):  # q and k rows in one format, v rows in another
                widths = zip(kind, (n - v_rows, v_rows), strict=True)
                parts = [
                    _random_linear(part_kind, rows, k, seed=100 * index + 10 * seed + i)
                    for i, (part_kind, rows) in enumerate(widths)
                ]
                setattr(layer, name, PartsLinear(parts, old.bias))
            else:
                linear = _random_linear(kind, n, k, seed=10 * index + seed)
                setattr(layer, name, QuantizedLinear(linear.weight, old.bias))
    engine.model.fused = decode_layers.fuse_layers(engine.model) if fused else None
    return engine


def _random_linear(kind: str, n: int, k: int, seed: int) -> QuantizedLinear:
    blocks = random_blocks(kind, n, k, seed=seed, scales=(1e-4, 1e-3))
    return QuantizedLinear(quantized.from_gguf_blocks(blocks, kind, n, k))


def test_fused_decode_on_a_kquant_mixture(wide):
    fused = _with_mixture(_engine(wide, "fp32"), fused=True)
    plain = _with_mixture(_engine(wide, "fp32"), fused=False)
    assert fused.model.fused is not None
    fused_steps, fused_tokens, fused_count = _run(fused)
    plain_steps, plain_tokens, plain_count = _run(plain)
    _assert_same_decode(fused, plain, fused_steps, plain_steps, fused_tokens, plain_tokens)
    assert fused_count >= 10 and plain_count == 0


def test_fused_decode_on_8_bit_activations(wide):
    """``activation_dtype: int8``: the fused layers quantize each projection's input as the
    op-by-op path does (the same logits to float32 rounding of x, the same tokens), and differ
    from float32 activations."""
    try:
        fused = _with_mixture(_engine(wide, "fp32", "int8"), fused=True)
        plain = _with_mixture(_engine(wide, "fp32", "int8"), fused=False)
        assert fused.activation_dtype == "int8"
        fused_steps, fused_tokens, fused_count = _run(fused)
        plain_steps, plain_tokens, _ = _run(plain)
        float32 = _with_mixture(_engine(wide, "fp32", "float32"), fused=True)
        float32_steps, _, _ = _run(float32)
    finally:
        set_activation_dtype("float32")
    _assert_same_decode(fused, plain, fused_steps, plain_steps, fused_tokens, plain_tokens)
    assert fused_count >= 10
    decode_steps = range(1, len(fused_steps))  # the first step computes prompts, in float32
    assert any(not torch.equal(fused_steps[i], float32_steps[i]) for i in decode_steps)


def test_more_rows_than_the_fused_limit_run_op_by_op(loaded):
    engine = _engine(loaded, "fp32")
    limit = decode_layers.FUSED_MAX_ROWS
    prompts = [[7, 8, 9 + i % 50] for i in range(limit + 1)]
    fused_steps = []
    fusable = engine.model._fusable
    engine.model._fusable = lambda batch: fused_steps.append(fusable(batch)) or fused_steps[-1]
    engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert fused_steps and not any(fused_steps)  # 33 decodes per step: none fused


def test_describe_names_the_decode_path(loaded):
    engine = _engine(loaded, "int8")
    assert engine.model.describe().endswith("fused decode layers")
    engine.model.fused = None
    assert engine.model.describe().endswith("op-by-op decode")
