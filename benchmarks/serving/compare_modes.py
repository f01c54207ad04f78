"""PD disaggregation vs colocated serving vs llama-server on the same cores: the same sweep
against every mode, each on its own freshly started server, over several independent draws.

- ``pd_separate``: the fixed split (``FIXED`` below, whatever pdserve's defaults): 1 prefill +
  1 decode actor, one core each, every prompt handed off;
- ``pd_adaptive``: pdserve's ``pd_separate`` defaults (``ADAPTIVE``): the decode worker
  prefills short prompts itself (and those behind a long prefill queue), in chunks that keep its
  steps within ``stepTargetMs``;
- ``single_node``: one engine on both cores, swept over its chunked-prefill budget
  (``--single-node-budgets``: ``single_node@<maxPrefillTokens>``), the best at each rate kept;
- with ``--peer llamacpp``, ``llama_server``: llama.cpp's server on the same GGUF through its
  OpenAI-compatible route, swept the same way over ``--llama-server-settings``
  (``llama_server@<slots>:<batch>:<ubatch>:<threads>``; by default slots 4/8/16, ``-b``/``-ub``
  512/128 and 2048/512, 2 threads and 1 thread on a core of its own), the best at each rate kept.

    python -m benchmarks.serving.compare_modes --peer llamacpp   # benchmarks/results/
    python -m benchmarks.serving.compare_modes --scratch ...     # a trial run, outside them

**Draws.** Each of ``--draws`` draws is a seed: its ``--num-requests`` request shapes (kind,
prompt and output lengths, in one order) are served at every rate, re-timed by the rate's
Poisson arrivals, with text of the rate's own (no rate finds another's prompts in a prefix
cache), so the rates differ in their arrivals only; the JSON records each rate's offered prompt
and output tokens/s (``offered_load``). The same requests go to every mode, the modes' order
rotating from draw to draw. The seeds come from ``--draw-set``: ``held-out`` (the default: seeds
no setting or constant was ever tuned on; the README's figures come from these only) or
``tuning`` (for trying settings). A mode's draws are pooled per rate (``draws.py``): the
requests within the SLO summed over the draws with their 95 % interval, and the highest rate
the mode holds >= 90 % at on its own, beside the monotone figure (every lower rate held too).

**Closed loop.** On each draw's server, after the sweep, ``--closed-loop`` concurrencies
(default 1, 8, 32) of streams each sending ~100-token prompts back to back for 128 greedy tokens
(``ignore_eos``) through streaming ``/v1/completions``: output tokens/s and TTFT / TPOT p50 and
p99 per mode, the load a user runs first.

Every sweep is judged against the TTFT / TPOT SLO, and again with a p99 inter-token gap added
(``--slo-itl``). Prints (and writes as Markdown next to the JSON) its tables
(``modes_report.py``); the JSON holds the pooled summaries (no per-request logs), what each side
was given and the machine (``results_meta.py``); ``--plots`` adds a PNG of goodput and
attainment by rate.

``--multihost`` (root) runs the pdserve modes across hosts instead: three network namespaces on a
bridge (``netns.py``) with a Ray cluster laid out as the Helm chart lays it out
(``ray_hosts.py``), pdserve and the load generator on the head host, and one CPU on each of
two worker hosts: ``pd_separate`` puts its prefill actor on one and its decode actor on the
other (the KV pages cross the bridge, encrypted), ``single_node`` one engine on each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness.client import Target
from benchmarks.harness.launch import (
    HTTP_SETTINGS,
    MODES,
    SETTINGS,
    free_port,
    start_pdserve,
    stop_pdserve,
)
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.llamacpp.server import (
    LlamaServer,
    ServerSetting,
    gguf_of,
    server_folder,
    sweep_settings,
)
from benchmarks.serving.draws import DRAW_SETS, draw_seeds, pool_draws, rotated
from benchmarks.serving.metrics import (
    SLO,
    max_rate_within_slo,
)
from benchmarks.serving.modes_report import ratios, render
from benchmarks.serving.phases import phase_means, scrape
from benchmarks.serving.plots import plot_goodput
from benchmarks.serving.rate_sweep import (
    flag_failures,
    make_encoder,
    print_report,
    sweep,
    sweep_args,
    workload,
)
from benchmarks.serving.workload import (
    WORDS,
    WorkItem,
    decode_prefix,
    offered_load,
    parse_mix,
    rate_workloads,
    shapes_of,
)
from testbed.netns import TestBed, available
from testbed.netns import sweep as sweep_beds
from testbed.ray_hosts import HOSTS, RayOnHosts, start_coordinator

LLAMA_SERVER = "llama_server"
SWEPT_KEY = {"single_node": "maxPrefillTokens"}


def settings(mode: str) -> tuple[str, dict[str, Any]]:
    """The deploy mode and backend_config keys of ``mode`` (``single_node@<maxPrefillTokens>``
    too)."""
    name, _, value = mode.partition("@")
    if name == LLAMA_SERVER:
        raise ValueError(f"{mode!r} is llama-server's (llama_server_setting)")
    if name not in SETTINGS or (value and (name not in SWEPT_KEY or not value.isdigit())):
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(SETTINGS)}, single_node@N")
    deploy_mode, keys = SETTINGS[name]
    swept = {SWEPT_KEY[name]: int(value)} if value else {}
    return deploy_mode, {**keys, **swept}


def llama_server_setting(mode: str) -> ServerSetting:
    """What ``llama_server`` or ``llama_server@<slots>:<batch>:<ubatch>:<threads>`` is given."""
    name, _, value = mode.partition("@")
    if name != LLAMA_SERVER:
        raise ValueError(f"{mode!r} is not a llama_server mode")
    return ServerSetting.parse(value)


class Deployment:
    """Where a mode's pdserve runs: here (``run`` calls in this thread), or on the test bed's
    head host (``run`` calls from a thread in its network)."""

    def __init__(self, mode: str, args: argparse.Namespace, workdir: Path, ray: Any) -> None:
        self._hosted = self._process = self._server = None
        self.run: Any = lambda fn: fn()
        self.metrics_url: str | None = None  # pdserve's /metrics (llama-server: none)
        self.given: dict[str, Any] = {}
        self._peer: tuple[Path, Path, Path, ServerSetting] | None = None
        if mode.partition("@")[0] == LLAMA_SERVER:
            folder = server_folder(args.llama_cpp_dir)
            log = workdir / f"{mode.replace(':', '_')}.log"
            setting = llama_server_setting(mode)
            self._peer = (folder, gguf_of(args.model), log, setting)
            self._server = LlamaServer(folder, gguf_of(args.model), free_port(), log, setting)
            self.target = Target(self._server.url, api="completions")
            self.given = {**setting.to_dict(), "command": self._server.command[1:]}
            self.load_cpus = _other_cpus(setting.cpus())
            return
        self.load_cpus = None
        deploy_mode, keys = settings(mode)
        http = HTTP_SETTINGS.get(mode.partition("@")[0], {})
        self.given = {"deploy_mode": deploy_mode, "backend_config": keys, "http_config": http}
        if ray is None:
            (workdir / mode).mkdir(parents=True, exist_ok=True)
            self._process, ports = start_pdserve(
                deploy_mode, args.model, workdir / mode, keys, http
            )
            self.target = Target(f"http://127.0.0.1:{ports['predict_port']}")
            self.metrics_url = f"http://127.0.0.1:{ports['external_port']}/metrics"
            return
        backend: dict[str, Any] = {"model_path": args.model, "device": "cpu", **keys}
        if deploy_mode == "single_node":  # one engine on each worker host's CPU
            backend |= {"num_colocated_instances": 2, "colocated_resources": {"num_cpus": 1}}
        sections = {"digs_scheduler_config": {"deploy_mode": deploy_mode}}
        self._hosted = start_coordinator(ray, backend, workdir / mode, sections)
        self._hosted.wait_ready(600)
        self.target = Target(self._hosted.url("predict_port", ""))
        self.metrics_url = self._hosted.url("external_port", "/metrics")
        self.run = self._hosted.host.call

    @contextlib.contextmanager
    def streams(self, n: int) -> Iterator[tuple[Target, int | None]]:
        """Where ``n`` closed-loop streams go, and llama-server's slots there (None: pdserve's
        own batching). llama-server with fewer slots than streams would queue the rest, so a
        server of ``n`` slots (the setting's batches and threads) serves them instead."""
        if self._peer is None:
            yield Target(self.target.url, api="completions"), None  # any model name
            return
        folder, gguf, log, setting = self._peer
        if setting.slots >= n:
            yield Target(self.target.url, api="completions"), setting.slots
            return
        wider = dataclasses.replace(setting, slots=n)
        own_log = log.with_name(f"{log.stem}-streams{n}.log")
        server = LlamaServer(folder, gguf, free_port(), own_log, wider, CLOSED_LOOP_CONTEXT)
        try:
            yield Target(server.url, api="completions"), n
        finally:
            server.stop()

    def phases(self) -> dict[tuple[str, str], float]:
        """The queue, prefill and transfer histograms' sums and counts so far (serving_phases)."""
        url = self.metrics_url
        return {} if url is None else self.run(lambda: scrape(url))

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        elif self._hosted is not None:
            self._hosted.stop(120)
        elif self._process is not None:
            stop_pdserve(self._process)


def run_mode(
    mode: str, args: argparse.Namespace, workdir: Path, seed: int, ray: RayOnHosts | None = None
) -> dict[str, Any]:
    """The sweep (and the closed loop) of one draw (``seed``) against ``mode``. Every rate serves
    the draw's request shapes in the same order, with text of its own (a cache that kept an
    earlier rate's prompts would flatter the later ones), the same for every mode."""
    deployment = Deployment(mode, args, workdir, ray)
    rates = args.request_rates.split(",")
    try:
        bench = _bench_args(mode, args, seed)
        encode = make_encoder(args.model)
        by_rate = rate_workloads(args.num_requests, parse_mix(args.mix), encode, seed, len(rates))
        target = deployment.target
        warmup = sweep_args(["--request-rates", "inf", "--no-progress", *_common(args, -1)])
        slo = SLO(args.slo_ttft, args.slo_tpot)
        # kernels, caches, first batches: one request of each kind alone (each path once, on
        # idle workers), then a burst; prompts of their own
        spare = workload(sweep_args(["--mix", args.mix, *_common(args, WARMUP_SEED + seed)]))
        firsts = list({item.kind: item for item in reversed(spare)}.values())
        with _pinned(deployment.load_cpus):
            for burst in [*([item] for item in firsts), spare[-4:]]:
                deployment.run(lambda b=burst: asyncio.run(sweep(target, b, warmup, SLO())))
            one, runs = _sweep_rates(deployment, target, by_rate, rates, bench, slo)
            loops = closed_loop(deployment, args, seed)
    finally:
        deployment.stop()
    result = {**one, "runs": runs, "max_rate_within_slo": max_rate_within_slo(runs)}
    result |= flag_failures(runs)
    result["workload"] = draw_workload(seed, rates, by_rate)
    result["closed_loop"] = loops
    result["given"] = deployment.given
    print_report(result)
    return result


def _bench_args(mode: str, args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """The rate sweep's settings for ``mode`` on the draw ``seed``."""
    return sweep_args(
        [
            "--num-requests",
            str(args.num_requests),
            "--mix",
            args.mix,
            "--slo-ttft",
            str(args.slo_ttft),
            "--slo-tpot",
            str(args.slo_tpot),
            "--label",
            mode,
            *_common(args, seed),
        ]  # fmt: skip
    )


def _sweep_rates(
    deployment: Deployment,
    target: Target,
    by_rate: list[list[WorkItem]],
    rates: list[str],
    bench: argparse.Namespace,
    slo: SLO,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each rate's requests served in turn (with its phases where pdserve's metrics tell them):
    the last rate's sweep, and every rate's run."""
    runs = []
    for items, rate in zip(by_rate, rates, strict=True):
        bench.request_rates = rate
        before = deployment.phases()
        one = deployment.run(lambda it=items: asyncio.run(sweep(target, it, bench, slo)))
        if deployment.metrics_url is not None:
            one["runs"][0]["phases"] = phase_means(before, deployment.phases())
        runs += one["runs"]
    return one, runs


def draw_workload(seed: int, rates: list[str], by_rate: list[list[WorkItem]]) -> dict[str, Any]:
    """What a draw served: its shapes (the same at every rate), and per rate the offered prompt
    and output tokens/s."""
    first = by_rate[0]
    return {
        "seed": seed,
        "kinds": dict(Counter(item.kind for item in first)),
        "shapes": [list(shape) for shape in shapes_of(first)],
        "same_shapes_every_rate": all(shapes_of(items) == shapes_of(first) for items in by_rate),
        "offered_load": {
            rate: offered_load(items, None if rate == "inf" else float(rate))
            for rate, items in zip(rates, by_rate, strict=True)
        },
    }


WARMUP_SEED = 100_000  # warm-up prompts: seeds of their own, never a draw's
CLOSED_LOOP_PROMPT, CLOSED_LOOP_OUTPUT = 100, 128
CLOSED_LOOP_CONTEXT = 512  # KV tokens per llama-server slot: a prompt and its output, with room


def closed_loop(deployment: Deployment, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Per concurrency N of ``--closed-loop``: N streams sending requests back to back
    (``--closed-loop-turns`` each, at least 4 requests in all), ~100-token prompts of their own,
    128 greedy tokens out, through streaming ``/v1/completions``; output tokens/s and the
    latency percentiles. llama-server has a slot per stream (``Deployment.streams``)."""
    settings_ = sweep_args(["--no-progress", *_common(args, seed)])
    encode = make_encoder(args.model)
    rng = random.Random(f"closed-loop-{seed}")
    out: dict[str, Any] = {}
    for n in [int(c) for c in args.closed_loop.split(",") if c]:
        items = [_loop_item(rng, encode) for _ in range(max(4, args.closed_loop_turns * n))]
        settings_.concurrency = n
        settings_.request_rates = "inf"
        with deployment.streams(n) as (target, slots):
            one = deployment.run(
                lambda it=items, t=target: asyncio.run(sweep(t, it, settings_, SLO()))
            )
        summary = one["runs"][0]["summary"]
        kept = ("num_requests", "num_failed", "failed_requests", "duration_s")
        kept = (*kept, "output_token_throughput")
        out[str(n)] = {key: summary[key] for key in (*kept, "ttft_s", "tpot_s")}
        if slots is not None:
            out[str(n)]["slots"] = slots
    return out


def _loop_item(rng: random.Random, encode: Any) -> WorkItem:
    words = " ".join(rng.choice(WORDS) for _ in range(CLOSED_LOOP_PROMPT))
    text = decode_prefix(words, encode, CLOSED_LOOP_PROMPT)
    return WorkItem(text, CLOSED_LOOP_OUTPUT, "closed_loop", len(encode(text)))


def _other_cpus(taken: set[int] | None) -> set[int] | None:
    """The cores left to the load generator beside a pinned server (None: no pinning)."""
    if not taken:
        return None
    rest = os.sched_getaffinity(0) - taken
    return rest or None


@contextlib.contextmanager
def _pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process (the load generator) on ``cpus`` meanwhile (None: as it was)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _common(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--tokenizer", args.model, "--seed", str(seed)]


def expand_modes(args: argparse.Namespace) -> list[str]:
    """``--modes`` with ``single_node`` swept over ``--single-node-budgets``, and the peer over
    ``--llama-server-settings``."""
    sweeps = {"single_node": [b for b in args.single_node_budgets.split(",") if b]}
    modes: list[str] = []
    for mode in args.modes.split(","):
        values = sweeps.get(mode)
        modes += [f"{mode}@{value}" for value in values] if values else [mode]
    for mode in modes:
        settings(mode)  # fails early on a name it does not know
    if args.peer != "llamacpp":
        return modes
    peers = [f"{LLAMA_SERVER}@{s}" for s in args.llama_server_settings.split(",") if s]
    for peer in peers:
        llama_server_setting(peer)
    return modes + (peers or [LLAMA_SERVER])


def run_draws(
    modes: list[str],
    seeds: list[int],
    args: argparse.Namespace,
    workdir: Path,
    ray: Any = None,
    on_draw: Any = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every mode on every draw, the order rotating per draw; each mode's sweeps by draw.
    ``on_draw(mode, seed, result)`` sees each as it ends (for partial result files)."""
    draws: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for number, seed in enumerate(seeds):
        for mode in rotated(modes, number):
            print(f"draw {number + 1}/{len(seeds)} (seed {seed}): {mode}", flush=True)
            draws[mode].append(run_mode(mode, args, workdir, seed, ray))
            if on_draw is not None:
                on_draw(mode, seed, draws[mode][-1])
    return draws


def run_modes(
    args: argparse.Namespace, workdir: Path, on_draw: Any = None
) -> dict[str, dict[str, Any]]:
    modes = expand_modes(args)
    seeds = _seeds(args)
    if args.multihost and any(m.startswith(LLAMA_SERVER) for m in modes):
        sys.exit("--multihost: llama-server runs on this host only; leave out --peer")
    if not args.multihost:
        draws = run_draws(modes, seeds, args, workdir, on_draw=on_draw)
    else:
        why = available()
        if why is not None:
            sys.exit(f"--multihost: {why}")
        sweep_beds()
        with TestBed(HOSTS, workdir / "bed") as bed:
            ray = RayOnHosts(bed)
            ray.start_all()
            draws = run_draws(modes, seeds, args, workdir, ray, on_draw)
    slo, gap = SLO(args.slo_ttft, args.slo_tpot), SLO(args.slo_ttft, args.slo_tpot, args.slo_itl)
    pooled = {}
    for mode, sweeps in draws.items():
        pooled[mode] = pool_draws(sweeps, slo, gap)
        pooled[mode]["closed_loop_by_draw"] = [one["closed_loop"] for one in sweeps]
        pooled[mode]["given"] = sweeps[0]["given"]
        pooled[mode] |= flag_failures(pooled[mode]["runs"])
    return pooled


def _seeds(args: argparse.Namespace) -> list[int]:
    if args.seeds:
        return [int(seed) for seed in args.seeds.split(",")]
    return draw_seeds(args.draw_set, args.draws)


def draw_set_of(seeds: list[int]) -> str:
    """The name of the set ``seeds`` all belong to, else ``custom``."""
    return next((n for n, known in DRAW_SETS.items() if set(seeds) <= set(known)), "custom")


def _parser() -> argparse.ArgumentParser:
    """The command line of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument(
        "--single-node-budgets",
        default="1024,8192",  # 256 lost at every rate in every run so far
        help="maxPrefillTokens values single_node is swept over ('': its default only)",
    )
    parser.add_argument("--peer", choices=("llamacpp",), help="also run llama-server")
    parser.add_argument("--llama-cpp-dir", type=Path, help="a folder holding llama-server")
    parser.add_argument(
        "--llama-server-settings",
        default=",".join(sweep_settings("4,8,16", "512/128,2048/512", "2,1")),
        help="SLOTS:BATCH:UBATCH:THREADS settings llama-server is swept over",
    )
    parser.add_argument("--draw-set", choices=tuple(DRAW_SETS), default="held-out")
    parser.add_argument("--draws", type=int, default=3, help="independent draws (seeds)")
    parser.add_argument("--seeds", default="", help="explicit draw seeds (overrides the set)")
    parser.add_argument(
        "--closed-loop", default="1,8,32", help="closed-loop concurrencies ('': none)"
    )
    parser.add_argument(
        "--closed-loop-turns", type=int, default=2, help="requests per closed-loop stream"
    )
    parser.add_argument("--plots", action="store_true", help="also write PNG plots")
    _add_sweep_arguments(parser)
    add_output_arguments(parser, "compare_modes")
    parser.add_argument(
        "--multihost", action="store_true", help="both modes across hosts in network namespaces"
    )
    return parser


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the rate sweep: its rates, requests and SLOs."""
    parser.add_argument("--request-rates", default="0.5,0.75,1,1.25,1.5")
    parser.add_argument("--common-rate", type=float, default=1.0)
    # 30 per rate left rankings resting on one or two requests (the spread table shows it)
    parser.add_argument("--num-requests", type=int, default=60, help="per rate")
    parser.add_argument("--mix", default="chat=0.6,summarise=0.2,generate=0.2")
    parser.add_argument("--slo-ttft", type=float, default=3.0)
    parser.add_argument("--slo-tpot", type=float, default=0.150)
    parser.add_argument(
        "--slo-itl", type=float, default=0.25, help="seconds: a request's p99 inter-token gap"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    out = result_file.path
    started = time.monotonic()
    seeds = _seeds(args)
    head = {
        **result_file.meta,  # at the top level too: the report's provenance line reads it there
        "hosts": "3 hosts in namespaces" if args.multihost else "this machine",
        "draw_set": draw_set_of(seeds),
        "seeds": seeds,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "common_rate": args.common_rate,
    }
    done: list[dict[str, Any]] = []

    def on_draw(mode: str, seed: int, result: dict[str, Any]) -> None:
        brief = {"mode": mode, "seed": seed, "max_rate_within_slo": result["max_rate_within_slo"]}
        done.append(brief | flag_failures(result["runs"]))
        result_file.write({**head, "draws_done": done}, complete=False)

    with tempfile.TemporaryDirectory(prefix="pdserve-modes-") as tmp:
        results = run_modes(args, Path(tmp), on_draw)
    summary = render(results, args.common_rate)
    goals = ratios(results, args.common_rate)
    report = _report(head, started, results, goals)
    result_file.write(report)
    out.with_suffix(".md").write_text(summary + "\n")
    if args.plots:
        plot_goodput(results, out.with_suffix(".goodput.png"))  # pooled: no per-request CDFs
    print(summary)
    print(f"ratios: {json.dumps(goals, indent=1)}  ({report['minutes']:.1f} min)")
    return 0


def _report(
    head: dict[str, Any], started: float, results: dict[str, dict[str, Any]], goals: dict
) -> dict[str, Any]:
    """The result file's JSON: the run's head, its minutes, the offered load, the goals'
    ratios, the pooled results and any failed requests."""
    first = next(iter(results.values()))
    report = {
        **head,
        "minutes": round((time.monotonic() - started) / 60, 1),
        # per draw (seed), per rate: the prompt and output tokens/s its fixed shapes offer
        "offered_load": {str(w["seed"]): w["offered_load"] for w in first["workload"]},
        "ratios": goals,
        "results": results,
    }
    failing = {m: r["failed_requests"] for m, r in results.items() if r.get("failed_requests")}
    if failing:
        report["failed_requests"] = failing
    return report


if __name__ == "__main__":
    sys.exit(main())
