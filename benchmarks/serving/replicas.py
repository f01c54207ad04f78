"""One coordinator against two in front of the same workers, side by side in one run
(docs/replicas.md).

    python -m benchmarks.serving.replicas                       # held-out draws -> results JSON
    python -m benchmarks.serving.replicas --draw-set tuning --scratch

A Ray head on 127.0.0.1, a shared pool started by ``pdserve workers`` (a tiny random model, so
that the coordinators' own CPU, not the model, is what a request costs: 2 prefill workers and 1
decode worker), and two coordinator processes of that pool. The side ``one`` sends everything
through the first coordinator, ``two`` spreads the same requests over both; the sides alternate
which goes first per draw.

- **Short completions**: an open loop (Poisson arrivals) of streamed ``/v1/completions`` with
  ``--words`` random words and 8-token outputs, at each rate of ``--rates`` for ``--seconds``.
  Per side, the requests of every draw at a rate are pooled: the figure is the requests/s
  completed at the highest rate whose pooled p99 TTFT is at most 1 s with no failed request,
  and each draw's own highest rate gives the spread.
- **Shared-prefix chat**: the prefix-cache benchmark's multi-turn chat mix (one system prompt,
  ``--users`` users of ``--turns`` turns); with two coordinators every next turn of a user comes
  through the other coordinator. Figure: the prefix-cache hit rate from the answers' usage,
  ``sum(cached_tokens) / sum(prompt_tokens)``; the goal is two at most 2 points below one.
- **Kill**: 8 streams on each coordinator; the second is killed with SIGKILL and restarted,
  ``--kills`` times: seconds from the kill until no worker holds a request of it (their
  ``requests_by_owner``), the survivor's failed requests, and the blocks in use once the
  survivor's load has stopped (must be 0).

Both sides meet the same arrival times (per draw and rate); the two-over-one figures are paired
per draw: the ratio of each draw's highest rates, and the hit rates' difference.

The ladder of rates was chosen on the tuning draws (``benchmarks.serving.draws``): the committed
figures come from the held-out draws only. Failed requests count (with examples of their errors
under ``failed_requests``). Writes ``benchmarks/results/replicas.json`` (the README's block is
generated from it by ``python -m benchmarks.report``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.load import ABANDONED
from benchmarks.harness.record import RequestRecord
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.stats import paired_differences
from benchmarks.harness.stats import spread as stats_spread
from benchmarks.serving.draws import draw_seeds, rotated
from benchmarks.serving.metrics import percentile
from benchmarks.serving.prefix_chat import Encode
from benchmarks.serving.replicas_load import chat_mix, open_loop, streams
from testbed.coordinator_process import CoordinatorProcess, start_coordinator
from testbed.ray_head import RAY_ENV, RayHead
from testbed.tiny_model import build_tiny_model

POOL = "bench-replicas"
SIDES = ("one", "two")
# requests/s: on the tuning draws one coordinator's p99 TTFT crossed 1 s between 100 and 120
# and two coordinators' between 60 and 80 (two cores run the coordinators, the workers and the
# client), so the ladder is dense there
RATES = (40.0, 60.0, 70.0, 80.0, 90.0, 100.0, 110.0)
TTFT_SLO_S = 1.0
HIT_RATE_GOAL = 0.02  # two coordinators' hit rate at most 2 points below one's
# a killed coordinator's streams outlive its lease (6 s) at this length, so that it is the
# workers' aborts, not the requests' own end, that frees them
KILL_TOKENS = 4000
Draw = tuple[list[RequestRecord], float]  # one open-loop run: its requests and its wall time


class Pool:
    """The Ray head, the shared pool and two coordinators of it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.head = RayHead()
        model = build_tiny_model(workdir / "model", max_positions=8192)
        self.config = {
            "backend_config": {
                "model_path": str(model),
                "device": "cpu",
                "embedding_model_path": "",
                "cacheBlockSize": 16,
                "kvCacheMemoryMB": 160,
                "maxSeqLen": 8192,
                "maxIterTimes": KILL_TOKENS,
                "maxInputTokenLen": 960,
                "num_prefill_instances": 2,
                "num_decode_instances": 1,
                "cluster_name": POOL,
                "ray_address": f"127.0.0.1:{self.head.gcs_port}",
            },
            "request_limit": {"max_requests": 4000},
        }
        path = workdir / "ms_coordinator.json"
        path.write_text(json.dumps(self.config))
        self.workers_command = [
            sys.executable,
            "-m",
            "coordinator",
            "workers",
            "--config",
            str(path),
        ]
        started = subprocess.run(
            self.workers_command, env=self.head.env, capture_output=True, text=True, timeout=300
        )
        if started.returncode != 0:
            raise RuntimeError(f"pdserve workers failed: {started.stderr[-3000:]}")
        self.coordinators = [self.coordinator(f"c{i}") for i in range(2)]
        self.encode = _tokenizer(model)

    def coordinator(self, name: str) -> CoordinatorProcess:
        workdir = self.workdir / f"{name}-{time.monotonic_ns()}"
        workdir.mkdir()
        server = start_coordinator(workdir, self.config, env=RAY_ENV)
        server.wait_ready()
        return server

    def urls(self, count: int) -> list[str]:
        return [c.url("predict_port", "") for c in self.coordinators[:count]]

    def instances(self, index: int = 0) -> list[dict[str, Any]]:
        url = self.coordinators[index].url("manage_port", "/v1/instances")
        return httpx.get(url, timeout=10).json()["instances"]

    def close(self) -> None:
        for server in self.coordinators:
            if server.process.poll() is None:
                server.stop()
        subprocess.run([*self.workers_command, "--stop"], env=self.head.env, capture_output=True)
        self.head.stop()


