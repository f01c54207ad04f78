"""The planner on live elastic workers against the best fixed split (local Ray, a small model).

    python -m benchmarks.planner.live_shifting_mix   # -> results/planner_live_shifting_mix.json

1. **The pool**: ``--workers`` elastic workers (``elastic_roles``), one thread each, of a random
   Llama of ``--hidden`` x ``--layers`` (``testbed/tiny_model.py``), served by the coordinator's
   own parts in this process (router, inference service with migration, role switcher, planner
   loop). The trace's rates are those of ``--cores`` workers from the model's step times,
   calibrated in-process at one thread (the workers and the coordinator share this machine's
   cores: one worker's worth, not two, keeps the pool out of overload).
2. **Tuning** (``--tuning-seeds``): every fixed split replays the tuning traces; the one with the
   most good requests (TTFT and mean ITL within the planner's targets) is *the best fixed split
   chosen beforehand*.
3. **Held-out rounds** (``--seeds``): each round replays one shifting-mix trace
   (``testbed/planner_sim.shifting_trace``: prompt-heavy and output-heavy phases of about
   ``--phase-s``) with the best fixed split and with the planner (``execute``, starting from the
   configured split), in alternating order; the ratio of their good requests is the round's
   figure. Goal: >= 1.3x. Every failed request (an error, not a timeout) is counted: goal 0
   across all the planner's switches (>= 20 of them).
4. **Reaction**: for each onset of a violated target (a planner interval finding a role short
   after one that found none), the intervals until its move; goal <= 2.
5. **Constant load**: one mix throughout; the planner's switches after the first third count
   (goal 0). **Zero traffic**: after the last round, the roles the idle pool returns to within
   ``--idle-s`` (the configured split).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time
from typing import Any

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.stats import Goal, judge, percentile, spread
from benchmarks.planner.shifting_mix import calibrate
from benchmarks.serving.draws import HELD_OUT_SEEDS
from testbed.planner_sim import Arrival, shifting_trace

GOAL = Goal(1.3)
MAX_TOKEN_ID = 200  # prompts of random ids below this (the tiny tokenizer's vocabulary)


@dataclasses.dataclass
class Round:
    requests: int = 0
    good: int = 0
    failed: int = 0  # errors (a request that could not complete), not timeouts
    timed_out: int = 0
    switches: int = 0
    waits: list[int] = dataclasses.field(default_factory=list)  # reaction, in intervals
    switch_times: list[float] = dataclasses.field(default_factory=list)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)  # failures by their kind
    ttfts: list[float] = dataclasses.field(default_factory=list)
    itls: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Its counts and the p50 / p90 of its TTFTs and ITLs (ms)."""
        figures = {}
        for name, values in (("ttft", self.ttfts), ("itl", self.itls)):
            for q in (50, 90):
                figures[f"{name}_p{q}_ms"] = (
                    round(percentile(values, q) * 1000, 1) if values else None
                )
        counts = ("requests", "good", "failed", "timed_out", "switches", "waits", "errors")
        return {name: getattr(self, name) for name in counts} | figures


