"""KV hand-off between two hosts (network namespaces joined by a bridge, ``netns.py``; root only):
ZMQ frames and gRPC, plain and encrypted, side by side with the same-host shared-memory path.

    sudo python -m benchmarks.engine.kv_cross_host [--scratch] [--out PATH] \\
        [--shape 10gbit[,0.2ms]]

A receiver process on the decode host serves every cross-host plane at once; a sender process
on the prefill host computes real pages (the bundled SmolLM2-135M, ``--model``; 128-, 512- and
2048-token prompts, ``--sizes``; prefill-only) and times each transfer from ``send`` to the
receiver's acknowledgement, plus ``zmq_shm``: ZMQ to a receiver process on its own host, through
``/dev/shm``, as a prefill and a decode actor on one node hand over. Both ends of every plane get
the cluster's credentials as a worker does (``kv_planes.py``). Paired rounds
(``benchmarks.harness.rounds``): each round takes every plane in turn, the order rotating, the
first round dropped; a plane's value in a round is the MB/s of the median of ``--transfers``
transfers. ``--shape`` caps both hosts' links at a datacenter link's rate (tc tbf) and, given a
delay, adds it each way (tc netem, where the kernel has it). Each figure: MB/s (median over the
kept rounds with its bootstrap interval, ``benchmarks.harness.stats.spread``) and the median
transfer's share of the prompt's prefill time (what it adds to the time to first token).
JSON: ``{"_meta": ..., "shape": ..., "prefill_ms": {"<tokens>": ms}, "<plane>": {"<tokens>":
{"mb_s": spread, "share_of_prefill": x} or {"error": why}}, "ratios": {"<tokens>": {"zmq_curve/
zmq_frames": spread, "grpc_tls/grpc": spread, "zmq_frames/zmq_shm": spread}}}``. Exit status 1
when a plane failed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.engine.kv_planes import (
    ENCRYPTED_VS_PLAIN,
    PLANES,
    SIZES,
    TRANSFERS,
    Side,
    cell,
    check_paths,
    open_receivers,
    open_senders,
    prefill_payload,
    print_shares,
    ratio_spread,
    receiver_process,
    run_setup,
    sizes_argument,
    summarize,
    transfer_side,
    warm_engine,
)
from benchmarks.harness.provenance import ROOT
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds
from engine.transfer.security import generate_credentials
from testbed.netns import TestBed, available, sweep

# every one of them crosses the bridge (no shared memory)
CROSS_HOST = {name: PLANES[name] for name in ("zmq_frames", "zmq_curve", "grpc", "grpc_tls")}
SAME_HOST = {"zmq_shm": PLANES["zmq"]}
RATIOS = {**ENCRYPTED_VS_PLAIN, "zmq_frames": "zmq_shm"}  # (numerator, denominator) pairs
ORDER = "every plane once a round, the order rotating from round to round"
HOSTS = "prefill and decode network namespaces joined by a bridge (netns.py)"
SELF = [sys.executable, "-m", "benchmarks.engine.kv_cross_host"]


def _host_env() -> dict[str, str]:
    """The environment of this module on a host: nsenter into a mount namespace starts at its
    root directory, so the repository goes on the path explicitly."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def serve(keys_path: Path, host: str) -> None:
    """Decode host: one receiver per plane; print their endpoints; serve until stdin closes."""
    keys = pickle.loads(keys_path.read_bytes())
    receivers = open_receivers(CROSS_HOST, keys.receiver, host)
    print(json.dumps({name: r.endpoint for name, r in receivers.items()}), flush=True)
    sys.stdin.read()
    for receiver in receivers.values():
        receiver.close()


