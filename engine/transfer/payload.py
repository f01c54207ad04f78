"""What a hand-off carries from a prefill engine to a decode engine (the transports in this
package move it; ``docs/kv-handoff.md`` tells the flow and the wire protocol).

A payload is the request's KV pages plus everything needed to continue decoding exactly where
the prefill stopped: the prompt, the outputs so far and the sampling parameters (seeded sampling
needs nothing more: each token's seed comes from the request's seed and the token's position).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from engine.errors import KVImportError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on; checked field by field at import (the handshake)."""

    model_fingerprint: str
    layout: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`KVImportError` naming every field that differs."""
        diffs = [
            _difference(f.name, getattr(other, f.name), getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise KVImportError("incompatible KV cache: " + "; ".join(diffs))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def page_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of ``num_blocks`` pages: [layers, 2, blocks, slots, heads, dim]."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def _difference(name: str, sender: Any, receiver: Any) -> str:
    """One differing field; the model fingerprint's values are never echoed to the sender."""
    if name == "model_fingerprint":
        return f"{name}: sender and receiver differ"
    return f"{name}: sender {sender!r} != receiver {receiver!r}"


@dataclass(frozen=True)
class TransferHeader:
    """What a receiver knows of a transfer before any page arrives (the handshake): checked
    against the receiver's layout and the request's reservation before any buffer is sized."""

    layout: KVLayout
    request_id: str
    token: str = field(repr=False)  # the reservation's secret
    shape: tuple[int, ...]
    num_bytes: int


@dataclass
class HandoffState:
    """The request as the prefill side leaves it (first token sampled)."""

    request_id: str
    token_ids: list[int]  # prompt + first token
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the payload (the prompt)
    params: SamplingParams
    priority: int
    max_output_tokens: int = 0  # output limit on the decode side (first token included)
    first_block: int = 0  # the pages start at this block: the receiver holds the ones before
    num_cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]


@dataclass
class KVPayload:
    layout: KVLayout
    state: HandoffState
    blocks: torch.Tensor  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], CPU
    token: str = field(default="", repr=False)  # the reservation's secret, set by the sender

    @property
    def num_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def check_shape(self, expected_blocks: int) -> None:
        expected = self.layout.page_shape(expected_blocks)
        if tuple(self.blocks.shape) != expected:
            raise KVImportError(
                f"KV blocks have shape {tuple(self.blocks.shape)}, expected {expected}"
            )
