"""Replay recorded requests against a coordinator started from a checkout, and compare answers.

    python scripts/replay_answers.py record --checkout /path/to/old --out old.json
    python scripts/replay_answers.py record --checkout . --out new.json
    python scripts/replay_answers.py compare old.json new.json

``record`` starts ``pdserve`` from ``--checkout`` (its own code: the process and its Ray workers
import from there) on the bundled model with the shipping defaults, or ``--deploy-mode``, and
``--set section.key=JSON`` for each setting the two checkouts must share, sends
every request of ``--requests`` (``scripts/replay_requests.json``: greedy and seeded, plain and
streaming, over every front door) one after another, and writes each answer's status and body.
Only what legitimately differs between two runs is blanked: ids, timestamps, timings and seeds.
``compare`` exits 1 naming every request whose answer differs, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.coordinator_process import start_coordinator  # noqa: E402

REQUESTS = ROOT / "scripts" / "replay_requests.json"
# fields whose values differ from run to run whatever the code: ids, clocks, timings, and the
# seed drawn for a request that gave none (a seeded request's tokens are compared all the same)
VOLATILE = re.compile(
    rb'"(id|created|system_fingerprint|request_id|seed|seconds|\w+_time|\w+_ms|\w+_s|time\w*)"'
    rb"\s*:\s*(\"[^\"]*\"|[0-9.eE+-]+)"
)


def normalized(body: bytes) -> str:
    return VOLATILE.sub(rb'"\1": "-"', body).decode("utf-8", "replace")


def _same(old: dict, new: dict) -> bool:
    """Equal once blanked again (answers recorded before a field was known to vary)."""

    def body(answer: dict) -> str:
        return normalized(answer["body"].encode())

    return old["status"] == new["status"] and body(old) == body(new)


def record(args: argparse.Namespace) -> int:
    config = {"backend_config": {"device": "cpu"}}
    if args.deploy_mode:
        config["digs_scheduler_config"] = {"deploy_mode": args.deploy_mode}
    for setting in args.set:
        dotted, _, value = setting.partition("=")
        section, _, key = dotted.partition(".")
        config.setdefault(section, {})[key] = json.loads(value)
    requests = json.loads(Path(args.requests).read_text())
    with tempfile.TemporaryDirectory() as workdir:
        server = _start(Path(workdir), config, Path(args.checkout).resolve())
        try:
            server.wait_ready()
            with server.client() as client:
                answers = [_answer(client, server, request) for request in requests]
        finally:
            server.stop()
    Path(args.out).write_text(json.dumps(answers, indent=1, ensure_ascii=False))
    print(f"{len(answers)} answers from {args.checkout} in {args.out}")
    return 0


def _start(workdir: Path, config: dict, checkout: Path):
    import os

    cwd = os.getcwd()
    os.chdir(checkout)  # ``python -m coordinator`` imports the checkout's code first
    try:
        return start_coordinator(workdir, config, env={"PYTHONPATH": str(checkout)})
    finally:
        os.chdir(cwd)


def _answer(client, server, request: dict) -> dict:
    response = client.post(server.url("predict_port", request["path"]), json=request["body"])
    return {
        "name": request["name"],
        "status": response.status_code,
        "body": normalized(response.content),
    }


def compare(args: argparse.Namespace) -> int:
    old, new = (json.loads(Path(p).read_text()) for p in (args.old, args.new))
    differ = [a["name"] for a, b in zip(old, new, strict=True) if not _same(a, b)]
    for name in differ:
        print(f"differs: {name}")
    print(f"{len(old) - len(differ)} of {len(old)} answers identical")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--checkout", default=str(ROOT))
    rec.add_argument("--out", required=True)
    rec.add_argument("--requests", default=str(REQUESTS))
    rec.add_argument("--deploy-mode", choices=("pd_separate", "single_node"))
    rec.add_argument("--set", action="append", default=[], help="section.key=JSON")
    cmp = commands.add_parser("compare")
    cmp.add_argument("old")
    cmp.add_argument("new")
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
