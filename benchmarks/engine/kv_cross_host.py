"""KV hand-off between two hosts (network namespaces joined by a bridge, ``netns.py``; root only):
ZMQ frames and gRPC, plain and encrypted, side by side with the same-host shared-memory path.

    sudo python -m benchmarks.engine.kv_cross_host --out results/kv_cross_host.json \\
        [--shape 10gbit[,0.2ms]]

A receiver process on the decode host serves every cross-host variant at once; a sender process
on the prefill host computes real pages (the bundled SmolLM2-135M, 128-, 512- and 2048-token
prompts, prefill-only) and times each transfer from ``send`` to the receiver's acknowledgement,
taking every variant in turn in each round (so a noisy moment weighs on all alike), plus
``zmq_shm``: ZMQ to a receiver on its own host, through ``/dev/shm``, as a prefill and a decode
actor on one node hand over. ``--shape`` caps both hosts' links at a datacenter link's rate (tc
tbf) and, given a delay, adds it each way (tc netem, where the kernel has it). Each figure:
MB/s (median), the spread ((slowest - fastest) / median) and the transfer's share of the
prompt's prefill time (what it adds to the time to first token).
JSON: ``{"shape": ..., "<variant>": {"<tokens>": {...}}}``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engine.kv_transfer import (
    SIZES,
    prefill_payload,
    time_transport,
    warm_engine,
)
from benchmarks.harness.netns import TestBed, available, sweep
from engine.transfer import create_receiver, create_sender
from engine.transfer.security import generate_credentials

# variant: (transport, encrypted); all of them cross the bridge (no shared memory)
CROSS_HOST = {
    "zmq_frames": ("zmq", False),
    "zmq_curve": ("zmq", True),
    "grpc": ("grpc", False),
    "grpc_tls": ("grpc", True),
}
SAME_HOST = "zmq_shm"
SELF = [sys.executable, "-m", "benchmarks.engine.kv_cross_host"]  # run from the repository root


def serve(keys_path: Path, host: str) -> None:
    """Decode host: one receiver per variant; print their endpoints; serve until stdin closes."""
    keys = pickle.loads(keys_path.read_bytes())
    receivers = {
        name: create_receiver(
            transport, lambda item: None, host, credentials=keys.receiver if encrypted else None
        )
        for name, (transport, encrypted) in CROSS_HOST.items()
    }
    print(json.dumps({name: r.endpoint for name, r in receivers.items()}), flush=True)
    sys.stdin.read()
    for receiver in receivers.values():
        receiver.close()


def send(keys_path: Path, endpoints: dict[str, str], rounds: int) -> None:
    """Prefill host: time every variant on real pages; print the results as JSON."""
    import torch

    torch.set_num_threads(1)
    keys = pickle.loads(keys_path.read_bytes())
    engine = warm_engine()
    senders = {
        name: create_sender(transport, False, keys.sender if encrypted else None)
        for name, (transport, encrypted) in CROSS_HOST.items()
    }
    results: dict[str, dict] = {name: {} for name in (SAME_HOST, *CROSS_HOST)}
    for size in SIZES:
        payload, prefill_s = prefill_payload(engine, size)
        times: dict[str, list[float]] = {name: [] for name in results}
        for name, sender in senders.items():  # two untimed transfers each
            for _ in range(2):
                sender.send(endpoints[name], payload, timeout=60)
        for _ in range(rounds):
            for name, sender in senders.items():
                for _ in range(3):
                    start = time.perf_counter()
                    sender.send(endpoints[name], payload, timeout=60)
                    times[name].append(time.perf_counter() - start)
            times[SAME_HOST] += time_transport("zmq", payload, 3)
        megabytes = payload.num_bytes / 1e6
        for name, seconds in times.items():
            median = statistics.median(seconds)
            results[name][str(size)] = {
                "mb_s": round(megabytes / median, 1),
                "spread": round((max(seconds) - min(seconds)) / median, 3),
                "share_of_prefill": round(median / prefill_s, 4),
                "prefill_ms": round(prefill_s * 1000, 1),
            }
    for sender in senders.values():
        sender.close()
    print(json.dumps(results), flush=True)


def orchestrate(args: argparse.Namespace) -> None:
    why = available()
    if why is not None:
        sys.exit(f"cannot build the two hosts: {why}")
    sweep()
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-bench-") as tmp:
        keys_path = Path(tmp) / "keys.pickle"
        keys_path.write_bytes(pickle.dumps(generate_credentials()))
        keys_path.chmod(0o600)
        with TestBed(("prefill", "decode"), Path(tmp) / "bed") as bed:
            if args.shape:
                rate, _, delay = args.shape.partition(",")
                bed.shape(rate, delay or None)
            decode = bed["decode"]
            receiver = decode.popen(
                [*SELF, "--serve", str(keys_path), "--host", decode.address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert receiver.stdout is not None and receiver.stdin is not None
            endpoints = receiver.stdout.readline()
            sender = bed["prefill"].run(
                [*SELF, "--send", str(keys_path), "--endpoints", endpoints,
                 "--rounds", str(args.rounds)],
                timeout=3600,
            )  # fmt: skip
            receiver.stdin.close()
            receiver.wait(timeout=30)
    if sender.returncode != 0:
        sys.exit(f"the sender failed: {sender.stdout[-3000:]}")
    results = {"shape": args.shape or "none", **json.loads(sender.stdout.strip().splitlines()[-1])}
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


def report(results: dict) -> None:
    names = (SAME_HOST, *CROSS_HOST)
    print(f"KV hand-off between two hosts (link shaping: {results['shape']})")
    print("MB/s, spread, share of the prompt's prefill time")
    print(f"{'tokens':>7}{'prefill ms':>12}  " + "".join(f"{n:>24}" for n in names))
    for size in SIZES:
        cells = [results[n][str(size)] for n in names]
        row = "".join(
            f"{c['mb_s']:>10.0f} ±{c['spread']:>4.0%} {c['share_of_prefill']:>6.1%}" for c in cells
        )
        print(f"{size:>7}{cells[0]['prefill_ms']:>12.0f}  {row}")
    print("\nencrypted as a share of plain, and cross-host as a share of same-host (MB/s)")
    for size in SIZES:
        mb = {n: results[n][str(size)]["mb_s"] for n in names}
        print(
            f"{size:>7} tokens: zmq_curve/zmq_frames {mb['zmq_curve'] / mb['zmq_frames']:.0%}, "
            f"grpc_tls/grpc {mb['grpc_tls'] / mb['grpc']:.0%}, "
            f"zmq_frames/zmq_shm {mb['zmq_frames'] / mb[SAME_HOST]:.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/kv_cross_host.json"))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of 3 transfers each")
    parser.add_argument("--shape", help="RATE[,DELAY] of both links, e.g. 10gbit or 10gbit,0.2ms")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--send", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--endpoints", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.host)
    elif args.send:
        send(args.send, args.endpoints, args.rounds)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
