"""The served stream at engine speed: what a client streaming through each of pdserve's doors
gets, against the engine's own decode step on the cores and threads a worker has, and against
llama-server on the same GGUF and threads, side by side in one run.

    python -m benchmarks.serving.served_stream       # -> benchmarks/results/served_stream.json
    python -m benchmarks.serving.served_stream --scratch --rounds 1 --new-tokens 16 \\
        --concurrency 1,2 --doors openai,infer        # a trial run, outside them (~3 min)

The default run (both modes, four doors, N = 1, 8, 32, 128 tokens an answer, 5 kept rounds
after one dropped) takes about 25 minutes on two cores: a round about 4 (its N = 32 sides the
most, each waiting for its streams' first prefills), the start-ups about 1.

Started once for the whole run, each idle while another is measured: pdserve in every mode of
``--modes`` (``single_node``: one engine on both cores; ``pd_separate``: the fixed split, 1
prefill + 1 decode actor on a core each, ``benchmarks.harness.launch.FIXED``), an engine probe
per mode pinned to the cores of the mode's decoding actor with as many threads
(``benchmarks.engine.step_probe``), and llama-server (``--llama-threads`` threads, a slot per
stream at the highest concurrency; ``--no-llama-server`` leaves it out).

Each round measures every side once, the order rotating from round to round
(``benchmarks.harness.rounds.order_of``; ``--warmup`` rounds dropped first):
  engine/MODE/N        the probe's ms per decode step of N sequences (N = 1 and the highest
                       concurrency) at the served answers' mean context; tokens/s = N / step
  engine_loop/MODE/N   the probe's tokens/s of N closed-loop streams of the served workload in
                       the engine itself (prompts computed too: ``benchmarks.engine.closed_loop``),
                       at the highest concurrency, in the modes whose decoding actor prefills
  served/MODE/DOOR/N   N closed-loop streams through DOOR (``openai`` ``/v1/completions``,
                       ``infer`` MindIE's ``/infer``, ``tgi`` ``/generate_stream``, ``azure``
                       Azure AI's ``/chat/completions``); the OpenAI door at every N of
                       ``--concurrency``, the others at its lowest and highest
  llama_server/N       N streams through llama-server's ``/v1/completions``
A stream sends ~100-token prompts of random words (none from a prefix cache) for
``--new-tokens`` greedy tokens (``ignore_eos``; TGI's API has none, so its answers may end
early: ``tokens_per_request`` says), its first answer shortened so that the streams are spread
over an answer's length rather than in step. Once the streams' first prompts are prefilled
(every stream has had a token: ``warm_s``) and ``--lead-s`` more, the streamed
tokens, and the CPU of every process under the server (``benchmarks.harness.processes``:
coordinator, each worker actor, Ray's daemons), are counted for ``--window-s``, and on (at
most ``MAX_WINDOW_S``) until ``LATENCY_REQUESTS`` requests sent after the first prefills have
had a first token, as one stream's answer may outlast the window; then the requests in flight
are abandoned. Figures: output tokens/s in the window; TTFT p50 of the
requests sent after the first prefills; TPOT p50 of the requests' mean gaps between tokens
within the window (every request's, those abandoned too); CPU ms per streamed token by process
role.

Goals (``served_stream_report.GOALS``), judged on per-round ratios by
``benchmarks.harness.stats.judge``: served TPOT p50 at N = 1 over the engine's step at one
sequence; the coordinator's CPU per token at the highest N; served tokens/s at the highest N
over the engine's rate there; the OpenAI door against llama-server at each N (tokens/s) and at
N = 1 (TTFT). With no goal of its own, served tokens/s over ``engine_loop``'s: how much of the
rate's shortfall is the prompts' compute, which no server can save, and how much the serving.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.engine.closed_loop import first_answer_tokens
from benchmarks.engine.step_probe import StepProbe
from benchmarks.harness.client import Target, carries_token
from benchmarks.harness.launch import (
    HTTP_SETTINGS,
    SETTINGS,
    free_port,
    start_pdserve,
    stop_pdserve,
)
from benchmarks.harness.load import ABANDONED, ClosedLoop
from benchmarks.harness.processes import actor_pid, cpu_per_token, tree_cpu
from benchmarks.harness.record import RequestRecord, percentile
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, order_of
from benchmarks.serving.served_stream_report import goal_rows, render, summarize_sides
from benchmarks.serving.workload import WORDS, WorkItem, decode_prefix

DOORS = {"openai": "completions", "infer": "infer", "tgi": "tgi", "azure": "azure"}
LLAMA_SERVER = "llama_server"
PROMPT_TOKENS = 100
COLOCATED = "ray::ColocatedWorker"
DECODING_ACTOR = {
    "single_node": COLOCATED,
    "single_node_spin10k": COLOCATED,
    "single_node_uvloop": COLOCATED,
    "pd_separate": "ray::DecodeWorker",
    "pd_adaptive": "ray::DecodeWorker",
}
WARM_TIMEOUT_S = 180.0  # for every stream's first token
LATENCY_REQUESTS = 2  # sent after the first prefills, with a first token, in a window
MAX_WINDOW_S = 60.0
SETTLE_S = 0.5  # after abandoning a measurement's requests, for the server to drop them
LLAMA_CONTEXT_PER_SLOT = 512  # a prompt and its answer, with room


def door_concurrency(door: str, concurrency: list[int]) -> list[int]:
    """The OpenAI door at every N; the other doors at the lowest and highest."""
    if door == "openai":
        return concurrency
    return sorted({min(concurrency), max(concurrency)})


def side_names(
    modes: list[str], doors: list[str], concurrency: list[int], llama: bool
) -> list[str]:
    """Every side of a round: ``engine/MODE/N``, ``engine_loop/MODE/N`` (modes whose decoding
    actor prefills too), ``served/MODE/DOOR/N``, ``llama_server/N``."""
    names = []
    for mode in modes:
        names += [f"engine/{mode}/{n}" for n in sorted({1, max(concurrency)})]
        if DECODING_ACTOR[mode] == COLOCATED:
            names.append(f"engine_loop/{mode}/{max(concurrency)}")
        names += [
            f"served/{mode}/{door}/{n}"
            for door in doors
            for n in door_concurrency(door, concurrency)
        ]
    return names + ([f"{LLAMA_SERVER}/{n}" for n in concurrency] if llama else [])


@dataclass
class TokenClock:
    """The arrival times of the streamed tokens of one target's events (``on_event``), and the
    streams that have had a token."""

    api: str
    started: float = field(default_factory=time.perf_counter)
    arrivals: list[float] = field(default_factory=list)
    streams: set[int] = field(default_factory=set)

    def on_event(self, stream: int, event: dict) -> None:
        if carries_token(event, self.api):
            self.arrivals.append(time.perf_counter() - self.started)
            self.streams.add(stream)

    def now(self) -> float:
        return time.perf_counter() - self.started

    def within(self, start: float, end: float) -> int:
        return sum(start <= at < end for at in self.arrivals)

    def wait_for(self, streams: int, timeout_s: float) -> float:
        """Until ``streams`` streams have had a token (their first prompts prefilled; at most
        ``timeout_s``); the seconds since the start."""
        deadline = time.perf_counter() + timeout_s
        while len(self.streams) < streams and time.perf_counter() < deadline:
            time.sleep(0.05)
        return self.now()


def own_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1e3


class PromptSource:
    """Prompts of random words, about ``PROMPT_TOKENS`` tokens each, new at every call."""

    def __init__(self, words: int, seed: str) -> None:
        self.words, self.rng = words, random.Random(seed)

    def item(self, output_tokens: int) -> WorkItem:
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.words))
        return WorkItem(text, output_tokens, "served_stream", PROMPT_TOKENS)


def prompt_words(model: str) -> int:
    """How many random words make about ``PROMPT_TOKENS`` tokens of ``model``'s tokenizer."""
    from benchmarks.serving.rate_sweep import make_encoder

    encode = make_encoder(model)
    text = " ".join(random.Random(0).choice(WORDS) for _ in range(PROMPT_TOKENS * 2))
    return len(decode_prefix(text, encode, PROMPT_TOKENS).split(" "))