class LivePool:
    """An elastic pool and the coordinator parts that serve it, in this process."""

    def __init__(self, args: argparse.Namespace, model_path: str) -> None:
        from coordinator.cluster import Cluster
        from coordinator.config.cluster import ActorResources, ClusterConfig
        from engine.config import CacheConfig, EngineConfig, KVTransferConfig

        self.args = args
        one = ActorResources(num_cpus=1)
        engine = EngineConfig(model_path=model_path, device="cpu", num_threads=1,
                              cache=CacheConfig(block_size=16, num_blocks=2048))  # fmt: skip
        self.split = (args.workers // 2, args.workers - args.workers // 2)
        config = ClusterConfig(
            engine=engine, elastic_roles=True, num_prefill=self.split[0],
            num_decode=self.split[1], prefill_resources=one, decode_resources=one,
            kv=KVTransferConfig(transfer_timeout_s=10.0, reservation_timeout_s=10.0),
        )  # fmt: skip
        self.cluster = Cluster(config)
        self.replays = 0

    async def open(self) -> None:
        from coordinator.inference import InferenceService, Timeouts
        from coordinator.metrics import Metrics
        from coordinator.pool.role_switch import RoleSwitcher
        from coordinator.router import Router

        self.router = Router(self.cluster.fleet, poll_interval_s=0.25)
        await self.router.view.refresh()
        self.router.view.start()
        self.metrics = Metrics("live")
        limit = self.args.give_up_s
        timeouts = Timeouts(schedule=0, first_token=limit, infer=0, request=0)
        self.service = InferenceService(self.cluster, self.router, 4096, 3, timeouts, self.metrics)
        self.switcher = RoleSwitcher(self.router.view, self.metrics)

    async def close(self) -> None:
        await self.router.view.stop()

    def roles(self) -> tuple[int, int]:
        roles = [state.serving for state in self.cluster.fleet.roles.values()]
        return roles.count("prefill"), roles.count("decode")

    async def set_split(self, prefills: int) -> None:
        """Workers 0..prefills-1 to prefill, the rest to decode (only those that differ)."""
        for instance, state in sorted(self.cluster.fleet.roles.items()):
            target = "prefill" if instance < prefills else "decode"
            if state.serving != target:
                refusal, _ = await self.switcher.switch(instance, target, 60.0)
                if refusal:
                    raise RuntimeError(f"worker {instance} refused {target}: {refusal}")

    async def replay(self, trace: list[Arrival], planning: bool, seed: int) -> Round:
        """Replay ``trace`` (arrivals from now), with the planner in ``execute`` mode or none."""
        from coordinator.planner import PlannerSettings
        from coordinator.planner.loop import PlannerLoop
        from coordinator.planner.traffic import TrafficWindow

        result, loop, task = Round(), None, None
        if planning:
            settings = PlannerSettings(mode="execute", slo_ttft_ms=self.args.ttft_ms,
                                       slo_itl_ms=self.args.itl_ms,
                                       interval_ms=self.args.interval_ms)  # fmt: skip
            traffic = TrafficWindow()
            self.service.traffic = traffic
            loop = PlannerLoop(settings, self.router.view, self.cluster.fleet, traffic,
                               self.split, None, self.switcher)  # fmt: skip
            _watch(loop, result)
            task = asyncio.ensure_future(loop.run())
        # prompts of the trace's lengths, drawn afresh for each replay: one replay's prompts
        # are never in the prefix caches another left
        self.replays += 1
        rng, start = random.Random(f"{seed}-{self.replays}"), time.monotonic()
        requests = []
        for i, arrival in enumerate(trace):
            await asyncio.sleep(max(start + arrival.at - time.monotonic(), 0.0))
            prompt = [rng.randrange(3, MAX_TOKEN_ID) for _ in range(arrival.prompt)]
            one = self._one(f"{seed}-{i}", prompt, arrival, result)
            requests.append(asyncio.ensure_future(one))
        await asyncio.gather(*requests)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*loop._moves, return_exceptions=True)  # noqa: SLF001
            self.service.traffic = None
        return result

    async def _one(self, request_id: str, prompt: list[int], arrival: Arrival,
                   result: Round) -> None:  # fmt: skip
        from coordinator.errors import RequestTimeout
        from engine.sampling_params import SamplingParams
        from workers.contracts import GenerationRequest

        params = SamplingParams(max_new_tokens=arrival.output, ignore_eos=True)
        request = GenerationRequest(request_id, prompt, params)
        sent, first, tokens = time.monotonic(), None, 0
        result.requests += 1
        try:
            async for event in self.service.generate(request):
                if event.token_id is not None:
                    first = first or time.monotonic()
                    tokens += 1
        except RequestTimeout:
            result.timed_out += 1
            return
        except Exception as exc:
            result.failed += 1
            kind = f"{type(exc).__name__}: {str(exc)[:80]}"
            result.errors[kind] = result.errors.get(kind, 0) + 1
            return
        end = time.monotonic()
        ttft = (first or end) - sent
        itl = (end - first) / (tokens - 1) if first is not None and tokens > 1 else 0.0
        args = self.args
        result.ttfts.append(ttft)
        result.itls.append(itl)
        result.good += ttft <= args.ttft_ms / 1000 and itl <= args.itl_ms / 1000


def _watch(loop: Any, result: Round) -> None:
    """Count ``loop``'s switches and, per onset of a violated target, the intervals to its
    move."""
    decide, state = loop.planner.decide, {"waiting": None, "short": False}

    def watched(workers: Any, sample: Any, now: float) -> Any:
        decision = decide(workers, sample, now)
        short = bool(loop.planner.short)
        if short and not state["short"] and state["waiting"] is None:
            state["waiting"] = 0
        if state["waiting"] is not None:
            state["waiting"] += 1
            if decision.kind == "switch":
                result.waits.append(state["waiting"])
                state["waiting"] = None
            elif not short:
                state["waiting"] = None
        if decision.kind == "switch":
            result.switches += len(decision.workers)
            result.switch_times.append(time.monotonic())
        state["short"] = short
        return decision

    loop.planner.decide = watched


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "planner_live_shifting_mix")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--cores", type=int, default=1, help="what the trace's rates assume")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seeds", default=",".join(map(str, HELD_OUT_SEEDS)))
    parser.add_argument("--tuning-seeds", default="1")
    parser.add_argument("--duration-s", type=float, default=48.0)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--ttft-ms", type=int, default=1000)
    parser.add_argument("--itl-ms", type=int, default=80)
    parser.add_argument("--interval-ms", type=int, default=1000)
    parser.add_argument("--give-up-s", type=float, default=10.0, help="a request's TTFT limit")
    parser.add_argument("--idle-s", type=float, default=75.0)
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    print(asyncio.run(_main(args, result_file)), flush=True)


