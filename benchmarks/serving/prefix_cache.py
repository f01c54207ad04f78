"""Prefix caching on against off: one multi-turn chat workload against pdserve with
``backend_config.enablePrefixCaching`` true and false, side by side.

    python -m benchmarks.serving.prefix_cache          # benchmarks/results/prefix_cache.json
    python -m benchmarks.serving.prefix_cache --openai-url http://127.0.0.1:8080 --scratch

Starts pdserve on this machine (``--deploy-mode``, ``pd_separate`` by default) twice, caching on
and then off, both with the same ``cacheBlockSize`` (``--block-size``). Every ``--openai-url``
(any OpenAI-compatible server, e.g. llama-server with prompt caching and a slot per user) is
one more column, run as it is. Each column gets a warm-up request, then ``--repeats`` runs of
fresh conversations (``prefix_chat_workload``): ``--users`` conversations sharing one
``--system-tokens`` system prompt, ``--turns`` turns each, ``--max-tokens`` tokens an answer
(greedy, ``ignore_eos``); repeat ``r`` uses seed ``--seed + r`` in every column. Users are
closed loops, ``--concurrency`` of them at a time: a user sends its next turn once the last
answer has ended. Requests go to ``/v1/chat/completions``, streamed, with
``stream_options.include_usage``.

Per column: TTFT p50 [interquartile range] and p99, end-to-end p50, requests/s [min-max over
repeats], the share of requests meeting compare_modes' SLOs (TTFT <= 3 s, TPOT <= 150 ms), and
the prefix cache hit rate three ways: from usage, ``sum(prompt_tokens_details.cached_tokens) /
sum(prompt_tokens)`` (llama.cpp's ``timings.cache_n`` where usage lacks it); from pdserve's
``/metrics``, the ``prefix_cache_hits_total`` / ``prefix_cache_queries_total`` deltas over the
runs (the prefill, else colocated, workers' series); and the rate the workload allows
(``prefix_chat_workload``, an upper bound: earlier prompts cover in ``pd_separate``, prompts
plus answers elsewhere; token ids from the bundled tokenizer's chat template, so only an
estimate for another model). Ratios on / off: TTFT p50 (goal <= 0.3) and requests/s (goal
>= 2), pooled over the repeats [min-max of the per-repeat ratios].

``--tenants N``: the cost of tenant isolation instead. Both columns run caching on, behind ``N``
API keys (``http_config.api_keys``, so each key is a tenant with a prefix cache of its own): in
the first every user sends with the same key (one tenant), in the second user ``u`` with key
``u % N`` (``N`` tenants), the same conversations and the same shared system prompt in both, so
the second computes and holds the shared prefix once per tenant. Ratios: ``N`` tenants over one.

Prints the table (also written as Markdown next to the JSON), and writes the JSON (every request
too, failed ones with their error; ``benchmarks/results/prefix_cache.json``, or
``prefix_cache_tenants.json`` with ``--tenants``, by default) and a PNG: TTFT CDFs and the median
TTFT of each turn.

    python -m benchmarks.serving.prefix_cache --tenants 6 --deploy-mode single_node
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.client import Target
from benchmarks.harness.launch import DEPLOY_MODES, FIXED, start_pdserve, stop_pdserve
from benchmarks.harness.record import RequestRecord
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.serving.metrics import SLO, failed_requests, summarize
from benchmarks.serving.plots import plot_ttft_by_turn
from benchmarks.serving.prefix_chat import (
    Conversation,
    SentPrompt,
    allowed_cached_tokens,
    cache_figures,
    make_conversations,
    system_prompt,
    take_turn,
)

METRICS_SETTLE_S = 1.0  # pdserve's router polls worker counts every 0.25 s
GOALS = {"ttft_p50": ("<=", 0.3), "request_throughput": (">=", 2.0)}
_COUNTER = re.compile(r"^\w*prefix_cache_(queries|hits)_total(\{[^}]*\})?[ \t]+(\S+)$", re.M)
_KV_COUNTER = re.compile(r"^\w*kv_transfer(s|_bytes)_total(\{[^}]*\})?[ \t]+(\S+)$", re.M)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from coordinator.config.loader import SCHEMA

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deploy-mode", choices=DEPLOY_MODES, default="pd_separate")
    parser.add_argument("--model", default="bundled", help="pdserve's model_path")
    parser.add_argument("--tokenizer", help="renders prompts for the allowed hit rate")
    parser.add_argument("--openai-url", action="append", default=[], help="one more column")
    parser.add_argument("--openai-model", default="", help="the 'model' field sent there")
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-words", type=int, default=20, help="words in a user message")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens an answer")
    parser.add_argument("--concurrency", type=int, help="users talking at once (default: all)")
    parser.add_argument(
        "--block-size", type=int, default=SCHEMA["backend_config"]["cacheBlockSize"].default
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of fresh conversations")
    parser.add_argument("--slo-ttft", type=float, default=SLO.ttft_s, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=SLO.tpot_s, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tenants", type=int, default=0, help="one tenant against this many (0: on / off)"
    )
    add_output_arguments(parser, "prefix_cache")
    args = parser.parse_args(argv)
    if args.tenants:
        args.result_name = "prefix_cache_tenants"
    args.tokenizer = args.tokenizer or args.model
    args.concurrency = args.concurrency or args.users
    return args


@dataclass(frozen=True)
class Column:
    """One server under test."""

    label: str
    target: Target
    metrics_url: str | None = None  # pdserve's Prometheus page
    with_answers: bool = True  # its cache keeps decoded KV too (for the allowed hit rate)
    caching: bool | None = None  # pdserve's enablePrefixCaching
    keys: tuple[str, ...] = ()  # user u sends with API key keys[u % len(keys)]; (): none


@dataclass
class Turn:
    """One request of a conversation, as sent and answered."""

    user: int
    turn: int
    messages: list[dict[str, str]]
    record: RequestRecord
    answer: str = ""

    @property
    def usage_prompt_tokens(self) -> int | None:
        return self.record.served_prompt_tokens

    @property
    def cached_tokens(self) -> int | None:
        return self.record.cached_tokens


@dataclass
class Tokenizer:
    """Prompt token ids as the server renders chat messages, and plain text's ids."""

    chat_ids: Callable[[list[dict[str, str]]], list[int]]
    encode: Callable[[str], list[int]]


