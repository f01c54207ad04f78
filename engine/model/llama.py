"""Our forward pass for the Llama family (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights are fused at load time (q/k/v into one matrix, gate/up into one) so each layer runs four
matmuls, dense or on quantized blocks (``linear.py``, ``weight_dtype``). Only the rows named by
``logits_indices`` go through the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.kernels import cpu_kernels, set_batch_invariant
from engine.kernels.isa import batch_invariant as kernels_batch_invariant
from engine.kernels.quantized import from_gguf_blocks
from engine.model.decode_layers import FUSED_MAX_ROWS, fuse_layers
from engine.model.forward_batch import ForwardBatch
from engine.model.gguf_weights import GGUFMatrix
from engine.model.linear import (
    WEIGHT_DTYPES,
    Linear,
    PartsLinear,
    QuantizedLinear,
    dense,
    mixed,
    quantized,
)
from engine.model.paged_attention import paged_attention
from engine.model.rotary import RotaryEmbedding, apply_rotary
from engine.model.token_embedding import DenseEmbedding, QuantizedEmbedding, TokenEmbedding


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
    """One decoder layer."""

    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    """Holds the weights on the engine's device and runs one flattened step."""

    def __init__(
        self,
        hf_config: Any,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        native_kernels: bool = True,
        weight_dtype: str = "fp32",
        gguf: dict[str, GGUFMatrix] | None = None,
        prompt_matmul_dtype: str = "float32",
    ) -> None:
        """``weight_dtype`` (``linear.WEIGHT_DTYPES``) and ``gguf``, the GGUF's own blocks
        (``auto`` computes with them on the CPU in fp32), choose the linear layers;
        ``prompt_matmul_dtype`` what the quantized ones multiply prompts in."""
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hf_config.hidden_act!r} (only silu)")
        self.shape = ModelShape.from_hf_config(hf_config)
        self.eps = float(hf_config.rms_norm_eps)
        self.scale = self.shape.head_dim**-0.5
        put = _placer(weights, device, dtype)
        self.weights = _weight_mode(weight_dtype, gguf, device, dtype)
        # Local, not kept: the float32 weights the quantized layers replace are freed with it.
        linear = _linear_maker(self.weights, put, gguf or {})
        self.layers = [_layer(put, linear, weights, i) for i in range(self.shape.num_layers)]
        self.norm = put("model.norm.weight")
        tied = "lm_head.weight" not in weights
        self.lm_head = linear(["model.embed_tokens.weight" if tied else "lm_head.weight"])
        self.embed = _embedding(self.weights, put, gguf or {}, self.lm_head if tied else None)
        self._set_prompt_matmul_dtype(getattr(torch, prompt_matmul_dtype))
        self.rotary = RotaryEmbedding(
            hf_config, self.shape.head_dim, self.shape.max_position_embeddings, device, dtype
        )
        use_native = native_kernels and device.type == "cpu" and dtype == torch.float32
        self.native = cpu_kernels() if use_native else None
        self.fused = fuse_layers(self) if use_native else None
        # every decode row computed as it would be alone (set_batch_invariant)
        self.batch_invariant = False

    def set_batch_invariant(self, on: bool) -> bool:
        """Compute each decode row's logits independently of the rows beside it: decode rows
        always on the fused native layers (apart from any prompt chunk of their step), the
        kernels summing a lone row as a tile's (the native modules' choice, which every forward
        sets as its model's) and the LM head row by row. Needs those layers; returns whether it
        is on."""
        self.batch_invariant = on and self.fused is not None
        return self.batch_invariant

    def _set_prompt_matmul_dtype(self, dtype: torch.dtype) -> None:
        linears = [lin for layer in self.layers for lin in _linears(layer)] + [self.lm_head]
        for linear in linears:
            for part in linear.parts if isinstance(linear, PartsLinear) else [linear]:
                if isinstance(part, QuantizedLinear):
                    part.gemm_dtype = dtype

    def describe(self) -> str:
        """Which weights the linear layers compute with, for logs and ``/info``."""
        linears = [lin for layer in self.layers for lin in _linears(layer)]
        kinds = sorted({kind for lin in linears for kind in lin.kind.split("+")})
        step = "fused decode layers" if self.fused is not None else "op-by-op decode"
        if any(getattr(lin, "gemm_dtype", None) == torch.bfloat16 for lin in linears):
            step += ", prompts in bfloat16"
        if self.batch_invariant:
            step += ", batch invariant"
        return (
            f"weights {self.weights}: layers {'+'.join(kinds)}, LM head {self.lm_head.kind}, {step}"
        )

    def weight_formats(self) -> dict[str, str]:
        """Each tensor group's format, for ``/v1/instances``: ``{"qkv": "q5_0+q8_0", "down":
        "q4_k | q6_k", ...}`` (``+``: parts of one fused projection; ``|``: differing layers)."""
        groups: dict[str, Any] = {"embedding": [self.embed.kind]}
        for group, index in (("qkv", 0), ("o_proj", 1), ("gate_up", 2), ("down", 3)):
            groups[group] = [_linears(layer)[index].kind for layer in self.layers]
        groups["lm_head"] = [self.lm_head.kind]
        return {group: " | ".join(dict.fromkeys(kinds)) for group, kinds in groups.items()}

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Run every layer, write this step's KV, and return fp32 logits ``[S, vocab]``.

        ``kv_caches[i]`` is layer i's ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        """
        if kernels_batch_invariant() != self.batch_invariant:  # a process-wide choice
            set_batch_invariant(self.batch_invariant)
        hidden = self.embed(batch.input_ids)
        decodes = batch.num_decode_tokens
        if self._fusable(batch):
            self._fused_decode(hidden, batch, kv_caches)
        elif self.batch_invariant and decodes:  # the decode rows apart from the prompt chunks
            decode_rows = hidden[:decodes]
            self._fused_decode(decode_rows, batch, kv_caches)
            prompts = self._layers(hidden[decodes:], batch.prompt_chunks(), kv_caches)
            hidden = torch.cat([decode_rows, prompts])
        else:
            hidden = self._layers(hidden, batch, kv_caches)
        last = hidden[batch.logits_indices]
        last = F.rms_norm(last, (last.shape[-1],), self.norm, self.eps)
        rowwise = self.batch_invariant and last.shape[0] > 1
        logits = self.lm_head.rowwise(last) if rowwise else self.lm_head(last)
        return logits.float()

    def _fused_decode(
        self, hidden: torch.Tensor, batch: ForwardBatch, kv_caches: list[torch.Tensor]
    ) -> None:
        """The fused native layers over ``hidden``, the step's decode rows (updated in place)."""
        assert self.fused is not None
        rows = hidden.shape[0]
        self.fused.forward(
            hidden,
            batch.positions[:rows],
            batch.slot_mapping[:rows],
            batch.decode_block_tables,
            batch.decode_context_lens,
            kv_caches,
        )

    def _fusable(self, batch: ForwardBatch) -> bool:
        """A decode-only step the fused native layers take (any size where batch invariant)."""
        decodes = batch.num_decode_tokens
        return (
            self.fused is not None
            and not batch.prefill_seqs
            and decodes > 0
            and (decodes <= FUSED_MAX_ROWS or self.batch_invariant)
            and decodes == batch.input_ids.shape[0]
        )

    def _layers(
        self, hidden: torch.Tensor, batch: ForwardBatch, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """Every decoder layer, op by op."""
        cos, sin = self.rotary.cos_sin(batch.positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = hidden + self._attention(layer, hidden, batch, kv_cache, cos, sin)
            normed = F.rms_norm(hidden, (hidden.shape[-1],), layer.post_norm, self.eps)
            gate, up = layer.gate_up(normed).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return hidden

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
        qkv = layer.qkv(normed)
        heads = qkv.view(tokens, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        rope_heads = s.num_heads + s.num_kv_heads  # queries and keys, rotated in one go
        heads[:, :rope_heads] = apply_rotary(heads[:, :rope_heads], cos, sin)
        q = heads[:, : s.num_heads]
        kv = heads[:, s.num_heads :].view(tokens, 2, s.num_kv_heads, s.head_dim).transpose(0, 1)
        out = paged_attention(q, kv, kv_cache, batch, self.scale, self.native)
        return layer.o_proj(out.reshape(tokens, s.num_heads * s.head_dim))


def _layer(put: Any, linear: Any, weights: Mapping[str, torch.Tensor], i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    has_bias = attn + "q_proj.bias" in weights
    qkv_bias = torch.cat([put(attn + f"{n}_proj.bias") for n in "qkv"]) if has_bias else None
    return LayerWeights(
        input_norm=put(p + "input_layernorm.weight"),
        qkv=linear([attn + f"{n}_proj.weight" for n in "qkv"], qkv_bias),
        o_proj=linear([attn + "o_proj.weight"]),
        post_norm=put(p + "post_attention_layernorm.weight"),
        gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
        down=linear([p + "mlp.down_proj.weight"]),
    )


def _linears(layer: LayerWeights) -> tuple[Linear, ...]:
    return layer.qkv, layer.o_proj, layer.gate_up, layer.down


def _weight_mode(
    weight_dtype: str,
    gguf: dict[str, GGUFMatrix] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> str:
    """``gguf`` (the file's own blocks), ``fp32`` (dense, in ``dtype``), ``int8`` or ``int4``."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ModelLoadError(
            f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}; got {weight_dtype!r}"
        )
    on_cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if weight_dtype == "auto":
        return "gguf" if gguf and on_cpu_fp32 else "fp32"
    if weight_dtype in ("int8", "int4") and not on_cpu_fp32:
        raise ModelLoadError(
            f"weight_dtype {weight_dtype} runs on the CPU in float32; got {device.type}, {dtype}"
        )
    return weight_dtype


def _linear_maker(mode: str, put: Any, gguf: dict[str, GGUFMatrix]) -> Any:
    """``(names, bias) -> Linear`` for ``mode``; a GGUF matrix in a block format the kernels
    lack is computed dense (``read_quantized`` has logged its format)."""

    def make(names: list[str], bias: torch.Tensor | None = None) -> Linear:
        if mode == "gguf" and any(n in gguf for n in names):
            return mixed([gguf[n] if n in gguf else put(n) for n in names], bias)
        if mode in ("int8", "int4"):
            return quantized([put(n) for n in names], mode, bias)
        return dense([put(n) for n in names], bias)

    return make


def _embedding(
    mode: str, put: Any, gguf: dict[str, GGUFMatrix], tied_head: Linear | None
) -> TokenEmbedding:
    """The token table: the GGUF's blocks (shared with a tied LM head), else dense."""
    name = "model.embed_tokens.weight"
    if mode != "gguf" or name not in gguf:
        return DenseEmbedding(put(name))
    if isinstance(tied_head, QuantizedLinear):
        return QuantizedEmbedding(tied_head.weight)
    table = gguf[name]
    return QuantizedEmbedding(from_gguf_blocks(table.blocks, table.kind, table.rows, table.cols))


def _placer(weights: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    def put(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
        return weights[name].to(device=device, dtype=dtype).contiguous()

    return put
