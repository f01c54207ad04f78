"""Speculative decoding served, against llama-server's own n-gram speculation on the same file,
side by side in one run.

    python -m benchmarks.serving.served_speculation  # -> benchmarks/results/served_speculation.json
    python -m benchmarks.serving.served_speculation --scratch --streams 1 --tokens 32 \\
        --rounds 1 --llama-spec ngram-simple:size-n=3,size-m=8     # a trial run (~3 min)

Four servers, started once, each idle while another is measured: pdserve (``--mode``) with its
defaults (``pdserve_off``) and with ``speculative_method: ngram`` (``pdserve_ngram``, its other
speculative settings at their defaults), and llama-server on the same GGUF file with
``--threads`` threads and a slot per stream at the most streams, without speculation
(``llama_off``) and with its best n-gram speculation (``llama_ngram``).

llama-server's best: unless ``--llama-spec`` names one, each of ``LLAMA_CANDIDATES`` (its n-gram
``--spec-type`` kinds at their defaults and with short n-grams) is started in turn and runs the
grounded single-stream case on the prompts of ``--tuning-seed`` (a dropped pass, then
``TUNING_PASSES`` kept); the fastest by median goes on, to run on the prompts of ``--seed``
(held out). Every candidate's figure is in the result.

The workloads are those of ``benchmarks.engine.speculation`` (``grounded``: answers that quote
their input; ``free``: nothing to quote), the model's chat template applied here so that both
servers get the same text on ``/v1/completions``. A case (a workload, a number of streams) sends
``max(streams, PROMPTS_AT_LEAST)`` prompts, ``streams`` at a time, each for ``--tokens`` greedy
tokens (``ignore_eos``, streamed). A round measures every side once, the order rotating
(``benchmarks.harness.rounds``); a side's figure is output tokens per wall second of the case. A
request that fails or brings other than ``--tokens`` tokens stops the run: a peer that fails
requests is a broken setup. Acceptance (accepted / drafted tokens) is pdserve's from its
``/metrics`` over the case, llama-server's from its answers' ``timings`` (``draft_n``,
``draft_n_accepted``). ``same_text``: the share of a speculating side's answers whose text is
that of the same server kind without speculation (pdserve's speculating server is batch
invariant and its other one is not, so a near tie between two tokens may go either way there;
token identity against the invariant engine is what the engine benchmark and the tests check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.engine.speculation import PROMPTS_AT_LEAST, prompts_of
from benchmarks.harness.client import Target, send
from benchmarks.harness.launch import SETTINGS, free_port, start_pdserve, stop_pdserve
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds, ratio_rounds
from benchmarks.harness.stats import Goal, judge, spread
from benchmarks.llamacpp.server import LlamaServer, ServerSetting, gguf_of, server_folder
from benchmarks.serving.workload import WorkItem
from engine.model.model_files import load_tokenizer, resolve_model_dir

SIDES = ("pdserve_off", "pdserve_ngram", "llama_off", "llama_ngram")
# llama-server's n-gram speculation: TYPE[:KEY=VALUE,...], each KEY its --spec-TYPE-KEY option
LLAMA_CANDIDATES = (
    "ngram-simple",
    "ngram-simple:size-n=3,size-m=8",
    "ngram-simple:size-n=2,size-m=16",
    "ngram-map-k:size-n=3,size-m=8",
    "ngram-map-k4v:size-n=3,size-m=8",
    "ngram-mod:n-match=4,n-min=2,n-max=16",
    "ngram-cache",
)
TUNING_PASSES = 2
# (workload, streams) -> {(ours, theirs): goal}; cases and ratios not listed are reported only
GOALS: dict[tuple[str, int], dict[tuple[str, str], Goal]] = {
    ("grounded", 1): {
        ("pdserve_ngram", "pdserve_off"): Goal(1.8),
        ("pdserve_ngram", "llama_ngram"): Goal(1.3),
    },
    ("free", 1): {("pdserve_ngram", "pdserve_off"): Goal(0.97)},
    ("grounded", 32): {("pdserve_ngram", "pdserve_off"): Goal(0.97)},
    ("free", 32): {("pdserve_ngram", "pdserve_off"): Goal(0.97)},
}
RATIOS = (
    ("pdserve_ngram", "pdserve_off"),
    ("llama_ngram", "llama_off"),
    ("pdserve_ngram", "llama_ngram"),
    ("pdserve_off", "llama_off"),
)
DEFAULT_STREAMS = (1, 8, 32)
SPECULATIVE_COUNTERS = ("speculative_checks", "speculative_drafted_tokens",
                        "speculative_accepted_tokens")  # fmt: skip


def llama_spec_options(spec: str) -> tuple[str, ...]:
    """llama-server's options for ``TYPE[:KEY=VALUE,...]``."""
    kind, _, settings = spec.partition(":")
    if not kind.startswith("ngram-"):
        raise ValueError(
            f"a llama-server n-gram speculation is ngram-...[:KEY=VALUE,...], got {spec!r}"
        )
    options = ["--spec-type", kind]
    for setting in filter(None, settings.split(",")):
        key, _, value = setting.partition("=")
        if not key or not value:
            raise ValueError(f"{spec!r}: settings are KEY=VALUE, got {setting!r}")
        options += [f"--spec-{kind}-{key}", value]
    return tuple(options)