@dataclass(frozen=True)
class LoadSettings:
    new_tokens: int
    words: int
    lead_s: float
    window_s: float


SERIAL = itertools.count()


def measure_streams(
    target: Target, streams: int, settings: LoadSettings, root: int, root_role: str
) -> dict[str, float]:
    """``streams`` closed-loop streams against ``target``: their tokens/s, latencies and the
    CPU per token of the processes under ``root`` within the window. The window lasts
    ``window_s``, and longer (up to ``MAX_WINDOW_S``) until ``LATENCY_REQUESTS`` requests sent
    after the first prefills have had their first token: at one stream, an answer may outlast
    the window."""
    source = PromptSource(settings.words, f"served-{next(SERIAL)}")
    clock = TokenClock(target.api)

    def make_item(stream: int, turn: int) -> WorkItem:
        first = first_answer_tokens(stream, streams, settings.new_tokens)
        return source.item(settings.new_tokens if turn else first)

    loop = ClosedLoop(target, streams, make_item, on_event=clock.on_event, started=clock.started)
    warm_s = clock.wait_for(streams, WARM_TIMEOUT_S)  # every stream past its first prefill
    time.sleep(settings.lead_s)
    start, before, client = clock.now(), tree_cpu(root, root_role), own_cpu_ms()
    time.sleep(settings.window_s)
    while loop.first_tokens_since(warm_s) < LATENCY_REQUESTS and clock.now() - start < MAX_WINDOW_S:
        time.sleep(0.05)
    end, after, client = clock.now(), tree_cpu(root, root_role), own_cpu_ms() - client
    records = loop.stop(cancel=True)
    time.sleep(SETTLE_S)
    errors = {r.error for r in records if r.error is not None and r.error != ABANDONED}
    for error in sorted(errors):
        print(f"  failed ({target.url}, {target.api}): {error}", flush=True)
    tokens = clock.within(start, end)
    window = (start, end)
    figures = stream_figures(records, settings.new_tokens, tokens / (end - start), warm_s, window)
    costs = cpu_per_token(before, after, tokens) | {"client": client / max(tokens, 1)}
    figures |= {"warm_s": warm_s, "window_s": end - start}
    return figures | {f"cpu_ms_per_token:{role}": ms for role, ms in costs.items()}


