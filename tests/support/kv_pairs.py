"""A prefill/decode pair on a real KV plane and the raw senders that attack it: what the hostile-KV
and plane-bound tests share."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grpc
import torch
import zmq

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.outputs import TokenEvent
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams
from engine.transfer.codec import encode_header
from engine.transfer.payload import KVPayload
from engine.transfer.proto import kv_transfer_pb2 as pb
from prefill_worker.worker import PrefillWorker
from tests.conftest import make_engine
from tests.support.channel_reader import OWNER, ChannelReader
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget, Reservation

PROMPT = list(range(5, 10))


REFUSAL = "no reservation for these pages (aborted?)"


def _config(model_dir: Any) -> EngineConfig:
    # a cache larger than the largest header, so that a header past its limit reaches the
    # receiver's check (ZMQ drops a frame past both unanswered: zmq_transport.py)
    cache = CacheConfig(block_size=4, num_blocks=128)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


def _request(request_id: str) -> GenerationRequest:
    """A request of the coordinator a ``ChannelReader`` attaches as by default."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return GenerationRequest(request_id, PROMPT, params, owner=OWNER)


class Pair:
    """A prefill and a decode worker over one transport, a coordinator's reader attached to both
    (``reader``), and hostile access to the receiver."""

    def __init__(self, model_dir: Any, transport: str, shared_memory: bool) -> None:
        transfer = KVTransferConfig(
            transport, transfer_timeout_s=2.0, reservation_timeout_s=60.0,
            shared_memory=shared_memory,
        )  # fmt: skip
        self.transport = transport
        self.prefill = PrefillWorker(_config(model_dir), transfer)
        self.decode = DecodeWorker(_config(model_dir), transfer)
        self.reader = ChannelReader(self.prefill, self.decode)

    @property
    def endpoint(self) -> str:
        return self.decode.receiver.endpoint

    def good_handoff(self, request_id: str, reservation: Reservation | None = None) -> None:
        """A genuine hand-off goes through and decodes to its end."""
        reservation = reservation or self.decode.reserve(_request(request_id))
        assert reservation.granted
        target = HandoffTarget.from_reservation(reservation, 6)
        assert self.prefill.prefill(_request(request_id), target).accepted
        items = self.reader.items(self.prefill, request_id)
        assert isinstance(items[-1], HandoffResult) and items[-1].ok, items[-1]
        events = self.reader.items(self.decode, request_id)
        last = events[-1]
        assert len(events) == 5 and isinstance(last, TokenEvent)
        assert last.finish_reason == FinishReason.LENGTH

    def status(self, request_id: str) -> RequestStatus | None:
        request = self.decode.engine.requests.get(request_id)
        return None if request is None else request.status

    def close(self) -> None:
        self.reader.close()
        for worker in (self.prefill, self.decode):
            worker.close()
        self.decode.receiver.close()
        self.prefill.sender.close()


def _exported(tiny_loaded: Any, request_id: str, token: str = "") -> KVPayload:
    """Genuine pages and state of ``request_id``'s prompt, as a prefill engine exports them."""
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request(
        engine.request(request_id, PROMPT, _request(request_id).params, prefill_only=True)
    )
    while engine.requests[request_id].status != RequestStatus.HELD:
        engine.step()
    payload = engine.export_kv(request_id, 6)
    payload.token = token
    return payload


def _raw_send(transport: str, endpoint: str, frames: list[bytes], timeout_s: float = 5.0) -> Any:
    """Send raw bytes as one transfer: ZMQ frames, or gRPC chunks (``KVChunkMsg`` bytes). The
    acknowledgement, None when ZMQ never answered, or the gRPC error."""
    if transport == "zmq":
        socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint)
        try:
            socket.send_multipart(frames)
            if not socket.poll(int(timeout_s * 1000)):
                return None
            return pb.KVAckMsg.FromString(socket.recv())
        finally:
            socket.close(0)
    with grpc.insecure_channel(endpoint) as channel:
        push = channel.stream_unary(
            "/pdserve.kv.v1.KVTransfer/Push",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.KVAckMsg.FromString,
        )
        try:
            return push(iter(frames), timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc


def _send_transfer(pair: Pair, header: pb.KVHeaderMsg, data: bytes) -> Any:
    if pair.transport == "zmq":
        return _raw_send("zmq", pair.endpoint, [header.SerializeToString(), data])
    chunk = pb.KVChunkMsg(header=header, data=data)
    return _raw_send("grpc", pair.endpoint, [chunk.SerializeToString()])


def _send_payload(pair: Pair, payload: KVPayload) -> Any:
    pages = payload.blocks.view(torch.uint8).numpy().tobytes()
    return _send_transfer(pair, encode_header(payload), pages)


def _refused(ack: Any, *fragments: str) -> str:
    assert isinstance(ack, pb.KVAckMsg) and not ack.ok, ack
    for fragment in fragments:
        assert fragment in ack.error, ack.error
    return ack.error


def _forgeries(vocab_size: int) -> dict[str, Callable[[KVPayload], None]]:
    def tokens(ids: list[int]) -> Callable[[KVPayload], None]:
        return lambda p: setattr(p.state, "token_ids", ids)

    return {
        "a token id past the vocabulary": tokens(PROMPT + [vocab_size]),
        "a negative token id": tokens(PROMPT + [-1]),
        "another prompt": tokens([6, 7, 8, 9, 10, 11]),
        "more tokens than computed": tokens(PROMPT + [1, 2, 3, 4]),
        "a prompt count that differs": lambda p: setattr(p.state, "num_prompt_tokens", 2),
    }  # the output limit is the reservation's, whatever the wire says (test_kv_plane_bounds)


def _shm_header(payload: KVPayload, name: str) -> bytes:
    header = encode_header(payload)
    header.shm_name = name
    return header.SerializeToString()


def _hostile_name() -> str:
    return f"pdserve-kv-{os.getpid()}-{os.urandom(16).hex()}"