def load_chat_tokenizer(name: str) -> Tokenizer:
    from engine.model.model_files import load_tokenizer, tokenizer_dir

    loaded = load_tokenizer(tokenizer_dir(name))

    def chat_ids(messages: list[dict[str, str]]) -> list[int]:
        ids = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return Tokenizer(chat_ids, lambda text: loaded.encode(text, add_special_tokens=False))


def tenant_keys(num_tenants: int) -> tuple[str, ...]:
    """The API keys of ``num_tenants`` tenants."""
    return tuple(f"bench-tenant-{i}" for i in range(num_tenants))


@contextmanager
def pdserve_column(
    args: argparse.Namespace, workdir: Path, caching: bool, tenants: int = 0
) -> Iterator[Column]:
    """pdserve with caching on or off; ``tenants``: its users spread over that many of the
    ``args.tenants`` API keys it is configured with (0: no keys)."""
    workdir.mkdir(parents=True, exist_ok=True)
    backend = {"enablePrefixCaching": caching, "cacheBlockSize": args.block_size}
    if args.deploy_mode == "pd_separate":  # every prompt handed off: the path measured here
        backend |= FIXED
    http = {"api_keys": list(tenant_keys(args.tenants))} if tenants else {}
    process, ports = start_pdserve(args.deploy_mode, args.model, workdir, backend, http)
    label = f"caching {'on' if caching else 'off'}"
    if tenants:
        label = f"{tenants} tenant{'s' if tenants > 1 else ''}"
    try:
        yield Column(
            f"{args.deploy_mode}, {label}",
            Target(f"http://127.0.0.1:{ports['predict_port']}", "chat"),
            f"http://127.0.0.1:{ports['external_port']}/metrics",
            with_answers=args.deploy_mode != "pd_separate",
            caching=caching,
            keys=tenant_keys(tenants),
        )
    finally:
        stop_pdserve(process)