def gaps_within(record: RequestRecord, start: float, end: float) -> list[float]:
    """The gaps between ``record``'s tokens that ended within ``[start, end)`` (on the clock
    of its ``sent_at``)."""
    if record.ttft_s is None:
        return []
    at, inside = record.sent_at + record.ttft_s, []
    for gap in record.gaps_s:
        at += gap
        if start <= at < end:
            inside.append(gap)
    return inside


def stream_figures(
    records: list[RequestRecord],
    new_tokens: int,
    tokens_per_s: float,
    since: float = 0.0,
    window: tuple[float, float] = (0.0, float("inf")),
) -> dict[str, float]:
    """The window's rate; TTFT p50 of the requests sent from ``since`` on (the first prefills
    are over), and of those sent before (``burst_ttft_p50_ms``: the streams' first requests,
    sent at once, as a burst of new users would); TPOT p50 of the requests' mean gaps between
    tokens within ``window`` (any request's, those still in flight at the stop too); tokens an
    answer of the full-length answers that ended (fewer: ended at the end of sequence)."""
    steady = [r for r in records if r.sent_at >= since and r.ttft_s is not None]
    ttft = [r.ttft_s * 1e3 for r in steady if r.ttft_s is not None]
    burst = [r.ttft_s * 1e3 for r in records if r.sent_at < since and r.ttft_s is not None]
    gaps = [gaps_within(r, *window) for r in records]
    tpot = [sum(inside) / len(inside) * 1e3 for inside in gaps if inside]
    ended = [r for r in records if r.ok and r.target_output_tokens == new_tokens]
    return {
        "tokens_per_s": tokens_per_s,
        "ttft_p50_ms": percentile(ttft, 50) or 0.0,
        "burst_ttft_p50_ms": percentile(burst, 50) or 0.0,
        "tpot_p50_ms": percentile(tpot, 50) or 0.0,
        "tokens_per_request": sum(r.output_tokens for r in ended) / max(len(ended), 1),
        "latency_requests": float(len(steady)),
        "tpot_requests": float(len(tpot)),
        "failed": float(sum(not r.ok and r.error != ABANDONED for r in records)),
    }


