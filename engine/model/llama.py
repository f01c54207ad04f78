"""Our forward pass for the Llama family (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights are fused at load time (q/k/v into one matrix, gate/up into one) so each layer runs four
matmuls. Only the rows named by ``logits_indices`` go through the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model.forward_batch import ForwardBatch
from engine.model.paged_attention import paged_attention
from engine.model.rotary import RotaryEmbedding


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the KV cache and the transfer handshake depend on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
        )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    """Holds the weights on the engine's device and runs one flattened step."""

    def __init__(self, hf_config: Any, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf_config.hidden_act!r} (only silu)")
        self.shape = ModelShape.from_hf_config(hf_config)
        self.eps = float(hf_config.rms_norm_eps)
        self.scale = self.shape.head_dim**-0.5
        put = _placer(weights, device, dtype)
        self.embed = put("model.embed_tokens.weight")
        self.layers = [self._layer(put, weights, i) for i in range(self.shape.num_layers)]
        self.norm = put("model.norm.weight")
        self.lm_head = put("lm_head.weight") if "lm_head.weight" in weights else self.embed
        self.rotary = RotaryEmbedding(
            hf_config, self.shape.head_dim, self.shape.max_position_embeddings, device, dtype
        )

    def _layer(self, put: Any, weights: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        has_bias = attn + "q_proj.bias" in weights
        return LayerWeights(
            input_norm=put(p + "input_layernorm.weight"),
            qkv=torch.cat([put(attn + f"{n}_proj.weight") for n in "qkv"]),
            qkv_bias=torch.cat([put(attn + f"{n}_proj.bias") for n in "qkv"]) if has_bias else None,
            o_proj=put(attn + "o_proj.weight"),
            post_norm=put(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([put(p + "mlp.gate_proj.weight"), put(p + "mlp.up_proj.weight")]),
            down=put(p + "mlp.down_proj.weight"),
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        """Run every layer, write this step's KV, and return fp32 logits ``[S, vocab]``."""
        hidden = F.embedding(batch.input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = hidden + self._attention(layer, hidden, batch, k_cache, v_cache)
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.post_norm, self.eps)
            gate, up = F.linear(normed, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
        last = hidden[batch.logits_indices]
        last = F.rms_norm(last, (last.shape[-1],), self.norm, self.eps)
        return F.linear(last, self.lm_head).float()

    def _attention(self, layer: LayerWeights, hidden: torch.Tensor, batch: ForwardBatch,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        s = self.shape
        normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.eps)
        qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        tokens = hidden.shape[0]
        q = q.view(tokens, s.num_heads, s.head_dim)
        k = k.view(tokens, s.num_kv_heads, s.head_dim)
        v = v.reshape(tokens, s.num_kv_heads, s.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        out = paged_attention(q, k, v, k_cache, v_cache, batch, self.scale)
        return F.linear(out.reshape(tokens, q_size), layer.o_proj)


def _placer(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    def put(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
        return weights[name].to(device=device, dtype=dtype).contiguous()

    return put