async def one_turn(
    client: httpx.AsyncClient,
    target: Target,
    conversation: Conversation,
    user: int,
    turn: int,
    max_tokens: int,
    start: float,
) -> Turn:
    messages = conversation.messages(turn)
    sent_at = time.perf_counter() - start
    record, answer = await take_turn(client, target, conversation, turn, max_tokens)
    record.sent_at = sent_at
    return Turn(user, turn, messages, record, answer)


def user_target(target: Target, keys: Sequence[str], user: int) -> Target:
    """What user ``user`` sends to: ``target`` with its API key (``keys`` cycled; none: as
    it is)."""
    if not keys:
        return target
    return replace(
        target, headers=(*target.headers, ("authorization", f"Bearer {keys[user % len(keys)]}"))
    )


async def talk(
    target: Target,
    conversations: list[Conversation],
    concurrency: int,
    max_tokens: int,
    keys: Sequence[str] = (),
) -> tuple[list[Turn], float]:
    """Every conversation to its end, ``concurrency`` at a time; the turns and the run time.
    ``keys``: user ``u`` sends with API key ``keys[u % len(keys)]`` (:func:`user_target`)."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    targets = [user_target(target, keys, user) for user in range(len(conversations))]
    async with AsyncExitStack() as stack:
        clients: dict[tuple, httpx.AsyncClient] = {}
        for each in targets:  # a client per key
            if each.headers not in clients:
                client = httpx.AsyncClient(
                    timeout=httpx.Timeout(600), limits=limits, headers=dict(each.headers)
                )
                clients[each.headers] = await stack.enter_async_context(client)
        start = time.perf_counter()

        async def converse(user: int, conversation: Conversation) -> list[Turn]:
            mine = targets[user]
            client = clients[mine.headers]
            async with limit:
                return [
                    await one_turn(client, mine, conversation, user, turn, max_tokens, start)
                    for turn in range(conversation.num_turns)
                ]

        talks = await asyncio.gather(*(converse(u, c) for u, c in enumerate(conversations)))
        return [turn for turns in talks for turn in turns], time.perf_counter() - start


def prefix_counters(url: str | None) -> dict[str, dict[str, float]] | None:
    """The prefix cache counters on the Prometheus page at ``url`` (None: none there), read
    once the coordinator has polled its workers' latest counts."""
    if url is None:
        return None
    time.sleep(METRICS_SETTLE_S)
    try:
        return parse_prefix_counters(httpx.get(url, timeout=10).text)
    except httpx.HTTPError:
        return None


def parse_prefix_counters(text: str) -> dict[str, dict[str, float]] | None:
    """``{"all" and each role: {"queries", "hits"}}``, summed over the series of the
    ``*prefix_cache_{queries,hits}_total`` counters in a Prometheus text page (None: none)."""
    totals: dict[str, dict[str, float]] = {}
    for kind, labels, value in _COUNTER.findall(text):
        role = re.search(r'role="([^"]*)"', labels)
        for key in ("all", role.group(1)) if role else ("all",):
            totals.setdefault(key, {"queries": 0.0, "hits": 0.0})[kind] += float(value)
    for kind, _, value in _KV_COUNTER.findall(text):  # KV hand-offs, and the bytes they moved
        name = "handoffs" if kind == "s" else "bytes"
        totals.setdefault("kv", {"handoffs": 0.0, "bytes": 0.0})[name] += float(value)
    return totals or None


def counter_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    if before is None or after is None:
        return None
    return {
        role: {k: v - before.get(role, {}).get(k, 0.0) for k, v in kinds.items()}
        for role, kinds in after.items()
    }


def bytes_per_handoff(delta: dict[str, dict[str, float]] | None) -> float | None:
    """KV bytes moved per prefill -> decode hand-off over a run (None: no hand-off seen)."""
    kv = (delta or {}).get("kv")
    return kv["bytes"] / kv["handoffs"] if kv and kv["handoffs"] else None


