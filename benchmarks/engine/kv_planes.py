"""What the KV hand-off benchmarks share (``kv_transfer`` on one host, ``kv_cross_host`` between
two): the planes they measure, the credentials each end of a plane gets, real pages from a
prefill-only prompt, and one round of a plane (a few timed transfers, as MB/s).

Credentials: the benchmark makes fresh cluster credentials, as the cluster does at every start,
and each end of a plane gets the share a worker of that plane gets
(:func:`engine.transfer.security.transfer_credentials`): everything on an encrypted plane (ZMQ
CURVE, gRPC TLS), the password gate on a plaintext one (ZMQ PLAIN; gRPC has none). A receiver
with a gate admits no sender without the password, so both ends must always get their share.

A plane that fails a transfer (a timeout, a refusal) is not measured further in that size: its
rounds are NaN and its result the error, while the other planes go on.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.engine.measures import PromptDraw
from benchmarks.harness.rounds import DEFAULT_WARMUP
from benchmarks.harness.stats import spread
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.transfer.base import (
    CHUNKS,
    FRAMES,
    SHARED_MEMORY,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferError,
    ReceiverLimits,
)
from engine.transfer.payload import KVPayload
from engine.transfer.security import KVCredentials, transfer_credentials
from engine.transfer.transports import create_receiver, create_sender

SIZES = (128, 512, 2048)  # prompt tokens
TRANSFERS = 3  # timed transfers per plane and round
TIMEOUT_S = 60.0  # one transfer's


@dataclass(frozen=True)
class Plane:
    transport: str  # zmq or grpc
    shared_memory: bool  # zmq: the /dev/shm path on one host
    encrypted: bool  # CURVE / TLS, else plain text behind the password gate
    path: str  # the path its pages must take (``payloads_by_path``)


PLANES = {
    "zmq": Plane("zmq", True, False, SHARED_MEMORY),  # the default as deployed on one host
    "zmq_frames": Plane("zmq", False, False, FRAMES),  # through the socket, as between hosts
    "zmq_curve": Plane("zmq", False, True, FRAMES),
    "grpc": Plane("grpc", True, False, CHUNKS),
    "grpc_tls": Plane("grpc", True, True, CHUNKS),
}
ENCRYPTED_VS_PLAIN = {"zmq_curve": "zmq_frames", "grpc_tls": "grpc"}


def share(plane: Plane, credentials: KVCredentials) -> KVCredentials | None:
    """The part of one role's ``credentials`` its end of ``plane`` uses, as a worker's."""
    encryption = "on" if plane.encrypted else "off"
    return transfer_credentials(
        KVTransferConfig(plane.transport, encryption=encryption), credentials
    )


def open_receivers(
    planes: Mapping[str, Plane], credentials: KVCredentials, host: str = "127.0.0.1"
) -> dict[str, BaseKVReceiver]:
    """One receiver per plane, accepting every transfer; ``credentials``: the receivers' share."""
    return {
        name: create_receiver(
            plane.transport,
            lambda item: None,
            host,
            limits=ReceiverLimits(stream_timeout_s=TIMEOUT_S),
            credentials=share(plane, credentials),
        )
        for name, plane in planes.items()
    }


def open_senders(
    planes: Mapping[str, Plane], credentials: KVCredentials
) -> dict[str, BaseKVSender]:
    """One sender per plane; ``credentials``: the senders' share."""
    return {
        name: create_sender(plane.transport, plane.shared_memory, share(plane, credentials))
        for name, plane in planes.items()
    }


def _serve(planes: dict[str, Plane], credentials: KVCredentials, host: str, conn) -> None:
    receivers = open_receivers(planes, credentials, host)
    conn.send({name: receiver.endpoint for name, receiver in receivers.items()})
    conn.recv()  # stop
    for receiver in receivers.values():
        receiver.close()


@contextmanager
def receiver_process(
    planes: Mapping[str, Plane], credentials: KVCredentials, host: str = "127.0.0.1"
) -> Iterator[dict[str, str]]:
    """A process of its own serving one receiver per plane; yields their endpoints."""
    parent, child = mp.Pipe()
    process = mp.get_context("spawn").Process(
        target=_serve, args=(dict(planes), credentials, host, child), daemon=True
    )
    process.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the receiver process did not start within 120 s")
        yield parent.recv()
    finally:
        if process.is_alive():
            parent.send("stop")
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def check_paths(planes: Mapping[str, Plane], senders: Mapping[str, BaseKVSender]) -> None:
    """Every plane's pages took its own path (e.g. ``zmq`` really through shared memory)."""
    for name, plane in planes.items():
        paths = senders[name].payloads_by_path.as_dict()
        if set(paths) - {plane.path}:
            raise RuntimeError(f"{name}: the pages took {paths}, not only {plane.path}")


def warm_engine(model: str = "bundled", block_size: int = 128, max_tokens: int = 4096) -> LLMEngine:
    """``model`` in fp32 with room for the longest prompt (no prefix cache: every prefill is
    whole), its first prefill done."""
    engine = LLMEngine(
        EngineConfig(
            model_path=model,
            device="cpu",
            dtype="float32",
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_input_token_len=max_tokens, max_seq_len=max_tokens),
        )
    )
    prefill_payload(engine, min(32, max_tokens - 1))
    return engine