@dataclass
class Answers:
    """What a side's requests brought back: texts in prompt order, llama-server's draft counts."""

    texts: list[str]
    drafted: int = 0
    accepted: int = 0


@dataclass
class Side:
    target: Target
    metrics_url: str | None = None  # pdserve's /metrics


async def _wave(target: Target, prompts: list[str], tokens: int, answers: Answers,
                first: int) -> None:  # fmt: skip
    def on_event(index: int) -> Callable[[dict], None]:
        def seen(event: dict) -> None:
            for choice in event.get("choices") or []:
                answers.texts[index] += choice.get("text") or ""
            timings = event.get("timings") or {}
            if "draft_n" in timings and event.get("choices", [{}])[0].get("finish_reason"):
                answers.drafted += timings["draft_n"]
                answers.accepted += timings.get("draft_n_accepted", 0)

        return seen

    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        records = await asyncio.gather(*(
            send(client, target, WorkItem(prompt, tokens), on_event=on_event(first + i))
            for i, prompt in enumerate(prompts)
        ))  # fmt: skip
    for record in records:
        if not record.ok or record.output_tokens != tokens:
            raise RuntimeError(
                f"{target.url}: a request failed or brought {record.output_tokens} of {tokens} "
                f"tokens ({record.error or record.finish_reason})"
            )


def run_case(
    target: Target, prompts: list[str], streams: int, tokens: int
) -> tuple[float, Answers]:
    """Output tokens/s of ``prompts`` sent ``streams`` at a time, and their answers."""
    answers = Answers([""] * len(prompts))
    start = time.perf_counter()
    for first in range(0, len(prompts), streams):
        asyncio.run(_wave(target, prompts[first : first + streams], tokens, answers, first))
    return len(prompts) * tokens / (time.perf_counter() - start), answers


def speculative_counts(url: str) -> dict[str, float]:
    """pdserve's speculative counters (summed over workers) at ``url``."""
    counts = dict.fromkeys(SPECULATIVE_COUNTERS, 0.0)
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        if family.name in counts:
            counts[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return counts


def chat_prompts(tokenizer: Any, workload: str, count: int, seed: int) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in prompts_of(workload, count, seed)
    ]


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, folder: Path, spec: str | None) -> Iterator[Side]:
    setting = ServerSetting(slots=max(args.streams), threads=args.threads)
    log = args.workdir / f"llama-{spec or 'off'}.log".replace(":", "_").replace(",", "_")
    extra = llama_spec_options(spec) if spec else ()
    server = LlamaServer(folder, gguf_of(args.model), free_port(), log, setting, extra=extra)
    try:
        yield Side(Target(server.url, api="completions", model="llama"))
    finally:
        server.stop()


@contextlib.contextmanager
def pdserve(args: argparse.Namespace, speculative: bool) -> Iterator[Side]:
    deploy_mode, backend = SETTINGS[args.mode]
    backend = {**backend, "speculative_method": "ngram" if speculative else "off"}
    workdir = args.workdir / ("pdserve_ngram" if speculative else "pdserve_off")
    process, ports = start_pdserve(deploy_mode, args.model, workdir, backend)
    try:
        yield Side(
            Target(f"http://127.0.0.1:{ports['predict_port']}", api="completions"),
            f"http://127.0.0.1:{ports['external_port']}/metrics",
        )
    finally:
        stop_pdserve(process)


def tune_llama(args: argparse.Namespace, folder: Path, tokenizer: Any) -> tuple[str, dict]:
    """The fastest of ``LLAMA_CANDIDATES`` on the grounded single-stream case of the tuning
    seed, and every candidate's figure (or why it failed)."""
    prompts = chat_prompts(tokenizer, "grounded", PROMPTS_AT_LEAST, args.tuning_seed)
    figures: dict[str, Any] = {}
    for spec in LLAMA_CANDIDATES:
        try:
            with llama_server(args, folder, spec) as side:
                rates = [run_case(side.target, prompts, 1, args.tokens)[0]
                         for _ in range(1 + TUNING_PASSES)][1:]  # fmt: skip
        except (RuntimeError, TimeoutError) as exc:
            figures[spec] = {"error": str(exc)[:300]}
            print(f"tuning {spec}: failed: {exc}", flush=True)
            continue
        figures[spec] = spread(rates, 1)
        print(f"tuning {spec}: {figures[spec]['median']} tokens/s", flush=True)
    measured = {spec: f["median"] for spec, f in figures.items() if "median" in f}
    if not measured:
        raise SystemExit("no llama-server n-gram speculation ran; see the logs in --workdir")
    return max(measured, key=measured.__getitem__), figures