def metrics_hit_rate(delta: dict[str, dict[str, float]] | None) -> float | None:
    if not delta:
        return None
    counts = delta.get("prefill") or delta.get("colocated") or delta.get("all")
    return counts["hits"] / counts["queries"] if counts and counts["queries"] else None


def request_rows(turns: list[Turn], tokenizer: Tokenizer, block_size: int) -> list[dict]:
    """Every request's timings, usage and allowed cached tokens (by prompts, and by prompts
    plus answers; see prefix_chat_workload)."""
    sent, ids_of = [], []
    for t in turns:
        ids = tuple(tokenizer.chat_ids(t.messages))
        r = t.record
        end = r.sent_at + r.e2e_s if r.ok and r.e2e_s is not None else float("inf")
        sent.append(SentPrompt(ids, r.sent_at, tuple(tokenizer.encode(t.answer)), end))
        ids_of.append(ids)
        r.prompt_tokens = t.usage_prompt_tokens or len(ids)
    allowed = allowed_cached_tokens(sent, block_size)
    allowed_answers = allowed_cached_tokens(sent, block_size, with_answers=True)
    return [
        {
            **t.record.to_dict(),
            "ok": t.record.ok,
            "user": t.user,
            "turn": t.turn,
            "num_prompt_ids": len(ids),
            "usage_prompt_tokens": t.usage_prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "allowed_cached_tokens": a,
            "allowed_cached_tokens_with_answers": b,
            "answer": t.answer,
        }
        for t, ids, a, b in zip(turns, ids_of, allowed, allowed_answers, strict=True)
    ]


def run_column(column: Column, args: argparse.Namespace, tokenizer: Tokenizer) -> dict:
    """A warm-up conversation turn (another system prompt), then ``args.repeats`` runs."""
    slo = SLO(args.slo_ttft, args.slo_tpot)
    warmup = make_conversations(1, 1, system_prompt(args.system_tokens, tokenizer.encode, -1))
    asyncio.run(talk(column.target, warmup, 1, args.max_tokens, column.keys))
    records: list[RequestRecord] = []
    rows: list[dict] = []
    repeats, duration, deltas = [], 0.0, []
    for repeat in range(args.repeats):
        turns, seconds, delta = _run_repeat(column, args, tokenizer, repeat)
        these = [
            {**row, "repeat": repeat} for row in request_rows(turns, tokenizer, args.block_size)
        ]
        summary = summarize([t.record for t in turns], seconds, slo)
        summary |= cache_figures(these, column.with_answers)
        summary |= {
            "hit_rate_metrics": metrics_hit_rate(delta),
            "kv_bytes_per_handoff": bytes_per_handoff(delta),
            "metrics_delta": delta,
        }
        repeats.append(summary)
        records += [t.record for t in turns]
        rows += these
        duration += seconds
        deltas.append(delta)
        print(f"{column.label} #{repeat}: {_brief(summary)}", flush=True)
    pooled = summarize(records, duration, slo) | cache_figures(rows, column.with_answers)
    pooled["hit_rate_metrics"] = metrics_hit_rate(_sum_deltas(deltas))
    pooled["kv_bytes_per_handoff"] = bytes_per_handoff(_sum_deltas(deltas))
    return _column_result(column, pooled, repeats, rows, records)


def _run_repeat(
    column: Column, args: argparse.Namespace, tokenizer: Tokenizer, repeat: int
) -> tuple[list[Turn], float, dict[str, dict[str, float]] | None]:
    """Repeat ``repeat``'s conversations (its own seed) against the column: its turns, seconds,
    and the change in the prefix-cache counters over it."""
    seed = args.seed + repeat
    system = system_prompt(args.system_tokens, tokenizer.encode, seed)
    conversations = make_conversations(args.users, args.turns, system, seed, args.user_words)
    before = prefix_counters(column.metrics_url)
    turns, seconds = asyncio.run(
        talk(column.target, conversations, args.concurrency, args.max_tokens, column.keys)
    )
    delta = counter_delta(before, prefix_counters(column.metrics_url))
    return turns, seconds, delta


