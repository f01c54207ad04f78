"""What a JSON-schema constraint costs a served request: time per output token of constrained
against unconstrained requests through one pdserve cluster, side by side, at 1, 8 and 32
streams; the compile time of a cold and a cached schema; and the share of constrained outputs
that validate.

    python -m benchmarks.serving.structured                       # pd_separate, bundled model
    python -m benchmarks.serving.structured --deploy-mode single_node --repeats 5

One pdserve (``--deploy-mode``; ``pd_separate`` as a fixed split: every prompt handed off, so
the decode side's rebuilt matcher is what is measured). Constrained requests ask
``/v1/completions`` for ``response_format: json_schema`` with :func:`record_schema` (a record of
``--text-fields`` free-text strings, which the model writes with the grammar open to any
character, and ``--digits`` one-digit integers, where it allows only digits); unconstrained ones
ask for the same number of tokens (``ignore_eos``), the mean length of the constrained outputs
of the warm-up. The same prompts go both ways. At each stream count, ``--repeats`` rounds, each
round one batch of constrained and one of unconstrained requests (``streams`` clients, each sending
``--per-client`` requests in turn), which one goes first alternating by round. TPOT is each
request's ``(e2e - ttft) / (tokens - 1)``; a round's figure is its median, the ratio is each
round's constrained over unconstrained, reported as median [min-max] over rounds.

Compile: :class:`engine.grammars.GrammarCache` over the bundled tokenizer, in this process: a
cold compile of each of ``--compile-draws`` distinct 20-property schemas (one tokenizer view
built first, as a worker holds it), then the same schemas again (cached: a lookup and a matcher
copy). Goals: constrained TPOT <= 1.10x at 32 streams and <= 1.05x at 1 stream; cold compile of
a 20-property schema <= 50 ms; 100 % of the constrained outputs validate.

A request that fails is kept: it counts in ``failed_requests`` (with examples of its error),
a constrained one as an output that does not validate, and gives no TPOT.

Writes ``benchmarks/results/structured.json`` (``--scratch``: a trial run outside it; machine,
commit, command in ``_meta`` and, for the report, ``meta``), rendered into
``docs/performance/structured.md`` by ``python -m benchmarks.report``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from benchmarks.harness.client import Target, send
from benchmarks.harness.launch import FIXED, start_pdserve, stop_pdserve
from benchmarks.harness.record import RequestRecord
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS
from benchmarks.harness.stats import spread
from benchmarks.serving.metrics import failed_requests
from benchmarks.serving.workload import WorkItem

STREAMS = (1, 8, 32)
GOALS = {"1": 1.05, "32": 1.10}  # constrained TPOT over unconstrained, at most
COMPILE_GOAL_MS = 50.0
TEXT_CHARS = 32  # a free-text field's most characters
PROMPTS = [
    "List the digits you like best:",
    "Write down some numbers:",
    "Give me a few digits:",
    "Numbers, please:",
]


def record_schema(digits: int, texts: int = 0, text_chars: int = TEXT_CHARS) -> dict[str, Any]:
    """An object of ``texts`` free-text strings ``t0``, ... (at most ``text_chars`` characters:
    the model writes them, the grammar only keeps them strings) and ``digits`` one-digit
    integers ``d0``, ...."""
    strings = {f"t{i}": {"type": "string", "maxLength": text_chars} for i in range(texts)}
    numbers = {f"d{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(digits)}
    return {
        "type": "object",
        "properties": {**strings, **numbers},
        "required": [*strings, *numbers],
        "additionalProperties": False,
    }


def twenty_properties(draw: int) -> dict[str, Any]:
    """A 20-property schema of mixed types, distinct for each ``draw``."""
    kinds = [
        {"type": "string", "maxLength": 16},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    ]
    names = [f"field_{draw}_{i}" for i in range(20)]
    properties = {n: kinds[i % len(kinds)] for i, n in enumerate(names)}
    return {"type": "object", "properties": properties, "required": names[:10]}


@dataclass
class Batch:
    """What a batch's requests did: TPOT, text and output token count of each that succeeded,
    and every request's record (failed ones with their error)."""

    tpots: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)


async def batch(
    url: str, streams: int, per_client: int, tokens: int, extra: dict[str, Any] | None
) -> Batch:
    """``streams`` clients sending ``per_client`` requests each."""
    target = Target(url, api="completions", model="pdserve", ignore_eos=extra is None)
    done = Batch()

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        for n in range(per_client):
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            pieces: list[str] = []
            collect = partial(_collect_text, pieces)
            item = WorkItem(prompt, tokens)
            record = await send(client, target, item, on_event=collect, extra_body=extra)
            done.records.append(record)
            if not record.ok:
                continue
            if record.tpot_s is not None:
                done.tpots.append(record.tpot_s)
            done.texts.append("".join(pieces))
            done.counts.append(record.output_tokens)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(streams)))
    return done


def _collect_text(pieces: list[str], event: dict[str, Any]) -> None:
    for choice in event.get("choices") or []:
        pieces.append(choice.get("text") or "")


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class _Tally:
    """The constrained outputs served so far, how many validate, and every request by side."""

    outputs: int = 0
    valid_outputs: int = 0
    records: dict[str, list[RequestRecord]] = field(
        default_factory=lambda: {"constrained": [], "unconstrained": []}
    )