def prefill_payload(engine: LLMEngine, num_tokens: int) -> tuple[KVPayload, float]:
    """The exported KV of a random ``num_tokens`` prompt and the prefill's wall time."""
    prompt = PromptDraw(num_tokens, engine.shape.vocab_size).prompt(num_tokens)
    request_id = f"bench-{num_tokens}-{time.monotonic()}"
    start = time.perf_counter()
    two = SamplingParams(max_new_tokens=2)
    engine.add_request(engine.request(request_id, prompt, two, prefill_only=True))
    while engine.requests[request_id].status != RequestStatus.HELD:
        engine.step()
    elapsed = time.perf_counter() - start
    payload = engine.export_kv(request_id)
    engine.release(request_id)
    return payload, elapsed


class Side:
    """One plane's measure in paired rounds: MB/s of a round. Its first failure is kept, and
    it is not tried again (its later rounds are NaN)."""

    def __init__(self, measure: Callable[[], float]) -> None:
        self.measure = measure
        self.error: str | None = None

    def __call__(self) -> float:
        if self.error is not None:
            return math.nan
        try:
            return self.measure()
        except (KVTransferError, RuntimeError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return math.nan


def transfer_side(
    sender: BaseKVSender, endpoint: str, payload: KVPayload, transfers: int = TRANSFERS
) -> Side:
    """MB/s of the median of ``transfers`` timed transfers, each from ``send`` to the receiver's
    acknowledgement (the pages readable in the receiver)."""
    megabytes = payload.num_bytes / 1e6

    def measure() -> float:
        times = []
        for _ in range(transfers):
            start = time.perf_counter()
            sender.send(endpoint, payload, timeout=TIMEOUT_S)
            times.append(time.perf_counter() - start)
        return megabytes / statistics.median(times)

    return Side(measure)


def copy_side(payload: KVPayload, transfers: int = TRANSFERS) -> Side:
    """The baseline: MB/s of one memory copy of the same bytes into a preallocated buffer."""
    source = payload.blocks.view(torch.uint8).flatten()
    target = torch.empty_like(source)
    megabytes = payload.num_bytes / 1e6

    def measure() -> float:
        times = []
        for _ in range(transfers):
            start = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - start)
        return megabytes / statistics.median(times)

    return Side(measure)


def summarize(
    kept: Mapping[str, list[float]], sides: Mapping[str, Side], payload: KVPayload, prefill_s: float
) -> dict[str, dict[str, Any]]:
    """Each side's MB/s over the kept rounds (median, bootstrap interval, min, max, rounds) and
    the median transfer's share of the prompt's prefill time; a failed side: its error."""
    megabytes = payload.num_bytes / 1e6
    out: dict[str, dict[str, Any]] = {}
    for name, values in kept.items():
        if sides[name].error is not None:
            out[name] = {"error": sides[name].error}
            continue
        mb_s = spread(values, 1)
        out[name] = {
            "mb_s": mb_s,
            "share_of_prefill": round(megabytes / statistics.median(values) / prefill_s, 4),
        }
    return out


def ratio_spread(kept: Mapping[str, list[float]], ours: str, theirs: str) -> dict[str, Any] | None:
    """``ours / theirs`` MB/s round by round, with its spread (None when either failed)."""
    ratios = [a / b for a, b in zip(kept[ours], kept[theirs], strict=True)]
    if not ratios or any(math.isnan(r) for r in ratios):
        return None
    return spread(ratios, 3)


def cell(figures: dict[str, Any], width: int = 20) -> str:
    """One plane's figures for a table: MB/s (its interval) and share of prefill."""
    if "error" in figures:
        return f"{'failed':>{width}}"
    mb = figures["mb_s"]
    text = (
        f"{mb['median']:.0f} [{mb['low']:.0f}-{mb['high']:.0f}] {figures['share_of_prefill']:.2%}"
    )
    return f"{text:>{width}}"


CREDENTIALS = (
    "fresh cluster credentials; each end gets a worker's share (transfer_credentials): "
    "CURVE / TLS encrypted, the ZMQ PLAIN password gate plain"
)


def run_setup(args: Any, threads: int, order: str, **more: Any) -> dict[str, Any]:
    """What a KV benchmark's run was given (its result file's ``_meta``)."""
    return {
        "model": args.model,
        "dtype": "float32",
        "block_size": args.block_size,
        "sizes": args.sizes,
        "threads": threads,
        "rounds": args.rounds,
        "dropped_rounds": DEFAULT_WARMUP,
        "transfers_per_round": args.transfers,
        "order": order,
        **more,
        "credentials": CREDENTIALS,
    }


def print_shares(title: str, shares: Mapping[str, Mapping[str, dict[str, Any] | None]]) -> None:
    """Per prompt size, each pair's share (median [95 % interval] over rounds)."""
    print(title)
    for size, pairs in shares.items():
        cells = [
            f"{pair} {c['median']:.0%} [{c['low']:.0%}-{c['high']:.0%}]" if c else f"{pair} -"
            for pair, c in pairs.items()
        ]
        print(f"{size:>7} tokens: " + "   ".join(cells))


def sizes_argument(text: str) -> list[int]:
    """``--sizes a,b,c``: prompt tokens."""
    return [int(size) for size in text.split(",")]
