"""PD disaggregation vs colocated serving on the same cores: the same sweep against pdserve in
each mode, one after the other, each on its own freshly started pdserve:

- ``pd_separate``: the fixed split (``FIXED`` below, whatever pdserve's defaults): 1 prefill +
  1 decode actor, one core each, every prompt handed off;
- ``pd_adaptive``: pdserve's ``pd_separate`` defaults (``ADAPTIVE``): the decode worker
  prefills short prompts itself (and those behind a long prefill queue), in chunks that keep its
  steps within ``stepTargetMs``, and each worker runs extra threads on the other's core while
  that one is idle; swept over ``decode_yield_ms`` (``--adaptive-yields``: ``pd_adaptive@<ms>``
  each, how long a busy decode worker may pause to lend its core to a long prefill, at most 20 %
  of its time; ``pd_adaptive@<ms>:<percent>`` at most ``percent`` (100: no bound), and
  ``pd_adaptive@<ms>:<percent>:<tpot_ms>`` each pause only as long as every running stream
  affords within ``decode_yield_tpot_ms``), the best at each rate and SLO kept, as for
  ``single_node``;
- ``single_node``: one engine on both cores, swept over its chunked-prefill budget
  (``--single-node-budgets``: ``single_node@<maxPrefillTokens>`` each; the best one at each
  rate is the baseline the ratios use);
- with ``--peer llamacpp``, ``llama_server``: llama.cpp's server on the same GGUF, two threads,
  ``--slots`` sequences batched, through its OpenAI-compatible route (``llama_server.py``).

    python benchmarks/compare_modes.py --peer llamacpp --out results/compare_modes.json

Every run is judged against the TTFT / TPOT SLO, and again with a p99 inter-token gap added
(``--slo-itl``). Prints (and writes as Markdown next to the JSON) its tables
(``modes_report.py``): per mode, the highest request rate with SLO attainment >= 90 % under
each SLO, and p99 TPOT / TTFT / inter-token gap and goodput at a common rate; per rate and SLO,
the requests within it and the 95 % interval of that share (the spread one run leaves, one table
per SLO); at the common rate, where pdserve's prompts spent their time (``serving_phases.py``:
per engine role, the mean queueing and compute, and the KV hand-offs' mean transfer); then the
ratios of the goals; plus PNG plots.

``--multihost`` (root) runs both modes across hosts instead: three network namespaces on a
bridge (``netns.py``) with a Ray cluster laid out as the Helm chart lays it out
(``ray_hosts.py``), pdserve and the load generator on the head host, and one CPU on each of
two worker hosts: ``pd_separate`` puts its prefill actor on one and its decode actor on the
other (the KV pages cross the bridge, encrypted), ``single_node`` one engine on each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_serving import parse_args as serving_args  # noqa: E402
from benchmarks.bench_serving import print_report, sweep, workload  # noqa: E402
from benchmarks.llama_server import SLOTS, LlamaServer, gguf_of, server_folder  # noqa: E402
from benchmarks.modes_report import attainment_table, phases_table, ratios, table  # noqa: E402
from benchmarks.netns import TestBed, available  # noqa: E402
from benchmarks.netns import sweep as sweep_beds  # noqa: E402
from benchmarks.ray_hosts import HOSTS, RayOnHosts, start_coordinator  # noqa: E402
from benchmarks.serving_client import Target  # noqa: E402
from benchmarks.serving_metrics import SLO, max_rate_within_slo, rescore  # noqa: E402
from benchmarks.serving_phases import phase_means, scrape  # noqa: E402
from benchmarks.serving_plots import plot_cdfs, plot_goodput  # noqa: E402

MODES = ("pd_separate", "pd_adaptive", "single_node")
# pd_separate whose decode worker prefills short prompts itself (and those behind a long prefill
# queue), in chunks sized to keep its steps within stepTargetMs (docs/architecture.md#routing),
# and whose workers borrow each other's idle core (docs/architecture.md#sharing-idle-cores):
# pdserve's defaults, written out so that a run means the same whatever they become
ADAPTIVE = {
    "local_prefill_tokens": 96,
    "local_prefill_queue_tokens": 1024,
    "stepTargetMs": 100,
    "share_idle_cores": True,
    "decode_yield_ms": 0,
    "decode_yield_percent": 20,  # with decode_yield_ms: paused at most 20 % of the time
    "decode_yield_tpot_ms": 0,
}
# the fixed split, whatever the defaults: every prompt handed off, no shared core
FIXED = {
    "local_prefill_tokens": 0,
    "local_prefill_queue_tokens": 0,
    "stepTargetMs": 0,
    "share_idle_cores": False,
    "decode_yield_ms": 0,
}
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "pd_separate": ("pd_separate", FIXED),
    "single_node": ("single_node", {"stepTargetMs": 0}),
    "pd_adaptive": ("pd_separate", ADAPTIVE),
    # what sharing idle cores adds: pd_adaptive without it
    "pd_adaptive_unshared": ("pd_separate", {**ADAPTIVE, "share_idle_cores": False}),
}
LLAMA_SERVER = "llama_server"
SWEPT_KEY = {"single_node": "maxPrefillTokens", "pd_adaptive": "decode_yield_ms"}
ADAPTIVE_EXTRA_KEYS = ("decode_yield_percent", "decode_yield_tpot_ms")  # pd_adaptive@MS:P:T


def settings(mode: str) -> tuple[str, dict[str, Any]]:
    """The deploy mode and backend_config keys of ``mode`` (``single_node@<maxPrefillTokens>``
    and ``pd_adaptive@<decode_yield_ms>[:<decode_yield_percent>[:<decode_yield_tpot_ms>]]``
    too)."""
    name, _, value = mode.partition("@")
    value, *more = value.split(":")
    extra = dict(zip(ADAPTIVE_EXTRA_KEYS, more, strict=False))
    most = len(ADAPTIVE_EXTRA_KEYS) if name == "pd_adaptive" else 0
    known = all(v.isdigit() for v in [value, *more]) and len(more) <= most
    if name not in SETTINGS or (value and (name not in SWEPT_KEY or not known)):
        raise ValueError(
            f"unknown mode {mode!r}: one of {', '.join(SETTINGS)}, single_node@N, "
            "pd_adaptive@MS[:PERCENT[:TPOT_MS]]"
        )
    deploy_mode, keys = SETTINGS[name]
    swept = {SWEPT_KEY[name]: int(value)} if value else {}
    return deploy_mode, {**keys, **swept, **{k: int(v) for k, v in extra.items()}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_pdserve(
    mode: str, model: str, workdir: Path, backend: dict[str, Any] | None = None
) -> tuple[subprocess.Popen, dict]:
    """pdserve in ``mode`` on this machine, once ready; ``backend`` adds ``backend_config``
    keys. Its config and log are ``workdir/{mode}.json`` and ``.log``."""
    names = ("predict_port", "manage_port", "status_port", "external_port")
    ports = {name: free_port() for name in names}
    backend = {"model_path": model, "embedding_model_path": "", "device": "cpu", **(backend or {})}
    config = {
        "http_config": ports,
        "digs_scheduler_config": {"deploy_mode": mode},
        "backend_config": backend,
    }
    path = workdir / f"{mode}.json"
    path.write_text(json.dumps(config))
    log = open(workdir / f"{mode}.log", "w")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 600
    ready = f"http://127.0.0.1:{ports['status_port']}/v1/readiness"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdserve ({mode}) exited; see {workdir / f'{mode}.log'}")
        try:
            if httpx.get(ready, timeout=2).status_code == 200:
                return process, ports
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"pdserve ({mode}) not ready in 600 s")


class Deployment:
    """Where a mode's pdserve runs: here (``run`` calls in this thread), or on the test bed's
    head host (``run`` calls from a thread in its network)."""

    def __init__(self, mode: str, args: argparse.Namespace, workdir: Path, ray: Any) -> None:
        self._hosted = self._process = self._server = None
        self.run: Any = lambda fn: fn()
        self.metrics_url: str | None = None  # pdserve's /metrics (llama-server: none)
        if mode == LLAMA_SERVER:
            folder = server_folder(args.llama_cpp_dir)
            log = workdir / f"{mode}.log"
            self._server = LlamaServer(folder, gguf_of(args.model), free_port(), 2, log, args.slots)
            self.target = Target(self._server.url, api="completions")
            return
        deploy_mode, keys = settings(mode)
        if ray is None:
            (workdir / mode).mkdir(parents=True, exist_ok=True)
            self._process, ports = start_pdserve(deploy_mode, args.model, workdir / mode, keys)
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
            self._process.send_signal(signal.SIGTERM)
            self._process.wait(timeout=120)


def run_mode(
    mode: str, args: argparse.Namespace, workdir: Path, ray: RayOnHosts | None = None
) -> dict[str, Any]:
    """The sweep against ``mode``. Each rate gets requests of its own (a cache that kept an
    earlier rate's prompts would flatter the later ones), the same for every mode."""
    deployment = Deployment(mode, args, workdir, ray)
    rates = args.request_rates.split(",")
    try:
        bench = serving_args(
            [
                "--num-requests",
                str(args.num_requests * len(rates)),
                "--mix",
                args.mix,
                "--slo-ttft",
                str(args.slo_ttft),
                "--slo-tpot",
                str(args.slo_tpot),
                "--label",
                mode,
                *_common(args, args.seed),
            ]  # fmt: skip
        )
        pool = workload(bench)
        target = deployment.target
        warmup = serving_args(["--request-rates", "inf", "--no-progress", *_common(args, -1)])
        slo = SLO(args.slo_ttft, args.slo_tpot)
        # kernels, caches, first batches: one request of each kind alone (each path once, on
        # idle workers), then a burst; prompts of their own
        spare = workload(serving_args(["--mix", args.mix, *_common(args, args.seed + 1)]))
        firsts = list({item.kind: item for item in reversed(spare)}.values())
        for burst in [*([item] for item in firsts), spare[-4:]]:
            deployment.run(lambda burst=burst: asyncio.run(sweep(target, burst, warmup, SLO())))
        runs = []
        for i, rate in enumerate(rates):
            items = pool[i * args.num_requests : (i + 1) * args.num_requests]
            bench.request_rates = rate
            before = deployment.phases()
            one = deployment.run(lambda items=items: asyncio.run(sweep(target, items, bench, slo)))
            if deployment.metrics_url is not None:
                one["runs"][0]["phases"] = phase_means(before, deployment.phases())
            runs += one["runs"]
    finally:
        deployment.stop()
    result = {**one, "runs": runs, "max_rate_within_slo": max_rate_within_slo(runs)}
    result["workload"]["num_requests"] = len(pool)
    result["workload"]["kinds"] = dict(Counter(item.kind for item in pool))
    result["with_itl_slo"] = rescore(runs, SLO(args.slo_ttft, args.slo_tpot, args.slo_itl))
    print_report(result)
    return result


def _common(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--tokenizer", args.model, "--seed", str(seed)]


def expand_modes(args: argparse.Namespace) -> list[str]:
    """``--modes`` with ``single_node`` swept over ``--single-node-budgets`` and
    ``pd_adaptive`` over ``--adaptive-yields``, and the peer."""
    sweeps = {
        "single_node": [b for b in args.single_node_budgets.split(",") if b],
        "pd_adaptive": [y for y in args.adaptive_yields.split(",") if y],
    }
    modes: list[str] = []
    for mode in args.modes.split(","):
        values = sweeps.get(mode)
        modes += [f"{mode}@{value}" for value in values] if values else [mode]
    for mode in modes:
        settings(mode)  # fails early on a name it does not know
    return modes + ([LLAMA_SERVER] if args.peer == "llamacpp" else [])


def run_modes(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, Any]]:
    modes = expand_modes(args)
    if args.multihost and LLAMA_SERVER in modes:
        sys.exit("--multihost: llama-server runs on this host only; leave out --peer")
    if not args.multihost:
        return {mode: run_mode(mode, args, workdir) for mode in modes}
    why = available()
    if why is not None:
        sys.exit(f"--multihost: {why}")
    sweep_beds()
    with TestBed(HOSTS, workdir / "bed") as bed:
        ray = RayOnHosts(bed)
        ray.start_all()
        return {mode: run_mode(mode, args, workdir, ray) for mode in modes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument(
        "--single-node-budgets",
        default="1024,8192",  # 256 lost at every rate in every run so far
        help="maxPrefillTokens values single_node is swept over ('': its default only)",
    )
    parser.add_argument(
        "--adaptive-yields",
        default="0,3000:100,3000:100:140",  # smoothest; fastest to first token; per-stream bound
        help="decode_yield_ms[:decode_yield_percent[:decode_yield_tpot_ms]] settings pd_adaptive "
        "is swept over ('': its ADAPTIVE value only)",
    )
    parser.add_argument("--peer", choices=("llamacpp",), help="also run llama-server")
    parser.add_argument("--llama-cpp-dir", type=Path, help="a folder holding llama-server")
    parser.add_argument("--slots", type=int, default=SLOTS, help="llama-server's parallel slots")
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/compare_modes.json")
    parser.add_argument(
        "--multihost", action="store_true", help="both modes across hosts in network namespaces"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-modes-") as tmp:
        results = run_modes(args, Path(tmp))
    spread = [attainment_table(results, with_gap) for with_gap in (False, True)]
    phases = phases_table(results, args.common_rate)
    summary = "\n\n".join([table(results, args.common_rate), *spread, phases])
    goals = ratios(results, args.common_rate)
    report = {
        "machine": f"{os.cpu_count()} cores{', 3 hosts in namespaces' if args.multihost else ''}",
        "date": time.strftime("%Y-%m-%d"),
        "minutes": (time.monotonic() - started) / 60,
        "settings": vars(args),
        "ratios": goals,
        "table": summary,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(summary + "\n")
    plot_goodput(results, out.with_suffix(".goodput.png"))
    plot_cdfs(results, out.with_suffix(".cdf.png"))
    print(summary)
    print(f"ratios: {json.dumps(goals, indent=1)}  ({report['minutes']:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