async def serving(args: argparse.Namespace, url: str) -> dict[str, Any]:
    schema = record_schema(args.digits, args.text_fields)
    constrained = _constrained(schema)
    # room for the whole record (a character a token at worst in the strings): it ends on its own
    budget = args.digits * 8 + args.text_fields * (TEXT_CHARS + 8) + 8
    warm = await batch(url, 1, len(PROMPTS), budget, constrained)
    if not warm.counts:
        raise RuntimeError(f"every warm-up request failed: {failed_requests(warm.records)}")
    tokens = max(2, round(statistics.mean(warm.counts)))
    shape = {"digits": args.digits, "text_fields": args.text_fields, "text_chars": TEXT_CHARS}
    figures: dict[str, Any] = {"output_tokens": tokens, "schema": shape, "streams": {}}
    tally = _Tally()
    for streams in args.streams:
        ratios, free_tpot, bound_tpot = [], [], []
        for round_index in range(args.repeats):
            order = [None, constrained] if round_index % 2 == 0 else [constrained, None]
            medians: dict[bool, float] = {}
            for extra in order:  # unconstrained: the constrained outputs' length exactly
                asked = budget if extra is not None else tokens
                medians[extra is not None] = await _median_tpot(
                    url, streams, args.per_client, asked, extra, schema, tally
                )
            free_tpot.append(medians[False] * 1000)
            bound_tpot.append(medians[True] * 1000)
            ratios.append(medians[True] / medians[False])
        figures["streams"][str(streams)] = {
            "tpot_ms_unconstrained": spread(free_tpot, 2),
            "tpot_ms_constrained": spread(bound_tpot, 2),
            "ratio": spread(ratios),
        }
        print(f"{streams} streams: {figures['streams'][str(streams)]}", flush=True)
    figures["outputs"] = tally.outputs
    figures["valid_share"] = tally.valid_outputs / max(tally.outputs, 1)
    failing = {side: f for side, each in tally.records.items() if (f := failed_requests(each))}
    if failing:
        figures["failed_requests"] = failing
    return figures


def _constrained(schema: dict[str, Any]) -> dict[str, Any]:
    """The request fields that constrain the output to ``schema``."""
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": schema, "strict": True},
        }
    }


async def _median_tpot(
    url: str,
    streams: int,
    per_client: int,
    tokens: int,
    extra: dict[str, Any] | None,
    schema: dict[str, Any],
    tally: _Tally,
) -> float:
    """One batch (constrained when ``extra``), its requests and outputs tallied: its median
    TPOT, in seconds."""
    done = await batch(url, streams, per_client, tokens, extra)
    tally.records["constrained" if extra is not None else "unconstrained"] += done.records
    if extra is not None:  # a failed request: an output that does not validate
        tally.outputs += len(done.records)
        tally.valid_outputs += sum(valid(t, schema) for t in done.texts)
    if not done.tpots:
        raise RuntimeError(f"no TPOT at {streams} streams: {failed_requests(done.records)}")
    return statistics.median(done.tpots)


def compiling(args: argparse.Namespace) -> dict[str, Any]:
    from coordinator.api.structured_request import schema_constraint
    from engine.grammars import GrammarCache
    from engine.model.loader import load_model

    loaded = load_model(args.model)
    cache = GrammarCache(loaded.tokenizer, len(loaded.tokenizer))
    start = time.perf_counter()
    _ = cache.tokenizer
    view_s = time.perf_counter() - start
    # as the doors make them: a strict schema in canonical JSON
    schemas = [twenty_properties(d) for d in range(args.compile_draws)]
    constraints = [schema_constraint("json_schema", schema, strict=True) for schema in schemas]
    cold, cached = [], []
    for constraint in constraints:
        start = time.perf_counter()
        cache.state(constraint)
        cold.append((time.perf_counter() - start) * 1000)
    for constraint in constraints:
        start = time.perf_counter()
        cache.state(constraint)
        cached.append((time.perf_counter() - start) * 1000)
    return {
        "tokenizer_view_s": round(view_s, 3),
        "cold_ms": spread(cold),
        "cached_ms": spread(cached, 4),
        "goal_cold_ms": COMPILE_GOAL_MS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--deploy-mode", default="pd_separate")
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    parser.add_argument("--repeats", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--digits", type=int, default=12)
    parser.add_argument(
        "--text-fields", type=int, default=2, help=f"free-text strings (<= {TEXT_CHARS} chars)"
    )
    parser.add_argument("--compile-draws", type=int, default=20)
    add_output_arguments(parser, "structured")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    # the report reads ``meta``; the result file keeps its provenance under ``_meta`` too
    report: dict[str, Any] = {"meta": result_file.meta, "deploy_mode": args.deploy_mode}
    report["compile"] = compiling(args)
    print(f"compile: {report['compile']}", flush=True)
    result_file.write(report, complete=False)
    backend = {"stepTargetMs": 0, **(FIXED if args.deploy_mode == "pd_separate" else {})}
    backend["maxIterTimes"] = 4096
    with tempfile.TemporaryDirectory() as workdir:
        process, ports = start_pdserve(args.deploy_mode, args.model, Path(workdir), backend)
        try:
            url = f"http://127.0.0.1:{ports['predict_port']}"
            report["serving"] = asyncio.run(serving(args, url))
        finally:
            stop_pdserve(process, 60)
    report["goals"] = {"tpot_ratio_at_most": GOALS, "valid_share": 1.0}
    if report["serving"].get("failed_requests"):
        report["failed_requests"] = report["serving"]["failed_requests"]
    result_file.write(report)
    print(json.dumps(report["serving"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