def send(keys_path: Path, endpoints: dict[str, str], args: argparse.Namespace) -> None:
    """Prefill host: time every plane on real pages; print the results as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    keys = pickle.loads(keys_path.read_bytes())
    engine = warm_engine(args.model, args.block_size)
    planes = {**SAME_HOST, **CROSS_HOST}
    senders = open_senders(planes, keys.sender)
    results: dict[str, dict] = {"prefill_ms": {}, **{name: {} for name in planes}, "ratios": {}}
    try:
        with receiver_process(SAME_HOST, keys.receiver) as local:
            endpoints = {**endpoints, **local}
            for size in args.sizes:
                payload, prefill_s = prefill_payload(engine, size)
                sides: dict[str, Side] = {
                    name: transfer_side(senders[name], endpoints[name], payload, args.transfers)
                    for name in planes
                }
                kept = paired_rounds(sides, args.rounds, DEFAULT_WARMUP)
                key = str(size)
                results["prefill_ms"][key] = round(prefill_s * 1000, 1)
                for name, figures in summarize(kept, sides, payload, prefill_s).items():
                    results[name][key] = figures
                results["ratios"][key] = {
                    f"{ours}/{theirs}": ratio_spread(kept, ours, theirs)
                    for ours, theirs in RATIOS.items()
                }
        check_paths(planes, senders)
    finally:
        for sender in senders.values():
            sender.close()
    print(json.dumps(results), flush=True)


def orchestrate(args: argparse.Namespace) -> int:
    why = available()
    if why is not None:
        sys.exit(f"cannot build the two hosts: {why}")
    result = ResultFile.start(args)
    sweep()
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-bench-") as tmp:
        keys_path = Path(tmp) / "keys.pickle"
        keys_path.write_bytes(pickle.dumps(generate_credentials()))
        keys_path.chmod(0o600)
        returncode, output = _measure_on_hosts(args, keys_path, Path(tmp) / "bed")
    if returncode != 0:
        sys.exit(f"the sender failed: {output[-3000:]}")
    measured = json.loads(output.strip().splitlines()[-1])
    results = {
        "_meta": run_setup(args, args.threads, ORDER, hosts=HOSTS),
        "shape": args.shape or "none",
        **measured,
    }
    report(results, args.sizes)
    path = result.write(results)
    print(f"results: {path}")
    names = [*SAME_HOST, *CROSS_HOST]
    return 1 if any("error" in results[n][str(s)] for n in names for s in args.sizes) else 0


def _measure_on_hosts(args: argparse.Namespace, keys_path: Path, bed_path: Path) -> tuple[int, str]:
    """The two hosts built (links shaped), the receiver on the decode host and the sender run to
    its end on the prefill host; the sender's exit status and output."""
    with TestBed(("prefill", "decode"), bed_path) as bed:
        if args.shape:
            rate, _, delay = args.shape.partition(",")
            bed.shape(rate, delay or None)
        decode = bed["decode"]
        receiver = decode.popen(
            [*SELF, "--serve", str(keys_path), "--host", decode.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_host_env(),
        )
        assert receiver.stdout is not None and receiver.stdin is not None
        endpoints = receiver.stdout.readline()
        sender = bed["prefill"].popen(
            [*SELF, "--send", str(keys_path), "--endpoints", endpoints, *_measure_argv(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_host_env(),
        )
        output, _ = sender.communicate(timeout=3600)
        receiver.stdin.close()
        receiver.wait(timeout=30)
    return sender.returncode, output


def _measure_argv(args: argparse.Namespace) -> list[str]:
    """The sender's share of this run's arguments."""
    return [
        "--rounds", str(args.rounds), "--transfers", str(args.transfers),
        "--sizes", ",".join(map(str, args.sizes)), "--model", _model(args.model),
        "--block-size", str(args.block_size), "--threads", str(args.threads),
    ]  # fmt: skip


def _model(model: str) -> str:
    """``model`` as a host finds it (a relative path from the host's root would not be)."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def report(results: dict, sizes: list[int]) -> None:
    names = [*SAME_HOST, *CROSS_HOST]
    print(f"KV hand-off between two hosts (link shaping: {results['shape']})")
    print("MB/s (median [95% interval] over rounds), share of the prompt's prefill time")
    print(f"{'tokens':>7}{'prefill ms':>11}" + "".join(f"{n:>26}" for n in names))
    for size in sizes:
        row = "".join(cell(results[n][str(size)], 26) for n in names)
        print(f"{size:>7}{results['prefill_ms'][str(size)]:>11.0f}{row}")
        for name in names:
            if "error" in results[name][str(size)]:
                print(f"{name} failed: {results[name][str(size)]['error']}", file=sys.stderr)
    print_shares(
        "\nencrypted as a share of plain, and cross-host as a share of same-host (MB/s)",
        {str(size): results["ratios"][str(size)] for size in sizes},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "kv_cross_host")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--transfers", type=int, default=TRANSFERS, help="per plane and round")
    parser.add_argument(
        "--sizes", type=sizes_argument, default=list(SIZES), help="prompt tokens, a,b,c"
    )
    parser.add_argument("--model", default="bundled", help="the model computing the pages")
    parser.add_argument("--block-size", type=int, default=128, help="tokens a KV block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the prefill")
    parser.add_argument("--shape", help="RATE[,DELAY] of both links, e.g. 10gbit or 10gbit,0.2ms")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--send", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--endpoints", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.transfers < 1 or min(args.sizes) < 1:
        parser.error("--rounds, --transfers and every size must be at least 1")
    if args.serve:
        serve(args.serve, args.host)
    elif args.send:
        send(args.send, args.endpoints, args)
    else:
        return orchestrate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
