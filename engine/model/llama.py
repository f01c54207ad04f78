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
from engine.kernels import cpu_kernels
from engine.model.forward_batch import ForwardBatch
from engine.model.paged_attention import paged_attention
from engine.model.rotary import RotaryEmbedding, apply_rotary


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
    """One decoder layer; matrices are stored transposed (``[in, out]``), which the CPU GEMM
    kernels run markedly faster than ``F.linear``'s ``[out, in]`` at the batch sizes we see."""

    input_norm: torch.Tensor
    qkv_t: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj_t: torch.Tensor
    post_norm: torch.Tensor
    gate_up_t: torch.Tensor
    down_t: torch.Tensor


class LlamaModel:
    """Holds the weights on the engine's device and runs one flattened step."""

    def __init__(
        self,
        hf_config: Any,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        native_kernels: bool = True,
    ) -> None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf_config.hidden_act!r} (only silu)")
        self.shape = ModelShape.from_hf_config(hf_config)
        self.eps = float(hf_config.rms_norm_eps)
        self.scale = self.shape.head_dim**-0.5
        put = _placer(weights, device, dtype)
        self.embed = put("model.embed_tokens.weight")
        self.layers = [self._layer(put, weights, i) for i in range(self.shape.num_layers)]
        self.norm = put("model.norm.weight")
        lm_head = put("lm_head.weight") if "lm_head.weight" in weights else self.embed
        self.lm_head_t = lm_head.t().contiguous()
        self.rotary = RotaryEmbedding(
            hf_config, self.shape.head_dim, self.shape.max_position_embeddings, device, dtype
        )
        use_native = native_kernels and device.type == "cpu" and dtype == torch.float32
        self.native = cpu_kernels() if use_native else None

    def _layer(self, put: Any, weights: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        has_bias = attn + "q_proj.bias" in weights
        return LayerWeights(
            input_norm=put(p + "input_layernorm.weight"),
            qkv_t=_transposed([put(attn + f"{n}_proj.weight") for n in "qkv"]),
            qkv_bias=torch.cat([put(attn + f"{n}_proj.bias") for n in "qkv"]) if has_bias else None,
            o_proj_t=_transposed([put(attn + "o_proj.weight")]),
            post_norm=put(p + "post_attention_layernorm.weight"),
            gate_up_t=_transposed([put(p + "mlp.gate_proj.weight"), put(p + "mlp.up_proj.weight")]),
            down_t=_transposed([put(p + "mlp.down_proj.weight")]),
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Run every layer, write this step's KV, and return fp32 logits ``[S, vocab]``.

        ``kv_caches[i]`` is layer i's ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        """
        hidden = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(batch.positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = hidden + self._attention(layer, hidden, batch, kv_cache, cos, sin)
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.post_norm, self.eps)
            gate, up = torch.mm(normed, layer.gate_up_t).chunk(2, dim=-1)
            hidden = hidden + torch.mm(F.silu(gate) * up, layer.down_t)
        last = hidden[batch.logits_indices]
        last = F.rms_norm(last, (last.shape[-1],), self.norm, self.eps)
        return torch.mm(last, self.lm_head_t).float()

    def _attention(
        self,
        layer: LayerWeights,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        s = self.shape
        tokens = hidden.shape[0]
        normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.eps)
        if layer.qkv_bias is None:
            qkv = torch.mm(normed, layer.qkv_t)
        else:
            qkv = torch.addmm(layer.qkv_bias, normed, layer.qkv_t)
        heads = qkv.view(tokens, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        rope_heads = s.num_heads + s.num_kv_heads  # queries and keys, rotated in one go
        heads[:, :rope_heads] = apply_rotary(heads[:, :rope_heads], cos, sin)
        q = heads[:, : s.num_heads]
        kv = heads[:, s.num_heads :].view(tokens, 2, s.num_kv_heads, s.head_dim).transpose(0, 1)
        out = paged_attention(q, kv, kv_cache, batch, self.scale, self.native)
        return torch.mm(out.reshape(tokens, s.num_heads * s.head_dim), layer.o_proj_t)


def _transposed(matrices: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(matrices).t().contiguous()


def _placer(weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    def put(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
        return weights[name].to(device=device, dtype=dtype).contiguous()

    return put