def measure_case(sides: dict[str, Side], tokenizer: Any, workload: str, streams: int,
                 args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    prompts = chat_prompts(tokenizer, workload, max(streams, PROMPTS_AT_LEAST), args.seed)
    answers: dict[str, list[Answers]] = {name: [] for name in sides}
    metrics_url = sides["pdserve_ngram"].metrics_url
    assert metrics_url is not None
    before = speculative_counts(metrics_url)

    def side(name: str) -> float:
        rate, got = run_case(sides[name].target, prompts, streams, args.tokens)
        answers[name].append(got)
        return rate

    def on_round(index: int, values: dict[str, float]) -> None:
        shown = ", ".join(f"{n} {v:.1f}" for n, v in values.items())
        print(f"{workload}:{streams} round {index + 1}: tokens/s {shown}", flush=True)

    kept = paired_rounds({name: (lambda n=name: side(n)) for name in sides}, args.rounds,
                         on_round=on_round)  # fmt: skip
    after = speculative_counts(metrics_url)
    gained = {name: after[name] - before[name] for name in SPECULATIVE_COUNTERS}
    llama_drafted = sum(a.drafted for a in answers["llama_ngram"])
    entry: dict[str, Any] = {
        "tokens_per_s": {name: spread(values, 1) for name, values in kept.items()},
        "ratios": {f"{a}/{b}": spread(ratio_rounds(kept, a, b), 3) for a, b in RATIOS},
        "acceptance": {
            "pdserve_ngram": _share(
                gained["speculative_accepted_tokens"], gained["speculative_drafted_tokens"]
            ),  # fmt: skip
            "llama_ngram": _share(sum(a.accepted for a in answers["llama_ngram"]), llama_drafted),
        },
        "same_text": {
            "pdserve_ngram": _same_text(answers["pdserve_ngram"], answers["pdserve_off"]),
            "llama_ngram": _same_text(answers["llama_ngram"], answers["llama_off"]),
        },
        "goals": {},
    }
    for (ours, theirs), goal in GOALS.get((workload, streams), {}).items():
        verdict = judge(ratio_rounds(kept, ours, theirs), goal)
        entry["goals"][f"{ours}/{theirs}"] = {"goal": str(goal), "verdict": verdict.verdict}
    shown = ", ".join(f"{k} {v['median']}x" for k, v in entry["ratios"].items())
    print(f"{workload}:{streams}: {shown}; {entry['goals']}", flush=True)
    return entry


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 3) if whole else None


def _same_text(ours: list[Answers], theirs: list[Answers]) -> float:
    pairs = [(a, b) for x, y in zip(ours, theirs, strict=True)
             for a, b in zip(x.texts, y.texts, strict=True)]  # fmt: skip
    return round(sum(a == b for a, b in pairs) / len(pairs), 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "served_speculation")
    parser.add_argument("--model", default="bundled", help="pdserve's model_path (a GGUF file)")
    parser.add_argument("--mode", default="single_node", choices=sorted(SETTINGS))
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--streams", type=int, action="append", help=f"{DEFAULT_STREAMS}")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's")
    parser.add_argument("--seed", type=int, default=11, help="draws the prompts (held out)")
    parser.add_argument("--tuning-seed", type=int, default=3, help="draws the tuning prompts")
    parser.add_argument("--llama-spec", help="llama-server's speculation (default: tuned)")
    parser.add_argument("--llama-cpp-dir", type=Path, help="a folder holding llama-server")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-served-speculation"))
    args = parser.parse_args(argv)
    args.streams = sorted(set(args.streams or DEFAULT_STREAMS))
    result_file = ResultFile.start(args, argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = server_folder(args.llama_cpp_dir)
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    result: dict[str, Any] = {
        "file": gguf_of(args.model).name,
        "mode": args.mode,
        "tokens": args.tokens,
        "seed": args.seed,
        "llama_slots": max(args.streams),
        "llama_threads": args.threads,
        "cases": {},
    }
    if args.llama_spec:
        llama_spec_options(args.llama_spec)
        result["llama_spec"] = args.llama_spec
    else:
        result["llama_spec"], result["tuning"] = tune_llama(args, folder, tokenizer)
        result["tuning_seed"] = args.tuning_seed
    result_file.write(result, complete=False)
    with contextlib.ExitStack() as stack:
        sides = {
            "pdserve_off": stack.enter_context(pdserve(args, speculative=False)),
            "pdserve_ngram": stack.enter_context(pdserve(args, speculative=True)),
            "llama_off": stack.enter_context(llama_server(args, folder, None)),
            "llama_ngram": stack.enter_context(llama_server(args, folder, result["llama_spec"])),
        }
        for workload in ("grounded", "free"):
            for streams in args.streams:
                entry = measure_case(sides, tokenizer, workload, streams, args)
                result["cases"][f"{workload}:{streams}"] = entry
                result_file.write(result, complete=False)
    result_file.write(result)


if __name__ == "__main__":
    main()
