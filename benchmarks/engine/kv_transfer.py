"""KV hand-off bandwidth between two processes: ZMQ and gRPC, plain and encrypted, against a raw
memory copy.

    python -m benchmarks.engine.kv_transfer --out results/kv_transfer.json

The pages are real: the bundled SmolLM2-135M computes 128-, 512- and 2048-token prompts
(prefill-only) and exports their KV (46 080 bytes a token in fp32). A receiver process serves
each transport; one transfer is timed from ``send`` to the receiver's acknowledgement, when the
pages are readable in the receiver (installing them into its cache is the same copy for every
transport and is not counted). ``zmq`` is the default transport as deployed (shared memory on
one host); ``zmq_frames`` forces the pages through the socket, as between hosts.
``zmq_curve`` and ``grpc_tls`` are ``zmq_frames`` and ``grpc`` encrypted with peer
authentication, as between hosts by default (``kv_encryption``); the last lines give their
bandwidth as a share of the plain one, measured side by side, with the spread. The baseline,
``copy``, is one memory copy of the same bytes into a preallocated buffer in one process. Each
figure is also given as a share of that prompt's prefill time.
JSON: ``{"<transport>": {"<tokens>": {"mb_s": x, "share_of_prefill": y, "spread": z}}}``
(spread: (slowest - fastest) / median of the timed transfers) and
``"encryption_cost": {"<tokens>": {"zmq_curve/zmq_frames": r, "grpc_tls/grpc": r}}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.transfer import CHUNKS, FRAMES, SHARED_MEMORY, create_receiver, create_sender
from engine.transfer.payload import KVPayload
from engine.transfer.security import ClusterCredentials, generate_credentials

SIZES = (128, 512, 2048)
# name: (transport, shared memory, encrypted), and the path its pages must take
TRANSPORTS = {
    "zmq": (("zmq", True, False), SHARED_MEMORY),
    "zmq_frames": (("zmq", False, False), FRAMES),
    "zmq_curve": (("zmq", False, True), FRAMES),
    "grpc": (("grpc", True, False), CHUNKS),
    "grpc_tls": (("grpc", True, True), CHUNKS),
}
ENCRYPTED_VS_PLAIN = {"zmq_curve": "zmq_frames", "grpc_tls": "grpc"}


def _serve(transport: str, keys: ClusterCredentials | None, conn) -> None:
    receiver = create_receiver(transport, lambda item: None, credentials=keys and keys.receiver)
    conn.send(receiver.endpoint)
    conn.recv()  # stop
    receiver.close()


def warm_engine() -> LLMEngine:
    """The bundled model in fp32 with room for the longest prompt, its first prefill done."""
    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            scheduler=SchedulerConfig(max_input_token_len=4096, max_seq_len=4096),
        )
    )
    prefill_payload(engine, 32)
    return engine


def prefill_payload(engine: LLMEngine, num_tokens: int) -> tuple[KVPayload, float]:
    """The exported KV of a ``num_tokens`` prompt and the prefill's wall time."""
    rng = random.Random(num_tokens)
    prompt = [rng.randrange(100, 40000) for _ in range(num_tokens)]
    request_id = f"bench-{num_tokens}-{time.monotonic()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=2), prefill_only=True)
    while engine.requests[request_id].status != RequestStatus.HELD:
        engine.step()
    elapsed = time.perf_counter() - start
    payload = engine.export_kv(request_id)
    engine.release(request_id)
    return payload, elapsed


def time_transport(name: str, payload: KVPayload, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` transfers (after two untimed ones)."""
    (transport, shared_memory, encrypted), path = TRANSPORTS[name]
    keys = generate_credentials() if encrypted else None
    parent, child = mp.Pipe()
    process = mp.get_context("spawn").Process(
        target=_serve, args=(transport, keys, child), daemon=True
    )
    process.start()
    endpoint = parent.recv()
    sender = create_sender(transport, shared_memory, credentials=keys and keys.sender)
    try:
        for _ in range(2):
            sender.send(endpoint, payload, timeout=60)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sender.send(endpoint, payload, timeout=60)
            times.append(time.perf_counter() - start)
        paths = sender.payloads_by_path.as_dict()
        if paths != {path: repeats + 2}:
            raise RuntimeError(f"{name}: the pages took {paths}, not {path}")
    finally:
        sender.close()
        parent.send("stop")
        process.join(timeout=10)
    return times


def time_copy(payload: KVPayload, repeats: int) -> list[float]:
    source = payload.blocks.view(torch.uint8).flatten()
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return times[2:]


def interleaved(payload: KVPayload, repeats: int) -> dict[str, list[float]]:
    """Each transport's transfer times, in rounds that take every transport in turn, so that
    a noisy moment weighs on all of them alike."""
    rounds = max(1, repeats // 3)
    times: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
    for _ in range(rounds):
        for name in TRANSPORTS:
            times[name] += time_transport(name, payload, 3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the prefill")
    parser.add_argument("--repeats", type=int, default=9, help="timed transfers per transport")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = warm_engine()
    results: dict[str, dict] = {name: {} for name in (*TRANSPORTS, "copy")}
    results["encryption_cost"] = {}
    print("MB/s per transport, and the transfer's share of the prompt's prefill time")
    print(
        f"{'tokens':>7}{'MB':>8}{'prefill ms':>12}  "
        + "".join(f"{name:>12}{'share':>7}" for name in (*TRANSPORTS, "copy"))
        + f"{'zmq/copy':>10}"
    )
    for size in SIZES:
        payload, prefill_s = prefill_payload(engine, size)
        megabytes = payload.num_bytes / 1e6
        timings = interleaved(payload, args.repeats)
        timings["copy"] = time_copy(payload, args.repeats)
        for name, times in timings.items():
            seconds = statistics.median(times)
            results[name][str(size)] = {
                "mb_s": round(megabytes / seconds, 1),
                "share_of_prefill": round(seconds / prefill_s, 4),
                "spread": round((max(times) - min(times)) / seconds, 3),
            }
        row = "".join(
            f"{results[n][str(size)]['mb_s']:>12.0f}"
            f"{results[n][str(size)]['share_of_prefill']:>7.1%}"
            for n in (*TRANSPORTS, "copy")
        )
        ratio = results["zmq"][str(size)]["mb_s"] / results["copy"][str(size)]["mb_s"]
        print(f"{size:>7}{megabytes:>8.1f}{prefill_s * 1000:>12.0f}  {row}{ratio:>10.0%}")
        results["encryption_cost"][str(size)] = {
            f"{enc}/{plain}": round(
                results[enc][str(size)]["mb_s"] / results[plain][str(size)]["mb_s"], 3
            )
            for enc, plain in ENCRYPTED_VS_PLAIN.items()
        }
    print("\nencrypted bandwidth as a share of plain (spread: encrypted, plain)")
    for size in SIZES:
        cells = []
        for enc, plain in ENCRYPTED_VS_PLAIN.items():
            share = results["encryption_cost"][str(size)][f"{enc}/{plain}"]
            spreads = results[enc][str(size)]["spread"], results[plain][str(size)]["spread"]
            cells.append(f"{enc}/{plain} {share:.0%} (±{spreads[0]:.0%}, ±{spreads[1]:.0%})")
        print(f"{size:>7} tokens: " + "   ".join(cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
