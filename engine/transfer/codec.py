"""KVPayload <-> protobuf header + raw page bytes.

``decode_header`` is the receiver's first look at a transfer: it checks the header's own
consistency (a known dtype, a six-axis shape whose size is ``num_bytes``) so that nothing sized by
a forged header is ever allocated; the handler then checks it against the reservation."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams
from engine.transfer.payload import HandoffState, KVLayout, KVPayload, TransferHeader
from engine.transfer.proto import kv_transfer_pb2 as pb

if TYPE_CHECKING:  # a header is read without torch (a coordinator imports the transports'
    import torch  # limits); its pages are viewed with it

PROTOCOL_VERSION = 1
# the KV dtypes a layout may name (``str(torch dtype)``) and their bytes per value
_ITEMSIZES = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}
# the fields a state message carries as they are; ``params`` travels as ``params_json``
_STATE_FIELDS = tuple(f.name for f in fields(HandoffState) if f.name != "params")


def encode_header(payload: KVPayload) -> pb.KVHeaderMsg:
    state = payload.state
    return pb.KVHeaderMsg(
        protocol_version=PROTOCOL_VERSION,
        layout=pb.KVLayoutMsg(**payload.layout.to_dict()),
        state=pb.RequestStateMsg(
            **{name: getattr(state, name) for name in _STATE_FIELDS},
            params_json=json.dumps(state.params.to_dict()),
        ),
        shape=list(payload.blocks.shape),
        num_bytes=payload.num_bytes,
        reservation_token=payload.token,
    )


def decode_header(header: pb.KVHeaderMsg) -> TransferHeader:
    """The handshake's view of ``header``; raises ValueError for a header at odds with itself."""
    layout = decode_layout(header)
    itemsize = _ITEMSIZES.get(layout.dtype)
    if itemsize is None:
        raise ValueError(f"unknown KV dtype {layout.dtype!r}")
    shape = tuple(int(n) for n in header.shape)
    if len(shape) != 6 or shape[1] != 2:
        raise ValueError(f"KV page shape {shape} is not [layers, 2, blocks, slots, heads, dim]")
    expected_bytes = math.prod(shape) * itemsize
    if header.num_bytes != expected_bytes:
        raise ValueError(f"num_bytes {header.num_bytes} != {expected_bytes} for shape {shape}")
    return TransferHeader(
        layout, header.state.request_id, header.reservation_token, shape, header.num_bytes
    )


def decode_layout(header: pb.KVHeaderMsg) -> KVLayout:
    """The header's layout message as a :class:`KVLayout` (``encode_header``'s inverse)."""
    return KVLayout(**{f.name: getattr(header.layout, f.name) for f in fields(KVLayout)})


def decode_payload(header: pb.KVHeaderMsg, data: torch.Tensor) -> KVPayload:
    """``data``: a uint8 tensor of ``header.num_bytes`` bytes (may alias a receive buffer)."""
    import torch

    layout = decode_layout(header)
    if layout.dtype not in _ITEMSIZES:
        raise ValueError(f"unknown KV dtype {layout.dtype!r}")
    s = header.state
    state = HandoffState(
        **{name: getattr(s, name) for name in _STATE_FIELDS},
        params=SamplingParams.from_dict(json.loads(s.params_json)),
    )
    state.token_ids = list(s.token_ids)  # the message's repeated field, as a list
    dtype = getattr(torch, layout.dtype.removeprefix("torch."))
    blocks = data[: header.num_bytes].view(dtype).view(*header.shape)
    return KVPayload(layout, state, blocks, header.reservation_token)


def page_bytes(payload: KVPayload) -> memoryview:
    """A zero-copy byte view of the (contiguous, CPU) page buffer."""
    import torch

    return byte_view(payload.blocks.view(torch.uint8))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous CPU tensor."""
    array: Any = tensor.numpy()  # numpy arrays export the buffer protocol
    return memoryview(array).cast("B")