class Deployments:
    """pdserve in every mode, an engine probe per mode and llama-server, started once."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.pdserve: dict[str, tuple[Any, dict]] = {}
        self.probes: dict[str, StepProbe] = {}
        self.llama: Any = None
        self.given: dict[str, Any] = {}

    def start(self) -> None:
        args = self.args
        prompt = PROMPT_TOKENS + args.new_tokens // 2  # the answers' mean context
        for mode in args.modes:
            deploy_mode, keys = SETTINGS[mode]
            http = HTTP_SETTINGS.get(mode, {})
            workdir = self.workdir / mode
            process, ports = start_pdserve(deploy_mode, args.model, workdir, keys, http)
            self.pdserve[mode] = (process, ports)
            cores = self._actor_cores(mode, process.pid)
            log = self.workdir / f"probe-{mode}.log"
            spin = keys.get("omp_spin_count", -1)
            loop = (PROMPT_TOKENS, args.new_tokens)
            self.probes[mode] = StepProbe(
                args.model, cores, prompt, args.probe_tokens, log, spin, loop
            )
            given = {"deploy_mode": deploy_mode, "backend_config": keys, "http_config": http}
            probe = {"cores": sorted(cores), "threads": len(cores), "prompt_tokens": prompt}
            self.given[mode] = given | {"engine_probe": probe | {"new_tokens": args.probe_tokens}}
            print(f"{mode}: pdserve pid {process.pid}, its decoding actor on {sorted(cores)}")
        if args.llama_server:
            self._start_llama(max(args.concurrency))

    def _actor_cores(self, mode: str, root: int) -> set[int]:
        pid = actor_pid(root, DECODING_ACTOR[mode])
        if pid is None:
            raise RuntimeError(f"{mode}: no {DECODING_ACTOR[mode]} process under pid {root}")
        return os.sched_getaffinity(pid)

    def _start_llama(self, slots: int) -> None:
        from benchmarks.llamacpp.server import LlamaServer, ServerSetting, gguf_of, server_folder

        setting = ServerSetting(slots=slots, threads=self.args.llama_threads)
        folder, gguf = server_folder(self.args.llama_cpp_dir), gguf_of(self.args.model)
        log = self.workdir / "llama-server.log"
        self.llama = LlamaServer(folder, gguf, free_port(), log, setting, LLAMA_CONTEXT_PER_SLOT)
        self.given[LLAMA_SERVER] = {**setting.to_dict(), "command": self.llama.command[1:]}

    def stop(self) -> None:
        for probe in self.probes.values():
            probe.stop()
        if self.llama is not None:
            self.llama.stop()
        for process, _ in self.pdserve.values():
            stop_pdserve(process)

    def side(self, name: str, settings: LoadSettings) -> Callable[[], dict[str, float]]:
        """What measuring side ``name`` does (``side_names``)."""
        kind, *rest = name.split("/")
        if kind == "engine":
            probe, sequences = self.probes[rest[0]], int(rest[1])
            return lambda: engine_figures(probe.step_ms(sequences), sequences)
        if kind == "engine_loop":
            probe, count = self.probes[rest[0]], int(rest[1])
            return lambda: {"tokens_per_s": probe.loop_rate(count)}
        if kind == LLAMA_SERVER:
            # a connection a time: llama-server closes kept-alive ones as a request reuses them
            # (httpx: "Server disconnected without sending a response")
            target = Target(self.llama.url, api="completions", headers=(("Connection", "close"),))
            pid = self.llama.pid
            return lambda: measure_streams(target, int(rest[0]), settings, pid, LLAMA_SERVER)
        mode, door, streams = rest
        process, ports = self.pdserve[mode]
        target = Target(f"http://127.0.0.1:{ports['predict_port']}", api=DOORS[door])
        return lambda: measure_streams(target, int(streams), settings, process.pid, "coordinator")


def engine_figures(step_ms: float, sequences: int) -> dict[str, float]:
    return {"step_ms": step_ms, "tokens_per_s": sequences * 1e3 / step_ms}


@contextlib.contextmanager
def deployed(args: argparse.Namespace, workdir: Path) -> Iterator[Deployments]:
    deployments = Deployments(args, workdir)
    try:
        deployments.start()
        yield deployments
    finally:
        deployments.stop()


def interleaved_rounds(
    sides: dict[str, Callable[[], dict[str, float]]],
    rounds: int,
    warmup: int,
    on_round: Callable[[int, dict[str, list[dict[str, float]]]], None],
) -> dict[str, list[dict[str, float]]]:
    """Every side once a round, in ``order_of``'s order; the first ``warmup`` rounds dropped.
    ``on_round(kept_rounds, kept)`` after every kept round."""
    names = list(sides)
    kept: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        values = {}
        for name in order_of(names, index):
            began = time.monotonic()
            values[name] = sides[name]()
            took = f"({time.monotonic() - began:.0f} s)"
            print(f"round {index - warmup} {name} {took}: {brief(values[name])}", flush=True)
        if index >= warmup:
            for name in names:
                kept[name].append(values[name])
            on_round(index - warmup + 1, kept)
    return kept


BRIEF_CPU = ("coordinator", LLAMA_SERVER, "workers", "ray_daemons", "client")


def brief(figures: dict[str, float]) -> str:
    """A side's main figures on one progress line."""
    shown = ("step_ms", "tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "failed")
    text = " ".join(f"{key}={figures[key]:.2f}" for key in shown if key in figures)
    cpu = {role: figures.get(f"cpu_ms_per_token:{role}") for role in BRIEF_CPU}
    cells = [f"{role}={ms:.3f}" for role, ms in cpu.items() if ms is not None]
    return text + (f" cpu_ms/token {' '.join(cells)}" if cells else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--modes", default="single_node,pd_separate", type=_names(SETTINGS))
    parser.add_argument("--doors", default=",".join(DOORS), type=_names(DOORS))
    parser.add_argument("--concurrency", default="1,8,32", type=_counts)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="dropped rounds")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens an answer")
    parser.add_argument("--probe-tokens", type=int, default=32, help="decode steps a probe")
    parser.add_argument("--lead-s", type=float, default=1.0, help="load before the window")
    parser.add_argument("--window-s", type=float, default=4.0, help="the counted window")
    parser.add_argument("--no-llama-server", dest="llama_server", action="store_false")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--llama-cpp-dir", type=Path, help="a folder holding llama-server")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs here")
    add_output_arguments(parser, "served_stream")
    return parser


