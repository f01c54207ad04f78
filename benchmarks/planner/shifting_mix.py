"""The planner against the best fixed split, in the simulator, at sizes this machine cannot hold.

    python -m benchmarks.planner.shifting_mix      # -> benchmarks/results/planner_shifting_mix.json

1. **Workers modelled from pdserve's own step times**: the bundled model's engine on this CPU
   (``--threads``) computes a ``CALIBRATION_PROMPT``-token prompt (a prompt token's time) and
   decode steps at several batch sizes (a least-squares ``fixed + per row`` fit); the worker
   model (``testbed/planner_sim.py``) takes those.
2. **Tuning** (seeds ``--tuning-seeds``): at each pool size (``--workers``), every fixed split
   on a coarse grid, then around the best, replays the tuning traces; the split with the most good
   requests (TTFT and mean ITL within the planner's targets) is *the best fixed split chosen
   beforehand*.
3. **Held-out rounds** (seeds ``--seeds``, the serving benchmarks' held-out draws, which no
   setting of the planner was tuned on): each round draws a shifting-mix trace (prompt-heavy
   and output-heavy phases of about ``--phase-s``, each at ``--load`` of the pool's capacity) and
   replays it with the best fixed split and with the planner (starting from an even split);
   the ratio of their good requests is the round's figure. Goal: >= 1.3x at every size.
4. **Constant load**: a trace with one mix throughout; the planner's switches after
   ``SETTLE_S`` count (goal: 0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.stats import Goal, judge, spread
from benchmarks.serving.draws import HELD_OUT_SEEDS
from coordinator.planner.planner import Planner, PlannerConfig
from testbed.planner_sim import Arrival, WorkerModel, shifting_trace, simulate

CALIBRATION_PROMPT = 512
CALIBRATION_BATCHES = (1, 4, 16)
SETTLE_S = 120.0
GOAL = Goal(1.3)


def calibrate(threads: int, model_path: str = "bundled", vocab: int = 20000) -> WorkerModel:
    """The prompt-token and decode-step times on this CPU of the model at ``model_path`` (the
    bundled one by default; prompts of token ids below ``vocab``)."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.loader import load_model
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    config = EngineConfig(model_path=model_path, device="cpu", num_threads=threads)
    engine = LLMEngine(config, load_model(model_path))
    prompt = [(i * 7919) % (vocab - 100) + 100 for i in range(CALIBRATION_PROMPT)]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([prompt], one)  # warm
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        engine.generate([prompt[::-1]], one)
        timings.append((time.perf_counter() - start) / CALIBRATION_PROMPT)
        prompt = prompt[1:] + prompt[:1]
    token_s = statistics.median(timings)
    points = [(rows, _step_s(engine, rows)) for rows in CALIBRATION_BATCHES]
    fixed, per_row = _fit(points)
    return WorkerModel(token_s=token_s, step_fixed_s=fixed, step_row_s=per_row)


def _step_s(engine: Any, rows: int) -> float:
    """The median decode step of ``rows`` requests decoding together."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for i in range(rows):
        engine.add_request(engine.request(f"cal-{rows}-{i}", [100 + i, 200 + i, 300 + i], params))
    steps = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[5:])


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(slope, 1e-6)
    return max(mean_y - slope * mean_x, 1e-4), slope


def best_fixed(traces: list[list[Arrival]], model: WorkerModel, workers: int,
               config: PlannerConfig) -> tuple[int, float]:  # fmt: skip
    """The fixed number of prefill workers with the most good requests over ``traces``."""

    def score(prefills: int) -> float:
        return statistics.fmean(
            simulate(t, model, prefills, workers - prefills, slo=config).goodput for t in traces
        )

    stride = max(1, workers // 12)
    scores = {p: score(p) for p in range(1, workers, stride)}
    best = max(scores, key=lambda p: scores[p])
    for p in range(max(1, best - stride + 1), min(workers, best + stride)):
        if p not in scores:
            scores[p] = score(p)
    best = max(scores, key=lambda p: scores[p])
    return best, scores[best]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "planner_shifting_mix")
    parser.add_argument("--workers", default="16,64", help="pool sizes")
    parser.add_argument(
        "--seeds",
        default=",".join(map(str, HELD_OUT_SEEDS)),
        help="held-out rounds' traces (no setting was tuned on them)",
    )
    parser.add_argument("--tuning-seeds", default="1,2",
                        help="choose the best fixed split (the planner's settings were tuned "
                        "on these too)")  # fmt: skip
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--phase-s", type=float, default=120.0)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2, help="the calibrated engine's")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    model = calibrate(args.threads)
    config = PlannerConfig()
    result: dict[str, Any] = {
        "model": {
            "token_s": model.token_s,
            "step_fixed_s": model.step_fixed_s,
            "step_row_s": model.step_row_s,
            "switch_s": model.switch_s,
            "cold_s": model.cold_s,
            "cold_factor": model.cold_factor,
        },  # fmt: skip
        "targets": {"ttft_s": config.slo_ttft_s, "itl_s": config.slo_itl_s},
        "interval_s": config.interval_s,
        "duration_s": args.duration_s,
        "phase_s": args.phase_s,
        "load": args.load,
        "sizes": {},
    }

    def trace(seed: int, workers: int, phase_s: float) -> list[Arrival]:
        return shifting_trace(seed, model, workers, args.duration_s, phase_s, args.load,
                              config.slo_itl_s, config.slo_ttft_s)  # fmt: skip

    for workers in [int(n) for n in args.workers.split(",")]:
        tuning = [trace(int(s), workers, args.phase_s) for s in args.tuning_seeds.split(",")]
        fixed, tuned = best_fixed(tuning, model, workers, config)
        split = PlannerConfig(default_prefill=workers // 2, default_decode=workers - workers // 2)
        ratios, planned, fixed_good, switches, waits = [], [], [], [], []
        for seed in [int(s) for s in args.seeds.split(",")]:
            held_out = trace(seed, workers, args.phase_s)
            base = simulate(held_out, model, fixed, workers - fixed, slo=config).goodput
            run = simulate(held_out, model, split.default_prefill, split.default_decode,
                           Planner(split))  # fmt: skip
            planned.append(run.goodput)
            fixed_good.append(base)
            switches.append(run.switches)
            waits += run.reaction_intervals()
            ratios.append(run.goodput / max(base, 1e-9))
        steady = trace(int(args.seeds.split(",")[0]), workers, 10 * args.duration_s)
        calm = simulate(steady, model, split.default_prefill, split.default_decode,
                        Planner(split))  # fmt: skip
        late = [d for at, d in calm.moves if at > SETTLE_S]
        result["sizes"][str(workers)] = {
            "best_fixed_prefill": fixed,
            "best_fixed_tuning_goodput": round(tuned, 4),
            "planner_goodput": spread(planned, 4),
            "fixed_goodput": spread(fixed_good, 4),
            "switches": switches,
            "ratio": {
                **spread(ratios, 3),
                "goal": str(GOAL),
                "verdict": judge(ratios, GOAL).verdict,
            },  # fmt: skip
            "constant_load_moves_after_settling": len(late),
            "reaction_intervals": {
                "onsets": len(waits),
                "max": max(waits, default=0),
                "within_2": sum(w <= 2 for w in waits),
            },  # fmt: skip
        }
        print(workers, result["sizes"][str(workers)], flush=True)
    result_file.write(result)


if __name__ == "__main__":
    main()
