"""Rotary position embeddings, precomputed as cos/sin tables indexed by position."""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ModelLoadError


def inverse_frequencies(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` for the config's RoPE type, as transformers computes it."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    if rope_type == "dynamic":
        raise ModelLoadError(
            "rope_type 'dynamic' is not supported (its frequencies change with length)"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))


class RotaryEmbedding:
    """Applies RoPE (the rotate-half convention of Llama checkpoints) to queries and keys."""

    def __init__(
        self,
        hf_config: Any,
        head_dim: int,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for this step's tokens, shaped to broadcast over heads: ``[T, 1, D]``."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1),
            self.sin.index_select(0, positions).unsqueeze(1),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[T, heads, D]``; the rotate-half convention of Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