async def _main(args: argparse.Namespace, result_file: ResultFile) -> dict[str, Any]:
    from coordinator.ray_connect import init_ray
    from testbed.tiny_model import build_tiny_model

    path = build_tiny_model(tempfile.mkdtemp(prefix="live-planner-"), num_layers=args.layers,
                            hidden_size=args.hidden, num_heads=8, num_kv_heads=4,
                            initializer_range=0.3, max_positions=2048)  # fmt: skip
    model = calibrate(1, str(path), MAX_TOKEN_ID)
    ttft_s, itl_s = args.ttft_ms / 1000, args.itl_ms / 1000

    def trace(seed: int, phase_s: float) -> list[Arrival]:
        return shifting_trace(seed, model, args.cores, args.duration_s, phase_s, args.load,
                              itl_s, ttft_s)  # fmt: skip

    init_ray(num_cpus=args.workers)
    pool = LivePool(args, str(path))
    pool.cluster.fleet.start()
    await pool.open()
    result: dict[str, Any] = {
        "model": {"hidden": args.hidden, "layers": args.layers, "token_s": model.token_s,
                  "step_fixed_s": model.step_fixed_s, "step_row_s": model.step_row_s},
        "workers": args.workers, "cores": args.cores, "split": list(pool.split),
        "targets": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms},
        "interval_ms": args.interval_ms, "duration_s": args.duration_s, "phase_s": args.phase_s,
        "load": args.load,
    }  # fmt: skip
    try:
        await pool.replay(trace(99, args.phase_s)[:40], False, 99)  # warm every worker
        tuning: dict[int, float] = {}
        for prefills in range(1, args.workers):
            await pool.set_split(prefills)
            rounds = [await pool.replay(trace(int(s), args.phase_s), False, int(s))
                      for s in args.tuning_seeds.split(",")]  # fmt: skip
            tuning[prefills] = statistics.fmean(r.good / max(r.requests, 1) for r in rounds)
            print("tuning", prefills, [r.summary() for r in rounds], flush=True)
        best = max(tuning, key=lambda p: tuning[p])
        result["tuning_goodput"] = {str(p): round(g, 4) for p, g in tuning.items()}
        result["best_fixed_prefill"] = best
        ratios, planned, fixed, switches, failed, waits = [], [], [], 0, 0, []
        for index, seed in enumerate(int(s) for s in args.seeds.split(",")):
            order = (False, True) if index % 2 == 0 else (True, False)
            runs = {}
            for planning in order:
                await pool.set_split(pool.split[0] if planning else best)
                runs[planning] = await pool.replay(trace(seed, args.phase_s), planning, seed)
            plan, base = runs[True], runs[False]
            planned.append(plan.good / max(plan.requests, 1))
            fixed.append(base.good / max(base.requests, 1))
            ratios.append(plan.good / max(base.good, 1))
            switches += plan.switches
            failed += plan.failed + base.failed
            waits += plan.waits
            print("round", seed, plan.summary(), base.summary(), flush=True)
        result["held_out"] = {
            "planner_goodput": spread(planned, 4),
            "fixed_goodput": spread(fixed, 4),
            "ratio": {**spread(ratios, 3), "goal": str(GOAL),
                      "verdict": judge(ratios, GOAL).verdict},
            "switches": switches,
            "failed_requests": failed,
            "reaction_intervals": {"onsets": len(waits), "max": max(waits, default=0),
                                   "within_2": sum(w <= 2 for w in waits)},
        }  # fmt: skip
        seed = int(args.seeds.split(",")[0])
        await pool.set_split(pool.split[0])
        calm = await pool.replay(trace(seed, 100 * args.duration_s), True, seed)
        settled = [t for t in calm.switch_times if t > time.monotonic() - 2 * args.duration_s / 3]
        result["constant_load"] = {"switches": calm.switches, "after_first_third": len(settled),
                                   "failed_requests": calm.failed}  # fmt: skip
        result["zero_traffic"] = await _idle(pool, args)
    finally:
        await pool.close()
        pool.cluster.fleet.shutdown()
    result_file.write(result)
    return result


async def _idle(pool: LivePool, args: argparse.Namespace) -> dict[str, Any]:
    """Leave the pool off its configured split, idle, with the planner on: where it goes."""
    from coordinator.planner import PlannerSettings
    from coordinator.planner.loop import PlannerLoop
    from coordinator.planner.traffic import TrafficWindow

    await pool.set_split(args.workers - 1)
    settings = PlannerSettings(mode="execute", slo_ttft_ms=args.ttft_ms, slo_itl_ms=args.itl_ms,
                               interval_ms=args.interval_ms)  # fmt: skip
    loop = PlannerLoop(settings, pool.router.view, pool.cluster.fleet, TrafficWindow(),
                       pool.split, None, pool.switcher)  # fmt: skip
    task = asyncio.ensure_future(loop.run())
    start, back_at = time.monotonic(), None
    while time.monotonic() - start < args.idle_s:
        await asyncio.sleep(1.0)
        if pool.roles() == pool.split and back_at is None:
            back_at = time.monotonic() - start
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return {"from": [args.workers - 1, 1], "to": list(pool.roles()),
            "configured": list(pool.split), "seconds": back_at}  # fmt: skip


if __name__ == "__main__":
    main()