def _tokenizer(model: Path) -> Encode:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def spread(values: list[float]) -> dict[str, Any] | None:
    """The harness's spread of ``values`` (None: no values)."""
    return stats_spread(values, 4) if values else None


def rate_row(rate: float, draws: list[Draw]) -> dict[str, Any]:
    """One rate of one side, its draws pooled; each draw's own p99 TTFT kept."""
    sent = [s for requests, _ in draws for s in requests]
    ttfts = [s.ttft_s for s in sent if s.ok and s.ttft_s is not None]
    failed = [s.error or "failed" for s in sent if not s.ok]
    per_draw = [
        percentile([s.ttft_s for s in requests if s.ok and s.ttft_s is not None], 99)
        for requests, _ in draws
    ]
    return {
        "rate": rate,
        "requests": len(sent),
        "failed": len(failed),
        "failures": sorted(set(failed))[:5],
        "completed_per_s": sum(s.ok for s in sent) / sum(seconds for _, seconds in draws),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_p99_s_per_draw": per_draw,
        "within_slo": bool(ttfts) and not failed and (percentile(ttfts, 99) or 0) <= TTFT_SLO_S,
        "within_slo_per_draw": [
            p is not None and p <= TTFT_SLO_S and all(s.ok for s in requests)
            for p, (requests, _) in zip(per_draw, draws, strict=True)
        ],
    }