def _names(known: Any) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{unknown or text!r}: of {', '.join(known)}")
        return names

    return parse


def _counts(text: str) -> list[int]:
    counts = sorted({int(part) for part in text.split(",") if part})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    settings = LoadSettings(args.new_tokens, prompt_words(args.model), args.lead_s, args.window_s)
    names = side_names(args.modes, args.doors, args.concurrency, args.llama_server)
    head = _head(args, settings)
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-served-stream-") as tmp,
        deployed(args, args.logs or Path(tmp)) as deployments,
    ):
        head["given"] = deployments.given

        def on_round(done: int, kept: dict[str, list[dict[str, float]]]) -> None:
            partial = _result(head, kept, args, started) | {"rounds_done": done}
            result_file.write(partial, complete=False)

        sides = {name: deployments.side(name, settings) for name in names}
        kept = interleaved_rounds(sides, args.rounds, args.warmup, on_round)
    result = _result(head, kept, args, started)
    path = result_file.write(result)
    print(render(json.loads(path.read_text())))
    print(f"results: {path} ({result['minutes']:.1f} min)")
    return 0


def _head(args: argparse.Namespace, settings: LoadSettings) -> dict[str, Any]:
    shown = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta = {"model": args.model, "rounds": args.rounds, "dropped_rounds": args.warmup}
    return {
        "_meta": meta,
        "settings": shown | {"prompt_tokens": PROMPT_TOKENS, "prompt_words": settings.words},
    }


def _result(
    head: dict[str, Any], kept: dict[str, list[dict[str, float]]], args: argparse.Namespace,
    started: float,
) -> dict[str, Any]:  # fmt: skip
    sides = summarize_sides(kept)
    failed = {name: int(sum(r.get("failed", 0) for r in rounds)) for name, rounds in kept.items()}
    result = head | {
        "minutes": round((time.monotonic() - started) / 60, 1),
        "sides": sides,
        "goals": goal_rows(kept, args.modes, args.doors, args.concurrency),
    }
    failing = {name: count for name, count in failed.items() if count}
    return result | ({"failed_requests": failing} if failing else {})


if __name__ == "__main__":
    sys.exit(main())
