"""PD disaggregation vs colocated serving on the same cores: the same sweep against pdserve in
``pd_separate`` (1 prefill + 1 decode actor, one core each) and in ``single_node`` (one engine
on both cores), one after the other, each on its own freshly started pdserve; with
``--modes pd_separate,pd_adaptive,single_node`` also ``pd_adaptive``: ``pd_separate`` whose decode
worker prefills short prompts itself, in chunks that keep its steps within ``stepTargetMs``
(``ADAPTIVE`` below).

    python benchmarks/compare_modes.py --out results/compare_modes.json

Prints (and writes as Markdown next to the JSON) one table: the highest request rate with SLO
attainment >= 90 %, and p99 TPOT / TTFT at a common rate, for each mode; plus PNG plots.

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
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_serving import parse_args as serving_args  # noqa: E402
from benchmarks.bench_serving import print_report, sweep, workload  # noqa: E402
from benchmarks.netns import TestBed, available  # noqa: E402
from benchmarks.netns import sweep as sweep_beds  # noqa: E402
from benchmarks.ray_hosts import HOSTS, RayOnHosts, start_coordinator  # noqa: E402
from benchmarks.serving_client import Target  # noqa: E402
from benchmarks.serving_metrics import SLO  # noqa: E402
from benchmarks.serving_plots import plot_cdfs, plot_goodput  # noqa: E402

MODES = ("pd_separate", "single_node")
# pd_separate whose decode worker prefills short prompts itself (and those behind a long prefill
# queue), in chunks sized to keep its steps within stepTargetMs (docs/architecture.md#routing)
ADAPTIVE = {"local_prefill_tokens": 96, "local_prefill_queue_tokens": 1024, "stepTargetMs": 100}
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "pd_separate": ("pd_separate", {}),
    "single_node": ("single_node", {}),
    "pd_adaptive": ("pd_separate", ADAPTIVE),
}


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
        deploy_mode, settings = SETTINGS[mode]
        if ray is None:
            (workdir / mode).mkdir(parents=True, exist_ok=True)
            self._process, ports = start_pdserve(deploy_mode, args.model, workdir / mode, settings)
            self.url = f"http://127.0.0.1:{ports['predict_port']}"
            self.run: Any = lambda fn: fn()
            self._hosted = None
            return
        backend: dict[str, Any] = {"model_path": args.model, "device": "cpu", **settings}
        if deploy_mode == "single_node":  # one engine on each worker host's CPU
            backend |= {"num_colocated_instances": 2, "colocated_resources": {"num_cpus": 1}}
        sections = {"digs_scheduler_config": {"deploy_mode": deploy_mode}}
        self._hosted = start_coordinator(ray, backend, workdir / mode, sections)
        self._hosted.wait_ready(600)
        self.url = self._hosted.url("predict_port", "")
        self.run = self._hosted.host.call

    def stop(self) -> None:
        if self._hosted is not None:
            self._hosted.stop(120)
            return
        self._process.send_signal(signal.SIGTERM)
        self._process.wait(timeout=120)


def run_mode(
    mode: str, args: argparse.Namespace, workdir: Path, ray: RayOnHosts | None = None
) -> dict[str, Any]:
    deployment = Deployment(mode, args, workdir, ray)
    try:
        bench = serving_args(
            [
                "--num-requests",
                str(args.num_requests),
                "--request-rates",
                args.request_rates,
                "--mix",
                args.mix,
                "--tokenizer",
                args.model,
                "--slo-ttft",
                str(args.slo_ttft),
                "--slo-tpot",
                str(args.slo_tpot),
                *(["--slo-itl", str(args.slo_itl)] if args.slo_itl else []),
                "--seed",
                str(args.seed),
                "--label",
                mode,
            ]  # fmt: skip
        )
        items = workload(bench)
        target = Target(deployment.url)
        warmup = serving_args(["--request-rates", "inf", "--no-progress", *_common(args)])
        slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_itl)
        # kernels, caches, first batches
        deployment.run(lambda: asyncio.run(sweep(target, items[:4], warmup, SLO())))
        result = deployment.run(lambda: asyncio.run(sweep(target, items, bench, slo)))
    finally:
        deployment.stop()
    print_report(result)
    return result


def _common(args: argparse.Namespace) -> list[str]:
    return ["--tokenizer", args.model, "--seed", str(args.seed)]


def at_rate(result: dict[str, Any], rate: float) -> dict[str, Any] | None:
    return next((r["summary"] for r in result["runs"] if r["request_rate"] == rate), None)


def table(results: dict[str, dict[str, Any]], common_rate: float) -> str:
    at = f"@ {common_rate} req/s"
    lines = [
        f"| mode | max rate with >= 90 % SLO attainment (req/s) | p99 TPOT {at} (ms) | "
        f"p99 TTFT {at} (s) | p99 inter-token gap {at} (ms) | goodput {at} (req/s) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, result in results.items():
        summary = at_rate(result, common_rate) or {}
        p99 = {key: (summary.get(key) or {}).get("p99") for key in ("tpot_s", "ttft_s", "itl_s")}
        ttft = "-" if p99["ttft_s"] is None else f"{p99['ttft_s']:.2f}"
        lines.append(
            f"| {mode} | {result['max_rate_within_slo']} | {_ms(p99['tpot_s'])} | {ttft} | "
            f"{_ms(p99['itl_s'])} | {summary.get('goodput', 0):.2f} |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def ratios(results: dict[str, dict[str, Any]], common_rate: float) -> dict[str, Any]:
    pd, single = (results.get(m) for m in MODES)
    if pd is None or single is None:
        return {}
    pd_at, single_at = at_rate(pd, common_rate) or {}, at_rate(single, common_rate) or {}

    def p99_ratio(key: str) -> float | None:
        ours, theirs = ((s.get(key) or {}).get("p99") for s in (pd_at, single_at))
        return ours / theirs if ours and theirs else None

    pd_max, single_max = pd["max_rate_within_slo"], single["max_rate_within_slo"]
    out: dict[str, Any] = {
        "p99_tpot_pd_over_single": p99_ratio("tpot_s"),
        "p99_itl_pd_over_single": p99_ratio("itl_s"),
        "p99_ttft_pd_over_single": p99_ratio("ttft_s"),
        "max_rate_pd_over_single": pd_max / single_max if pd_max and single_max else None,
    }
    adaptive = results.get("pd_adaptive")
    if adaptive is not None:
        ada_max = adaptive["max_rate_within_slo"]
        out["max_rate_adaptive_over_single"] = (
            ada_max / single_max if ada_max and single_max else None
        )
        goodput = [
            (a.get("goodput"), s.get("goodput"))
            for a, s in ((at_rate(adaptive, r), at_rate(single, r)) for r in _rates(single))
            if a and s
        ]
        out["goodput_adaptive_over_single_by_rate"] = [g / s if s else None for g, s in goodput]
    return out


def _rates(result: dict[str, Any]) -> list[float]:
    return [run["request_rate"] for run in result["runs"]]


def run_modes(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, Any]]:
    modes = args.modes.split(",")
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
    parser.add_argument("--request-rates", default="0.25,0.5,0.75,1,1.5")
    parser.add_argument("--common-rate", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=30, help="per rate")
    parser.add_argument("--mix", default="chat=0.6,summarise=0.2,generate=0.2")
    parser.add_argument("--slo-ttft", type=float, default=3.0)
    parser.add_argument("--slo-tpot", type=float, default=0.150)
    parser.add_argument("--slo-itl", type=float, help="seconds: a request's p99 inter-token gap")
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
    summary = table(results, args.common_rate)
    report = {
        "machine": f"{os.cpu_count()} cores{', 3 hosts in namespaces' if args.multihost else ''}",
        "date": time.strftime("%Y-%m-%d"),
        "minutes": (time.monotonic() - started) / 60,
        "settings": vars(args),
        "ratios": ratios(results, args.common_rate),
        "table": summary,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(summary + "\n")
    plot_goodput(results, out.with_suffix(".goodput.png"))
    plot_cdfs(results, out.with_suffix(".cdf.png"))
    print(summary)
    print(f"ratios: {report['ratios']}  ({report['minutes']:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