def _column_result(
    column: Column,
    pooled: dict,
    repeats: list[dict],
    rows: list[dict],
    records: list[RequestRecord],
) -> dict:
    """A column's JSON: its setup, pooled summary, repeats, requests and any failed ones."""
    out = {
        "label": column.label,
        "url": column.target.url,
        "enable_prefix_caching": column.caching,
        "tenants": len(column.keys),
        "allowed_counts": "prompts and answers" if column.with_answers else "prompts",
        "summary": pooled,
        "repeats": repeats,
        "requests": rows,
    }
    if failed := failed_requests(records):
        out["failed_requests"] = failed
    return out


def _sum_deltas(deltas: list[dict | None]) -> dict[str, dict[str, float]] | None:
    if not deltas or any(d is None for d in deltas):
        return None
    total: dict[str, dict[str, float]] = {}
    for delta in deltas:
        for role, kinds in delta.items():
            for kind, value in kinds.items():
                total.setdefault(role, {}).setdefault(kind, 0.0)
                total[role][kind] += value
    return total


def _brief(s: dict[str, Any]) -> str:
    return (
        f"{s['num_succeeded']}/{s['num_requests']} ok in {s['duration_s']:.1f} s, "
        f"TTFT p50 {_num(s['ttft_s']['p50'])} s, {s['request_throughput']:.2f} req/s, "
        f"hit rate {_pct(s['hit_rate_usage'])} (allowed {_pct(s['allowed_hit_rate'])})"
    )


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def ratios(
    on: dict, off: dict, goals: dict[str, tuple[str, float]] = GOALS
) -> dict[str, dict[str, Any]]:
    """On over off for each figure: pooled, and the min-max of the per-repeat ratios (repeat
    ``r`` ran the same conversations in both); with the goal (of ``goals``) and whether it was
    met."""
    figures: dict[str, Callable[[dict], float | None]] = {
        "ttft_p50": lambda s: s["ttft_s"]["p50"],
        "ttft_p99": lambda s: s["ttft_s"]["p99"],
        "e2e_p50": lambda s: s["e2e_s"]["p50"],
        "request_throughput": lambda s: s["request_throughput"],
        "kv_bytes_per_handoff": lambda s: s.get("kv_bytes_per_handoff"),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, figure in figures.items():
        pairs = zip(on["repeats"], off["repeats"], strict=False)
        each = [r for a, b in pairs if (r := ratio(figure(a), figure(b))) is not None]
        pooled = ratio(figure(on["summary"]), figure(off["summary"]))
        out[name] = {
            "ratio": pooled,
            "min": min(each, default=None),
            "max": max(each, default=None),
        }
        if name in goals:
            sense, goal = goals[name]
            met = None if pooled is None else (pooled <= goal if sense == "<=" else pooled >= goal)
            out[name] |= {"goal": f"{sense} {goal}", "met": met}
    return out


def table(
    columns: list[dict],
    on_off: dict[str, dict[str, Any]] | None,
    slo: SLO,
    ratio_label: str = "on / off",
) -> str:
    """Markdown: a row per figure, a column per server, and the ratios (``ratio_label``)."""
    rows: list[tuple[str, Callable[[dict], str], str | None]] = [
        ("TTFT p50 (s) [IQR]", _ttft_p50, "ttft_p50"),
        ("TTFT p99 (s)", lambda c: _num(c["summary"]["ttft_s"]["p99"]), "ttft_p99"),
        ("end-to-end p50 (s)", lambda c: _num(c["summary"]["e2e_s"]["p50"]), "e2e_p50"),
        ("requests/s [repeats min-max]", _throughput, "request_throughput"),
        (
            f"SLO attainment (TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1000:g} ms)",
            lambda c: _pct(c["summary"]["slo_attainment"]),
            None,
        ),
        ("hit rate: usage", lambda c: _pct(c["summary"]["hit_rate_usage"]), None),
        ("hit rate: /metrics", lambda c: _pct(c["summary"]["hit_rate_metrics"]), None),
        ("hit rate the workload allows", lambda c: _pct(c["summary"]["allowed_hit_rate"]), None),
        ("KV MB moved per hand-off", _handoff_mb, "kv_bytes_per_handoff"),
        ("requests ok", _ok, None),
    ]
    extra = [ratio_label] if on_off else []
    lines = [
        "| | " + " | ".join([c["label"] for c in columns] + extra) + " |",
        "|---" * (1 + len(columns) + len(extra)) + "|",
    ]
    for name, cell, key in rows:
        cells = [cell(c) for c in columns]
        if on_off:
            cells.append(_ratio_cell(on_off[key]) if key else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _handoff_mb(column: dict) -> str:
    num_bytes = column["summary"].get("kv_bytes_per_handoff")
    return "-" if num_bytes is None else f"{num_bytes / 1e6:.1f}"


def _ttft_p50(column: dict) -> str:
    s = column["summary"]
    low, high = s["ttft_quartiles_s"]
    return f"{_num(s['ttft_s']['p50'])} [{_num(low)}-{_num(high)}]"


def _throughput(column: dict) -> str:
    each = [r["request_throughput"] for r in column["repeats"]]
    return f"{column['summary']['request_throughput']:.2f} [{min(each):.2f}-{max(each):.2f}]"


def _ok(column: dict) -> str:
    return f"{column['summary']['num_succeeded']}/{column['summary']['num_requests']}"


def _ratio_cell(entry: dict[str, Any]) -> str:
    if entry["ratio"] is None:
        return "-"
    cell = f"{entry['ratio']:.2f} [{_num(entry['min'])}-{_num(entry['max'])}]"
    if "goal" in entry:
        cell += f" (goal {entry['goal']}: {'met' if entry['met'] else 'missed'})"
    return cell


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def run_all(
    args: argparse.Namespace, tokenizer: Tokenizer, on_column: Callable[[list[dict]], None]
) -> list[dict]:
    """Every column in turn; ``on_column(columns so far)`` after each."""
    columns: list[dict] = []
    runs = [(True, 1), (True, args.tenants)] if args.tenants else [(True, 0), (False, 0)]
    with tempfile.TemporaryDirectory(prefix="pdserve-prefix-") as tmp:
        for caching, tenants in runs:
            workdir = Path(tmp) / f"{'on' if caching else 'off'}-{tenants}"
            with pdserve_column(args, workdir, caching, tenants) as column:
                columns.append(run_column(column, args, tokenizer))
                on_column(columns)
    for url in args.openai_url:
        target = Target(url.rstrip("/"), "chat", args.openai_model)
        columns.append(run_column(Column(url, target), args, tokenizer))
        on_column(columns)
    return columns


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    out = result_file.path
    started = time.monotonic()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    tokenizer = load_chat_tokenizer(args.tokenizer)
    columns = run_all(
        args,
        tokenizer,
        lambda done: result_file.write({"settings": settings, "columns": done}, complete=False),
    )
    if args.tenants:  # the cost of isolation: N tenants over one
        label = f"{args.tenants} / 1 tenant"
        on_off = ratios(columns[1], columns[0], goals={})
    else:
        label, on_off = "on / off", ratios(columns[0], columns[1])
    slo = SLO(args.slo_ttft, args.slo_tpot)
    summary = table(columns, on_off, slo, label)
    system = system_prompt(args.system_tokens, tokenizer.encode, args.seed)
    report = {
        "machine": f"{os.cpu_count()} cores",
        "minutes": (time.monotonic() - started) / 60,
        "settings": settings,
        "system_prompt_tokens": len(tokenizer.encode(system)),
        "ratios_tenants_over_one" if args.tenants else "ratios_on_over_off": on_off,
        "table": summary,
        "columns": columns,
    }
    failing = {c["label"]: c["failed_requests"] for c in columns if c.get("failed_requests")}
    if failing:
        report["failed_requests"] = failing
    result_file.write(report)
    out.with_suffix(".md").write_text(summary + "\n")
    plot_ttft_by_turn({c["label"]: c["requests"] for c in columns}, out.with_suffix(".png"))
    print(summary)
    print(f"results: {out} ({report['minutes']:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