def capacity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The highest rate within the SLO (pooled, and each draw's) and what it completed."""
    held = [row for row in rows if row["within_slo"]]
    best = max(held, key=lambda row: row["rate"]) if held else None
    draws = len(rows[0]["within_slo_per_draw"]) if rows else 0
    per_draw = [
        max((row["rate"] for row in rows if row["within_slo_per_draw"][d]), default=0.0)
        for d in range(draws)
    ]
    return {
        "max_rate": best and best["rate"],
        "completed_per_s_at_slo": best and best["completed_per_s"],
        "max_rate_per_draw": spread(per_draw),
    }


def hit_figures(draws: list[list[RequestRecord]]) -> dict[str, Any]:
    def rate(sent: list[RequestRecord]) -> float:
        done = [s for s in sent if s.ok]
        prompts = sum(s.served_prompt_tokens or 0 for s in done)
        return sum(s.cached_tokens or 0 for s in done) / max(1, prompts)

    pooled = [s for sent in draws for s in sent]
    return {
        "hit_rate": rate(pooled),
        "hit_rate_per_draw": spread([rate(sent) for sent in draws]),
        "requests": len(pooled),
        "failed": sum(not s.ok for s in pooled),
    }


def kill_once(pool: Pool, clients: int, max_tokens: int, restart: bool = True) -> dict[str, Any]:
    """Streams on both coordinators, SIGKILL of the second: seconds until no worker holds a
    request of it (``requests_by_owner`` in ``/v1/instances``: its lease lapses, the workers
    abort them), the survivor's failures (its streams still running a second later are
    abandoned, not awaited: they are long), then the blocks left in use once all is quiet;
    ``restart``: the second coordinator started again."""
    survivor_url, victim_url = pool.urls(2)
    victim_pid = pool.coordinators[1].process.pid
    survivor = streams(survivor_url, clients, max_tokens)
    victim = streams(victim_url, clients, max_tokens)
    time.sleep(3.0)
    held_at_kill = held_by(pool, victim_pid)
    pool.coordinators[1].process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    pool.coordinators[1].process.wait(timeout=10)
    victim.stop()
    freed_s = None
    while time.monotonic() - killed_at < 30:
        if held_by(pool, victim_pid) == 0:
            freed_s = time.monotonic() - killed_at
            break
        time.sleep(0.05)
    time.sleep(1.0)
    sent = survivor.stop(cancel=True)
    deadline = time.monotonic() + 30
    while (
        used := sum(w["num_used_blocks"] for w in pool.instances())
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    if restart:
        pool.coordinators[1] = pool.coordinator("c1")
    return {
        "held_at_kill": held_at_kill,
        # with nothing in flight at the kill there was nothing to free: no figure
        "freed_s": freed_s if held_at_kill else None,
        "survivor_requests": len(sent),
        "survivor_failed": sum(not survived(s) for s in sent),
        "blocks_in_use_after": used,
    }


def survived(record: RequestRecord) -> bool:
    """A survivor's stream ended well, or was streaming when abandoned."""
    return record.ok or (record.error == ABANDONED and record.ttft_s is not None)


def held_by(pool: Pool, pid: int) -> int:
    """The requests the workers hold for the coordinator of process ``pid`` (its id is
    ``host-pid-xxxxxx``)."""
    return sum(
        count
        for worker in pool.instances()
        for owner, count in (worker.get("requests_by_owner") or {}).items()
        if f"-{pid}-" in owner
    )


def per_draw_ratios(caps: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Two's highest rate within the SLO over one's, draw by draw (a draw one side held at no
    rate has no ratio)."""
    one, two = (caps[side]["max_rate_per_draw"] for side in SIDES)
    if one is None or two is None:
        return None
    ratios = [b / a for a, b in zip(one["rounds"], two["rounds"], strict=True) if a and b]
    return spread(ratios)


def failures(sent: list[RequestRecord]) -> dict[str, Any] | None:
    """How many of ``sent`` failed and a few of their distinct errors (None: none failed)."""
    failed = [s.error or "failed" for s in sent if not s.ok]
    return {"count": len(failed), "examples": sorted(set(failed))[:5]} if failed else None


def run(args: argparse.Namespace, on_progress: Any = None) -> dict[str, Any]:
    seeds = draw_seeds(args.draw_set, args.draws)
    short: dict[str, dict[float, list[Draw]]] = {s: {r: [] for r in args.rates} for s in SIDES}
    chat: dict[str, list[list[RequestRecord]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        pool = Pool(Path(tmp))
        try:
            for number, seed in enumerate(seeds):
                for side in rotated(list(SIDES), number):
                    urls = pool.urls(SIDES.index(side) + 1)
                    # the same draw, its texts the side's own: neither side meets the other's
                    # prompts in the workers' prefix caches
                    salted = seed * len(SIDES) + SIDES.index(side)
                    for rate in args.rates:
                        # both sides meet the same arrival times: the draw's, per rate
                        arrivals = seed * 1000 + int(rate)
                        load = (args.seconds, arrivals, salted, args.words, args.max_tokens)
                        draw = asyncio.run(open_loop(urls, rate, *load))
                        short[side][rate].append(draw)
                        print(
                            f"seed {seed} {side} rate {rate}: {rate_row(rate, [draw])}", flush=True
                        )
                        time.sleep(1.0)
                    sent = asyncio.run(
                        chat_mix(urls, salted, pool.encode, args.users, args.turns, 96, 8, 8)
                    )
                    chat[side].append(sent)
                    print(f"seed {seed} {side} chat: {hit_figures([sent])}", flush=True)
                    if on_progress is not None:
                        on_progress({"seeds_done": seeds[: number + 1], "last_side": side})
            kills = [
                kill_once(pool, 8, args.kill_tokens, restart=kill + 1 < args.kills)
                for kill in range(args.kills)
            ]
        finally:
            pool.close()
    return summarize(args, seeds, short, chat, kills)


def summarize(
    args: argparse.Namespace,
    seeds: list[int],
    short: dict[str, dict[float, list[Draw]]],
    chat: dict[str, list[list[RequestRecord]]],
    kills: list[dict[str, Any]],
) -> dict[str, Any]:
    rows = {side: [rate_row(rate, short[side][rate]) for rate in args.rates] for side in SIDES}
    caps = {side: capacity(rows[side]) for side in SIDES}
    hits = {side: hit_figures(chat[side]) for side in SIDES}
    one, two = caps["one"]["completed_per_s_at_slo"], caps["two"]["completed_per_s_at_slo"]
    hit_gap = hits["two"]["hit_rate"] - hits["one"]["hit_rate"]
    freed = [k["freed_s"] for k in kills if k["freed_s"] is not None]
    failed = _failed_by_side(args, short, chat)
    survivors = sum(k["survivor_failed"] for k in kills)
    return {
        "draw_set": args.draw_set,
        "seeds": seeds,
        "setup": _setup(args),
        "short_completions": {side: {"rates": rows[side], **caps[side]} for side in SIDES},
        "throughput_ratio_two_to_one": two / one if one and two else None,
        # per draw (the sides served it in turn, on the same arrivals): paired rounds
        "max_rate_ratio_per_draw": per_draw_ratios(caps),
        "hit_rate_difference_per_draw": paired_differences(
            hits["two"]["hit_rate_per_draw"]["rounds"], hits["one"]["hit_rate_per_draw"]["rounds"]
        ),
        "prefix_chat": hits,
        "hit_rate_difference": hit_gap,
        "hit_rate_goal_met": hit_gap >= -HIT_RATE_GOAL,
        "kill": {"runs": kills, "freed_s": spread(freed), "lease_s": 6.0},
        # a side's failed requests (its survivor's under the kills are counted under kill)
        **({"failed_requests": failed} if failed else {}),
        **({"kill_survivor_failed_requests": survivors} if survivors else {}),
    }


def _failed_by_side(
    args: argparse.Namespace,
    short: dict[str, dict[float, list[Draw]]],
    chat: dict[str, list[list[RequestRecord]]],
) -> dict[str, Any]:
    """Each side's failed requests, short completions and chat (sides with none left out)."""
    return {
        side: f
        for side in SIDES
        if (
            f := failures(
                [s for rate in args.rates for draw, _ in short[side][rate] for s in draw]
                + [s for sent in chat[side] for s in sent]
            )
        )
    }


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    """What the run measured: the pool, the model, the loads, the SLO and the kills."""
    return {
        "workers": "2 prefill + 1 decode, one shared pool (pdserve workers)",
        "model": "tiny random llama (2 layers, hidden 64)",
        "short": {"words": args.words, "max_tokens": args.max_tokens, "seconds": args.seconds},
        "chat": {"users": args.users, "turns": args.turns, "system_tokens": 96},
        "ttft_slo_s": TTFT_SLO_S,
        "arrivals": "the same Poisson times for both sides, per draw and rate",
        "kill": f"{args.kill_tokens}-token streams; freed: no worker holds a request of it",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draw-set", choices=("tuning", "held-out"), default="held-out")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--words", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kill-tokens", type=int, default=KILL_TOKENS, help="a kill's streams'")
    add_output_arguments(parser, "replicas")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    # the report reads ``meta``; the result file keeps its provenance under ``_meta`` too
    meta = {"meta": result_file.meta}
    result = run(args, lambda progress: result_file.write({**meta, **progress}, complete=False))
    result_file.write({**meta, **result})
    print(json.dumps({k: v for k, v in result.items() if k != "short_completions"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
