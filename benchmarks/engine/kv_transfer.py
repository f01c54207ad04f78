"""KV hand-off bandwidth between two processes: ZMQ and gRPC, plain and encrypted, against a raw
memory copy.

    python -m benchmarks.engine.kv_transfer [--scratch] [--out PATH]

The pages are real: the bundled SmolLM2-135M (``--model``) computes 128-, 512- and 2048-token
prompts (``--sizes``; prefill-only) and exports their KV (46 080 bytes a token in fp32). One
receiver process serves every plane (``kv_planes.py``), with the cluster's credentials as a
worker gets them (encrypted planes: CURVE / TLS; plaintext ones: the ZMQ password gate); one
transfer is timed from ``send`` to the receiver's acknowledgement, when the pages are readable in
the receiver (installing them into its cache is the same copy for every transport and is not
counted). ``zmq`` is the default plane as deployed (shared memory on one host); ``zmq_frames``
forces the pages through the socket, as between hosts. ``zmq_curve`` and ``grpc_tls`` are
``zmq_frames`` and ``grpc`` encrypted with peer authentication, as between hosts by default
(``kv_encryption``). The baseline, ``copy``, is one memory copy of the same bytes into a
preallocated buffer in this process.

Paired rounds (``benchmarks.harness.rounds``): each round takes every plane in turn, the order
rotating, the first round dropped; a plane's value in a round is the MB/s of the median of
``--transfers`` transfers. Each figure is the median over ``--rounds`` kept rounds with its
bootstrap interval (``benchmarks.harness.stats.spread``), and the median transfer's share of the
prompt's prefill time; ``encryption_cost`` is encrypted / plain MB/s round by round.
JSON: ``{"_meta": ..., "prefill_ms": {"<tokens>": ms}, "<plane>": {"<tokens>": {"mb_s": spread,
"share_of_prefill": x} or {"error": why}}, "encryption_cost": {"<tokens>": {"zmq_curve/zmq_frames":
spread, "grpc_tls/grpc": spread}}}``. Exit status 1 when a plane failed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import torch

from benchmarks.engine.kv_planes import (
    ENCRYPTED_VS_PLAIN,
    PLANES,
    SIZES,
    TRANSFERS,
    Side,
    cell,
    check_paths,
    copy_side,
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
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds
from engine.llm_engine import LLMEngine
from engine.transfer.base import BaseKVSender
from engine.transfer.security import generate_credentials


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "kv_transfer")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the prefill")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--transfers", type=int, default=TRANSFERS, help="per plane and round")
    parser.add_argument(
        "--sizes", type=sizes_argument, default=list(SIZES), help="prompt tokens, a,b,c"
    )
    parser.add_argument("--model", default="bundled", help="the model computing the pages")
    parser.add_argument("--block-size", type=int, default=128, help="tokens a KV block")
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.rounds < 1 or args.transfers < 1 or min(args.sizes) < 1:
        parser.error("--rounds, --transfers and every size must be at least 1")
    result = ResultFile.start(args)
    torch.set_num_threads(args.threads)
    engine = warm_engine(args.model, args.block_size)
    keys = generate_credentials()
    names = [*PLANES, "copy"]
    order = "every plane and the copy once a round, the order rotating from round to round"
    planes = {name: asdict(plane) for name, plane in PLANES.items()}
    setup = run_setup(args, torch.get_num_threads(), order, planes=planes)
    results: dict[str, dict] = {"_meta": setup}
    results.update({"prefill_ms": {}, **{name: {} for name in names}, "encryption_cost": {}})
    print("MB/s per plane (median [95% interval] over rounds), share of the prompt's prefill")
    print(f"{'tokens':>7}{'MB':>8}{'prefill ms':>11}" + "".join(f"{n:>26}" for n in names))
    failed = False
    with receiver_process(PLANES, keys.receiver) as endpoints:
        senders = open_senders(PLANES, keys.sender)
        try:
            for size in args.sizes:
                failed |= _measure_size(engine, size, senders, endpoints, args, names, results)
                result.write(results, complete=False)
            check_paths(PLANES, senders)
        finally:
            for sender in senders.values():
                sender.close()
    print_shares(
        "\nencrypted MB/s as a share of plain (median [95% interval] over rounds)",
        results["encryption_cost"],
    )
    path = result.write(results)
    print(f"results: {path}")
    return 1 if failed else 0


def _measure_size(
    engine: LLMEngine,
    size: int,
    senders: dict[str, BaseKVSender],
    endpoints: dict[str, str],
    args: argparse.Namespace,
    names: list[str],
    results: dict[str, dict],
) -> bool:
    """Every plane and the copy in paired rounds on a ``size``-token prompt's pages, its figures
    put in ``results`` and its row printed; whether a plane failed."""
    payload, prefill_s = prefill_payload(engine, size)
    sides: dict[str, Side] = {
        name: transfer_side(senders[name], endpoints[name], payload, args.transfers)
        for name in PLANES
    }
    sides["copy"] = copy_side(payload, args.transfers)
    kept = paired_rounds(sides, args.rounds, DEFAULT_WARMUP)
    figures = summarize(kept, sides, payload, prefill_s)
    key = str(size)
    results["prefill_ms"][key] = round(prefill_s * 1000, 1)
    for name in names:
        results[name][key] = figures[name]
    results["encryption_cost"][key] = {
        f"{enc}/{plain}": ratio_spread(kept, enc, plain)
        for enc, plain in ENCRYPTED_VS_PLAIN.items()
    }
    failed = False
    for name, side in sides.items():
        if side.error is not None:
            failed = True
            print(f"{name} at {size} tokens failed: {side.error}", file=sys.stderr)
    row = "".join(cell(figures[n], 26) for n in names)
    megabytes = payload.num_bytes / 1e6
    print(f"{size:>7}{megabytes:>8.3f}{prefill_s * 1000:>11.0f}{row}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
