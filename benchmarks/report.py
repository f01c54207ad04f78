"""The performance tables of the README and ``docs/performance/``, generated from the committed
result files.

    python -m benchmarks.report            # rewrite every generated block of those documents
    python -m benchmarks.report --check    # exit 1 naming each block that differs from its JSON,
                                           # and each figure stated outside a block

A generated block sits between ``<!-- report: NAME -->`` and ``<!-- /report -->`` in a document;
``NAME`` is a result file under ``benchmarks/results/`` (``NAME.json``) with a renderer below.
Each block starts with the run it comes from (CPU, the instruction sets it executes, commit, date,
command), so no figure stands apart from the file that backs it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import caveats
from benchmarks.harness.stats import Goal, bootstrap_interval, judge
from benchmarks.serving.burst_report import render as render_burst_table
from benchmarks.serving.memory_report import render as render_memory_tables
from benchmarks.serving.mode_pair_report import render_mode_pair
from benchmarks.serving.modes_report import render as render_modes_tables
from benchmarks.serving.served_stream_report import render as render_served_stream_tables
from benchmarks.serving.served_stream_report import render_headline as render_stream_goals

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCUMENTS = (
    README,
    ROOT / "docs" / "testing.md",
    *sorted((ROOT / "docs" / "performance").glob("*.md")),
)
# ``NAME`` or ``NAME:VIEW``: the result file NAME.json, rendered whole or as a VIEW of it
BLOCK = re.compile(r"(<!-- report: (\w+(?::\w+)?) -->\n)(.*?)(<!-- /report -->)", re.DOTALL)

# measure -> goal for pdserve / llama.cpp (the issue that set it), None: no goal: the bundled
# files'; the random files at the sizes people serve have their own (FILE_GOALS)
ENGINE_GOALS = {"single_stream": 1.2, "prefill512": 2.0, "batch32": 2.0}
_SERVED_SIZE_GOALS = {"single_stream": 1.1, "prefill512": 1.3, "batch32": 1.5}
FILE_GOALS = {
    "0.5b-q4_k_m": _SERVED_SIZE_GOALS,
    "1b-q4_k_m": _SERVED_SIZE_GOALS,
    "3b-q4_k_m": {"single_stream": 1.0},
}


def engine_goal(file_set: str | None, measure: str) -> float | None:
    """The goal of ``measure`` on ``file_set`` (None: the bundled file); None: no goal."""
    return FILE_GOALS.get(file_set or "bundled", ENGINE_GOALS).get(measure)


CLOSED_LOOP_GOALS = {"1": 1.2, "8": 2.0, "32": 2.0}
RATE_GOAL = 2.0


def _measures(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A result file's measures, its ``_meta`` left out."""
    return [(key, entry) for key, entry in data.items() if not key.startswith("_")]


def _cell(spread: dict[str, Any], digits: int = 1) -> str:
    return f"{spread['median']:.{digits}f} [{spread['min']:.{digits}f}-{spread['max']:.{digits}f}]"


def _goal(ratio: dict[str, Any] | float | None, goal: float | None, at_least: bool = True) -> str:
    """The verdict on ``goal`` by the rule of :mod:`benchmarks.harness.stats`: from the ratio's
    rounds when the result has them; a lone figure (no rounds) decides nothing."""
    if goal is None or ratio is None:
        return "-"
    bound = Goal(goal, at_least)
    if not isinstance(ratio, dict) or not ratio.get("rounds"):
        return f"{bound}: undecided (a single figure, no rounds)"
    return f"{bound}: {judge(ratio['rounds'], bound)}"


def _ratio_cell(spread: dict[str, Any], digits: int = 2) -> str:
    """The median ratio and its 95 % bootstrap interval over rounds."""
    if not spread.get("rounds"):
        return _cell(spread, digits)
    low, high = bootstrap_interval(spread["rounds"])
    return f"{spread['median']:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def provenance(meta: dict[str, Any]) -> str:
    isa = ", ".join(meta.get("isa_executes", [])) or "unknown"
    return (
        f"*{meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, executing {isa}; commit "
        f"{meta.get('commit', '?')}, {meta.get('date', '?')}: `{meta.get('command', '?')}`*"
    )


def vs_llamacpp_measures(data: dict[str, Any]) -> list[tuple[str | None, str, dict[str, Any]]]:
    """(file set, measure, entry) of a ``vs_llamacpp`` result: several files under ``files``, or
    (a file of one GGUF, set None) the measures at the top level."""
    if "files" not in data:
        return [(None, key, entry) for key, entry in _measures(data)]
    return [
        (name, key, entry)
        for name, result in data["files"].items()
        for key, entry in result["measures"].items()
    ]


def render_vs_llamacpp(data: dict[str, Any]) -> str:
    meta = data["_meta"]
    several = "files" in data
    lines = [
        provenance(meta),
        "",
        f"|{' GGUF |' if several else ''} tokens/s, median [min-max] over rounds | pdserve | "
        "llama.cpp (faster build) | pdserve / llama.cpp, median [95 % interval] | goal | prompt "
        "tokens from the prefix cache |",
        f"|{'---|' if several else ''}---|---|---|---|---|---|",
    ]
    for name, key, entry in vs_llamacpp_measures(data):
        ratio = entry["ratio"]
        lines.append(
            f"|{f' {name} |' if several else ''} {key} | {_cell(entry['pdserve'])} | "
            f"{_cell(entry['llamacpp'])} ({entry.get('llamacpp_build', '-')}) | "
            f"**{_ratio_cell(ratio)}** | {_goal(ratio, engine_goal(name, key))} | "
            f"{entry.get('prefix_cache_hit_tokens', 0)} |"
        )
        if "pdserve_float32" in entry:  # --activation-dtype both: the float32 side of the rounds
            lines.append(
                f"|{f' {name} |' if several else ''} {key}, float32 activations | "
                f"{_cell(entry['pdserve_float32'])} | (the same rounds) | "
                f"{_ratio_cell(entry['pdserve_float32_ratio'])} | - | - |"
            )
    sides = meta.get("sides", {})
    builds = [
        f"{name.removeprefix('llamacpp_')}: {_switches(side.get('cmake_options', []))}"
        for name, side in sides.items()
        if name.startswith("llamacpp_")
    ]
    pdserve = sides.get("pdserve", {})
    weights = f"{pdserve['weights']}; " if "weights" in pdserve else ""
    if "activation_dtype" in pdserve:
        weights += f"decode rows on {pdserve['activation_dtype']} activations; "
    lines += [
        "",
        f"pdserve: {weights}its kernels' ISA "
        f"{pdserve.get('kernel_isa', '?')}; {pdserve.get('threads', '?')} threads. "
        "llama.cpp builds (GGML switches on): " + "; ".join(builds) + ".",
    ]
    if several:
        lines += ["", *(_file_line(name, result["file"]) for name, result in data["files"].items())]
    return "\n".join(lines)


def _file_line(name: str, file: dict[str, Any]) -> str:
    """One GGUF of a several-file result: its tensor types and what pdserve computes it with."""
    types = ", ".join(f"{count} {kind}" for kind, count in file.get("tensor_types", {}).items())
    return (
        f"- {name}: `{file.get('gguf', '?')}` ({file.get('size_bytes', 0) / 2**20:.0f} MiB; "
        f"tensors {types}); pdserve {file.get('pdserve_weights', '?')}; "
        f"{file.get('new_tokens', '?')} new tokens single stream, batch "
        f"{file.get('batch_prompt_tokens', '?')} + {file.get('batch_new_tokens', '?')} tokens."
    )


def _switches(options: list[str]) -> str:
    """The ``-DGGML_<X>=ON`` switches of a build, as ``x`` names (NATIVE must be off)."""
    on = [o[len("-DGGML_") : -len("=ON")].lower() for o in options if o.startswith("-DGGML_")
          and o.endswith("=ON")]  # fmt: skip
    native = "-DGGML_NATIVE=OFF" in options
    return f"{', '.join(on) or 'none'}{'' if native else ' (GGML_NATIVE not off!)'}"


def render_engine(data: dict[str, Any]) -> str:
    meta = data["_meta"]
    sides = meta.get("sides", {})
    lines = [
        provenance(meta),
        "",
        f"pdserve: {sides.get('pdserve', '?')}; transformers: {sides.get('transformers', '?')}. "
        "The ratio is what the engine gains with its 4- and 8-bit weights and kernels against "
        "fp32 weights, not a like-for-like kernel comparison.",
        "",
        "| tokens/s, median [min-max] over rounds | pdserve (4/8-bit weights) | "
        "transformers (fp32 weights) | pdserve / transformers | prompt tokens from the cache |",
        "|---|---|---|---|---|",
    ]
    for key, entry in _measures(data):
        lines.append(
            f"| {key} | {_cell(entry['pdserve'])} | {_cell(entry['baseline'])} | "
            f"{_cell(entry['ratio'], 2)} | {entry.get('prefix_cache_hit_tokens', 0)} |"
        )
    return "\n".join(lines)


def render_compare_modes(data: dict[str, Any]) -> str:
    ratios = data.get("ratios", {})
    settings = data.get("settings", {})
    lines = [
        provenance(data),
        "",
        f"Draw set **{data.get('draw_set', '?')}** (seeds {', '.join(map(str, data['seeds']))}), "
        f"{settings.get('num_requests', '?')} requests per rate and draw at "
        f"{settings.get('request_rates', '?')} req/s, mix {settings.get('mix', '?')}; SLO TTFT "
        f"<= {settings.get('slo_ttft', '?')} s, TPOT <= {_ms(settings.get('slo_tpot'))} ms "
        f"(and a p99 gap <= {_ms(settings.get('slo_itl'))} ms); {data.get('minutes', '?')} "
        "minutes.",
        "",
        render_modes_tables(data["results"], data["common_rate"]),
        "",
        "| goal | pdserve's best / llama-server's best | goal |",
        "|---|---|---|",
    ]
    own = ratios.get("max_rate_pdserve_best_over_llama_server")
    lines.append(f"| highest rate >= 90 % on its own | {_x(own)} | {_goal(own, RATE_GOAL)} |")
    mono = ratios.get("max_rate_monotone_pdserve_best_over_llama_server")
    lines.append(f"| highest rate, monotone | {_x(mono)} | - |")
    goodput = ratios.get("goodput_at_common_rate_by_mode") or {}
    ours = max((v for m, v in goodput.items() if not m.startswith("llama_server") and v), default=0)
    theirs = max((v for m, v in goodput.items() if m.startswith("llama_server") and v), default=0)
    ratio = ours / theirs if ours and theirs else None
    lines.append(
        f"| goodput @ {data['common_rate']:g} req/s (within TTFT+TPOT) | {_x(ratio)} | - |"
    )
    for n, ratio in (ratios.get("closed_loop_pdserve_best_over_llama_server") or {}).items():
        goal = CLOSED_LOOP_GOALS.get(n)
        figure = _ratio_cell(ratio) if isinstance(ratio, dict) else _x(ratio)
        lines.append(f"| closed loop N = {n}, tok/s | {figure} | {_goal(ratio, goal)} |")
    lines += caveats.lines(caveats.serving(data))
    return "\n".join(lines)


def render_decode_step(data: dict[str, Any]) -> str:
    meta = data["_meta"]
    paths = [key for key in data if not key.startswith("_")]
    parts = [part for part in data[paths[0]] if part != "step"]
    lines = [
        provenance(meta),
        "",
        f"ms per decode step, {meta.get('streams')} stream(s), {meta.get('weights')}, kernels "
        f"{meta.get('kernel_isa', '?')}, {meta.get('threads')} threads; median over rounds:",
        "",
        "| path | " + " | ".join(parts) + " | step |",
        "|---" * (len(parts) + 2) + "|",
    ]
    for path in paths:
        cells = " | ".join(f"{data[path][part]:.2f}" for part in [*parts, "step"])
        lines.append(f"| {path} | {cells} |")
    return "\n".join(lines)


def render_speedup_cases(data: dict[str, Any], faster: str, slower: str, heading: str) -> str:
    """A kernel-by-kernel result (``benchmarks.harness.kernel_cases.speedup_cases``) as a table
    under ``heading``."""
    key_field = f"{faster}_speedup"
    cases = [key for key in data if isinstance(data[key], dict) and key_field in data[key]]
    lines = [
        provenance(data["_meta"]),
        "",
        f"{heading}; {faster}'s speed-up = the {slower} side's time / the {faster} side's, "
        f"median [95 % interval] over rounds, goal {data['goal']}:",
        "",
        f"| kind, [N x k], rows | {faster} µs | {slower} µs | {faster}'s speed-up | verdict |",
        "|---|---|---|---|---|",
    ]
    for name in cases:
        case = data[name]
        fast, slow = case[f"{faster}_us"]["median"], case[f"{slower}_us"]["median"]
        speedup = _ratio_cell(case[f"{faster}_speedup"])
        lines.append(f"| {name} | {fast:.1f} | {slow:.1f} | {speedup} | {case['verdict']} |")
    return "\n".join(lines)


def render_avx2_paths(data: dict[str, Any]) -> str:
    heading = f"µs per product on AVX2, {data['threads']} thread"
    return render_speedup_cases(data, "legacy", "simd", heading)


def render_int8_rows(data: dict[str, Any]) -> str:
    heading = (
        f"µs per product, {data['threads']} thread, kernels {data['isa']} (8-bit activations: "
        f"{data['int8_path']})"
    )
    return render_speedup_cases(data, "int8", "float32", heading)


def _kl(figures: dict[str, Any]) -> str:
    return f"{figures['kl_mean']:.6f} ± {figures['kl_mean_se']:.6f}"


def render_accuracy(data: dict[str, Any]) -> str:
    lines = [
        provenance(data["_meta"]),
        "",
        f"Windows of {data['ctx']} tokens of the held text, the second half of each scored: "
        "teacher-forced through decode steps, or computed whole as prompts for the `prompt_` "
        "settings; KL = KL(float32 activations, prompt matmuls and KV cache || the setting), "
        "mean ± its standard error and 99th percentile per token; top-1 = the same most likely "
        "token. Settings: `int8` decode activations, a `kv_float16` or `kv_bfloat16` cache, "
        "prompts multiplied in bfloat16 (`prompt_bfloat16`), or two of them. "
        "llama.cpp: `llama-perplexity --kl-divergence` of the file against its F32 copy, same "
        "text and windows (its default float16 KV cache on both sides). A setting passes where "
        f"its mean KL is at most llama.cpp's and its top-1 at least {data['min_top1']:.0%}:",
        "",
        "| file | setting | tokens | perplexity (float32 → setting) | KL mean | KL p99 | top-1 "
        "| llama.cpp KL mean | llama.cpp top-1 | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in data["files"].items():
        peer = entry.get("llamacpp")
        peer_kl = _kl(peer) if peer else "-"
        peer_top1 = f"{peer['top1_agreement']:.2%}" if peer else "-"
        for setting, f in entry["settings"].items():
            lines.append(
                f"| {name} | {setting} | {f['tokens']} | {f['perplexity_reference']:.3f} → "
                f"{f['perplexity']:.3f} | {_kl(f)} | {f['kl_p99']:.5f} | "
                f"{f['top1_agreement']:.2%} | {peer_kl} | {peer_top1} | "
                f"{entry['verdicts'][setting]} |"
            )
    return "\n".join(lines)


def render_kv_dtype(data: dict[str, Any]) -> str:
    sides = list(data["kv_bytes_per_token"])
    per_token = ", ".join(f"{s} {b / 1024:.1f} KiB" for s, b in data["kv_bytes_per_token"].items())
    lines = [
        provenance(data["_meta"]),
        "",
        f"{data['file']} ({data['engine']}): ms per decode step of {data['tokens']} steps, "
        f"median [min-max] over rounds; a 16-bit side's speed-up = float32's step time / its "
        f"own, median [95 % interval], goal {data['goal']}. KV bytes per token: {per_token}.",
        "",
        "| streams:context | "
        + " | ".join(f"{s} ms" for s in sides)
        + " | "
        + " | ".join(f"{s} speed-up" for s in sides[1:])
        + " |",
        "|---" * (1 + 2 * len(sides) - 1) + "|",
    ]
    for case, entry in data["cases"].items():
        times = " | ".join(_cell(entry["ms_per_step"][s], 1) for s in sides)
        speedups = " | ".join(
            f"{_ratio_cell(entry[f'{s}_speedup'], 3)} {entry[f'{s}_speedup']['verdict']}"
            for s in sides[1:]
        )
        lines.append(f"| {case} | {times} | {speedups} |")
    return "\n".join(lines)


def render_speculation(data: dict[str, Any]) -> str:
    spec = data["speculative"]
    lines = [
        provenance(data["_meta"]),
        "",
        f"{data['file']} ({data['engine']}); {data['tokens']} new tokens a stream, prompts drawn "
        f"by seed {data['seed']}; speculative `ngram` with min_match {spec['min_match']}, "
        f"max_match {spec['max_match']}, max_draft {spec['max_draft']}, max_step_rows "
        f"{spec['max_step_rows']}. Output tokens/s, median [min-max] over rounds; ratios over "
        "`off`, median [95 % interval]; acceptance = accepted / drafted tokens; tokens a check = "
        "(accepted + checks) / checks; `ngram` token-identical to `invariant` in every round:",
        "",
        "| workload:streams | off tokens/s | invariant tokens/s | ngram tokens/s | invariant / off "
        "| ngram / off | acceptance | tokens a check | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, entry in data["cases"].items():
        rates = " | ".join(_cell(entry["tokens_per_s"][side], 1) for side in SPECULATION_SIDES)
        verdict = f"{entry['goal']}: {entry['verdict']}" if "goal" in entry else "-"
        acceptance = "-" if entry["acceptance"] is None else f"{entry['acceptance']:.2f}"
        per_check = "-" if entry["tokens_per_check"] is None else f"{entry['tokens_per_check']:.2f}"
        lines.append(
            f"| {case} | {rates} | {_ratio_cell(entry['invariant_ratio'], 3)} | "
            f"{_ratio_cell(entry['speculative_ratio'], 3)} | {acceptance} | {per_check} | "
            f"{verdict} |"
        )
    return "\n".join(lines)


SPECULATION_SIDES = ("off", "invariant", "ngram")


def render_served_speculation(data: dict[str, Any]) -> str:
    """Speculation served, against llama-server's best n-gram speculation (served_speculation)."""
    tuning = data.get("tuning") or {}
    tuned = ", ".join(
        f"`{spec}` {figure['median']:.1f}" if "median" in figure else f"`{spec}` failed"
        for spec, figure in tuning.items()
    )
    chosen = (
        f"chosen on the prompts of seed {data['tuning_seed']} (grounded, one stream, tokens/s: "
        f"{tuned})"
        if tuning
        else "given"
    )
    lines = [
        provenance(data["_meta"]),
        "",
        f"{data['file']}, pdserve `{data['mode']}` with speculation off and `ngram` (defaults); "
        f"llama-server with {data['llama_threads']} threads and {data['llama_slots']} slots, "
        f"without speculation and with `{data['llama_spec']}`, {chosen}. {data['tokens']} greedy "
        f"tokens a stream on `/v1/completions`, prompts drawn by seed {data['seed']}. Output "
        "tokens/s, median [min-max] over rounds; ratios median [95 % interval]; acceptance = "
        "accepted / drafted tokens; same text: the share of a speculating server's answers "
        "that are, character for character, those of the same server without speculation:",
        "",
        "| workload:streams | pdserve off | pdserve ngram | llama off | llama ngram "
        "| pdserve ngram / off | llama ngram / off | pdserve ngram / llama ngram "
        "| acceptance pdserve, llama | same text as off pdserve, llama | verdicts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, entry in data["cases"].items():
        rates = " | ".join(
            _cell(entry["tokens_per_s"][side], 1) for side in SERVED_SPECULATION_SIDES
        )
        ratios = " | ".join(
            _ratio_cell(entry["ratios"][name], 3)
            for name in (
                "pdserve_ngram/pdserve_off",
                "llama_ngram/llama_off",
                "pdserve_ngram/llama_ngram",
            )  # fmt: skip
        )
        acceptance = ", ".join(
            "-" if entry["acceptance"][side] is None else f"{entry['acceptance'][side]:.2f}"
            for side in ("pdserve_ngram", "llama_ngram")
        )
        verdicts = "; ".join(
            f"{name}: {goal['goal']} {goal['verdict']}" for name, goal in entry["goals"].items()
        )
        same = ", ".join(
            f"{entry['same_text'][side]:.0%}" for side in ("pdserve_ngram", "llama_ngram")
        )
        lines.append(f"| {case} | {rates} | {ratios} | {acceptance} | {same} | {verdicts or '-'} |")
    return "\n".join(lines)


SERVED_SPECULATION_SIDES = ("pdserve_off", "pdserve_ngram", "llama_off", "llama_ngram")


def render_multi_turn(data: dict[str, Any]) -> str:
    """Conversations revisited after eviction, with and without KV tiers (multi_turn)."""
    lines = [
        provenance(data["_meta"]),
        "",
        f"{data['file']}; {data['conversations']} conversations, a turn each a round, "
        f"{data['answer_tokens']} answer tokens; pdserve `single_node` with a KV cache of "
        f"{data['kv_mb']} MiB and blocks of {data['block_size']} tokens; the host tier (and "
        f"llama-server's `--cache-ram`) {data['host_mb']} MiB, the disk tier {data['disk_mb']} "
        "MiB. TTFT p50 of a round's turns and the share of the reusable tokens served cached, "
        "median [min-max] over rounds; ratios median [95 % interval]:",
        "",
        "| side | TTFT p50 ms | reusable tokens cached | verdict |",
        "|---|---|---|---|",
    ]
    for side, entry in data["sides"].items():
        ttft = {k: v * 1000 for k, v in entry["ttft_p50_s"].items() if k != "rounds"}
        reuse = entry["reuse"]
        shown = (
            "-"
            if reuse is None
            else f"{reuse['median']:.0%} [{reuse['min']:.0%}-{reuse['max']:.0%}]"
        )
        lines.append(f"| {side} | {_cell(ttft, 0)} | {shown} | {entry.get('reuse_goal', '-')} |")
    lines += ["", "| TTFT ratio | median [95 % interval] | goal |", "|---|---|---|"]
    for name, ratio in data.get("ratios", {}).items():
        lines.append(f"| {name} | {_ratio_cell(ratio, 3)} | {ratio['goal']}: {ratio['verdict']} |")
    restart = data.get("restart")
    if restart:
        cached = restart["history_cached"]
        lines += [
            "",
            f"The tiered worker killed (SIGKILL) and restarted by Ray: its conversations' next "
            f"{restart['turns']} turns found {cached['min']:.0%} to {cached['max']:.0%} of their "
            f"history cached ({restart['hits']} hits; {restart['goal']}: {restart['verdict']}).",
        ]
    return "\n".join(lines)


def render_planner(data: dict[str, Any]) -> str:
    """The planner against the best fixed split in the simulator (planner_shifting_mix)."""
    model, targets = data["model"], data["targets"]
    lines = [
        provenance(data["_meta"]),
        "",
        f"Simulated workers modelled from the bundled model's engine on this CPU: a prompt token "
        f"{model['token_s'] * 1000:.2f} ms, a decode step {model['step_fixed_s'] * 1000:.1f} ms "
        f"+ {model['step_row_s'] * 1000:.2f} ms a row; a switch pauses a worker "
        f"{model['switch_s']:g} s and its first {model['cold_s']:g} s run "
        f"{model['cold_factor']:g}x slower. A round: a {data['duration_s']:.0f} s trace whose mix "
        f"shifts about every {data['phase_s']:.0f} s between prompt-heavy and output-heavy, each "
        f"phase at {data['load']:.0%} of the pool's capacity; a request is good with TTFT within "
        f"{targets['ttft_s']:g} s and mean ITL within {targets['itl_s'] * 1000:.0f} ms. The "
        f"planner decides every {data['interval_s']:g} s from an even split; the fixed split is "
        "the best on the tuning draws. Good requests, median [min-max] over the held-out rounds; "
        "planner / fixed, median [95 % interval]:",
        "",
        "| workers | best fixed split (prefill workers) | fixed: good | planner: good | "
        "planner / fixed | switches a round | constant mix: moves after settling | "
        "violations moved on within 2 intervals |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers, size in data["sizes"].items():
        ratio, react = size["ratio"], size["reaction_intervals"]
        lines.append(
            f"| {workers} | {size['best_fixed_prefill']} | {_cell(size['fixed_goodput'], 3)} | "
            f"{_cell(size['planner_goodput'], 3)} | {_ratio_cell(ratio, 2)} "
            f"({ratio['goal']}: {ratio['verdict']}) | "
            f"{min(size['switches'])}-{max(size['switches'])} | "
            f"{size['constant_load_moves_after_settling']} | "
            f"{react['within_2']} of {react['onsets']} (longest {react['max']}) |"
        )
    return "\n".join(lines)


def render_planner_live(data: dict[str, Any]) -> str:
    """The planner on live elastic workers against the best fixed split
    (planner_live_shifting_mix)."""
    model, targets, held = data["model"], data["targets"], data["held_out"]
    ratio, react = held["ratio"], held["reaction_intervals"]
    calm, idle = data["constant_load"], data["zero_traffic"]
    back = f"in {idle['seconds']:.0f} s" if idle["seconds"] is not None else "not within the wait"
    return "\n".join([
        provenance(data["_meta"]),
        "",
        f"{data['workers']} elastic workers (one thread each, sharing {data['cores']} cores "
        f"with the coordinator) of a random Llama of {model['hidden']} x {model['layers']} "
        f"layers (a prompt token {model['token_s'] * 1000:.2f} ms, a decode step "
        f"{model['step_fixed_s'] * 1000:.1f} ms + {model['step_row_s'] * 1000:.2f} ms a row at "
        f"one thread). A round: a {data['duration_s']:.0f} s trace whose mix shifts about every "
        f"{data['phase_s']:.0f} s, at {data['load']:.0%} of what {data['cores']} such worker(s) "
        f"would serve; a request is good with TTFT within {targets['ttft_ms']} ms and mean ITL "
        f"within {targets['itl_ms']} ms. The planner (`execute`) decides every "
        f"{data['interval_ms']} ms from the configured split {data['split'][0]}:"
        f"{data['split'][1]}; the fixed split is the best on the tuning draws. Good requests' "
        "share, median [min-max] over the held-out rounds; planner / fixed, median [95 % "
        "interval]:",
        "",
        "| best fixed split (prefill:decode) | fixed: good | planner: good | planner / fixed | "
        "switches (all rounds) | failed requests | violations moved on within 2 intervals |",
        "|---|---|---|---|---|---|---|",
        f"| {data['best_fixed_prefill']}:{data['workers'] - data['best_fixed_prefill']} | "
        f"{_cell(held['fixed_goodput'], 3)} | {_cell(held['planner_goodput'], 3)} | "
        f"{_ratio_cell(ratio, 2)} ({ratio['goal']}: {ratio['verdict']}) | {held['switches']} | "
        f"{held['failed_requests']} | {react['within_2']} of {react['onsets']} (longest "
        f"{react['max']}) |",
        "",
        f"One mix throughout: {calm['switches']} switches, {calm['after_first_third']} after its "
        f"first third, {calm['failed_requests']} failed requests. Idle from "
        f"{idle['from'][0]}:{idle['from'][1]}, the pool went to {idle['to'][0]}:{idle['to'][1]} "
        f"(configured {idle['configured'][0]}:{idle['configured'][1]}) {back}.",
    ])  # fmt: skip


def render_prompt_dtype(data: dict[str, Any]) -> str:
    lines = [
        provenance(data["_meta"]),
        "",
        "Milliseconds until every prompt of a burst has its first token (prompts:tokens; one "
        "step, prefix cache off), median [min-max] over rounds, with float32 and with the "
        "quantized layers' prompt GEMM in bfloat16; speed-up = float32's time / bfloat16's, "
        f"median [95 % interval], goal {data['goal']}:",
        "",
        "| file | prompts:tokens | float32 ms | bfloat16 ms | prompt tokens/s (float32 → "
        "bfloat16) | bfloat16 speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in data["files"].items():
        for case, figures in entry["cases"].items():
            rate, speedup = figures["prompt_tokens_per_s"], figures["bfloat16_speedup"]
            lines.append(
                f"| {name} | {case} | {_cell(figures['ms']['float32'], 1)} | "
                f"{_cell(figures['ms']['bfloat16'], 1)} | {rate['float32']:,.0f} → "
                f"{rate['bfloat16']:,.0f} | {_ratio_cell(speedup, 3)} {speedup['verdict']} |"
            )
    return "\n".join(lines)


def render_decode_limit(data: dict[str, Any]) -> str:
    limits, rates = data["limit_tokens_per_s"], data["gb_per_s"]
    lines = [
        provenance(data["_meta"]),
        "",
        f"{data['file']} ({data['engine']}), one stream, "
        f"{data['tokens']} new tokens, {data['threads']} threads. A decode step reads "
        f"{data['bytes_per_token'] / 1e6:,.1f} MB of weights. The machine reads "
        f"{_cell(rates['read'], 2)} GB/s (a float32 sum; median [min-max] over rounds), so no "
        f"engine decodes faster than {_cell(limits['read'], 2)} tokens/s here; it copies "
        f"{_cell(rates['copy'], 2)} GB/s (bytes read plus written), a limit of "
        f"{_cell(limits['copy'], 2)} tokens/s. Each engine's rate, and its share of each limit "
        "in the same round (median [95 % interval]):",
        "",
        "| engine | tokens/s | share of the read limit | share of the copy limit |",
        "|---|---|---|---|",
    ]
    for side, figures in data["engines"].items():
        shares = figures["share_of_limit"]
        lines.append(
            f"| {side} | {_cell(figures['tokens_per_s'], 2)} | "
            f"{_ratio_cell(shares['read'], 3)} | {_ratio_cell(shares['copy'], 3)} |"
        )
    return "\n".join(lines)


def render_soak(data: dict[str, Any]) -> str:
    config, requests = data["config"], data["requests"]
    causes = ", ".join(f"{cause} {n:,}" for cause, n in requests["by_cause"].items())
    lines = [
        provenance(data["_meta"]),
        "",
        f"{config['minutes']:.0f} minutes, {config['concurrency']} senders, seed {config['seed']}: "
        f"{requests['total']:,} requests ({causes}); "
        f"{'PASS' if data['passed'] else 'FAIL: ' + '; '.join(data['failures'])}. RSS after the "
        f"{config['warmup_s'] / 60:.0f}-minute warm-up, and the C heap's bytes in use "
        "(glibc's count, model weights mapped by malloc included) over the run:",
        "",
        "| process | RSS first → last after warm-up, MiB | slope MiB/min | C heap in use first → "
        "last, MiB | C heap slope MiB/min |",
        "|---|---|---|---|---|",
    ]
    for name, rss in data["rss"].items():
        heap = data.get("heap", {}).get(name)
        heap_cells = (
            f"{heap['in_use_first_mib']:.1f} → {heap['in_use_last_mib']:.1f} | "
            f"{heap['in_use_slope_mib_per_min']:.2f}"
            if heap
            else "- | -"
        )
        lines.append(
            f"| {name} | {rss['first_after_warmup_mib']:.1f} → {rss['last_mib']:.1f} | "
            f"{rss['slope_mib_per_min']:.2f} | {heap_cells} |"
        )
    return "\n".join(lines)


def render_http_edge(data: dict[str, Any]) -> str:
    cost, ratio, attacks = (
        data["server_cpu_us_per_event"],
        data["cpu_ratio_to_httptools"],
        data["attacks"],
    )
    lines = [
        provenance(data["meta"]),
        "",
        f"Server CPU µs per streamed event ({data['tokens_per_stream']} events a stream), median "
        "[min-max] over rounds; the ratio is each round's against plain httptools:",
        "",
        "| protocol | 1 stream | ratio | 64 streams | ratio |",
        "|---|---|---|---|---|",
    ]
    for name in cost:
        one, many = cost[name]["1"], cost[name]["64"]
        lines.append(
            f"| {name} | {_cell(one)} | {_cell(ratio[name]['1'], 3)} | {_cell(many)} "
            f"| {_cell(ratio[name]['64'], 3)} |"
        )
    lines += [
        "",
        "| protocol | 32 MiB header: answer, s, RSS MiB | 64 half-sent requests still held | "
        "probe p50 / p99 / max ms under a header attack |",
        "|---|---|---|---|",
    ]
    for name, attack in attacks.items():
        header, probe = attack["huge_header"], attack["probe_under_attack"]
        held = next(v for k, v in attack["half_sent"].items() if k.startswith("held"))
        lines.append(
            f"| {name} | {header['status']}, {header['seconds']}, {header['rss_growth_mib']} "
            f"| {held} / 64 | {probe['p50_ms']} / {probe['p99_ms']} / {probe['max_ms']} |"
        )
    return "\n".join(lines)


def render_structured(data: dict[str, Any]) -> str:
    serving, compiled = data["serving"], data["compile"]
    goals = data["goals"]["tpot_ratio_at_most"]
    lines = [
        provenance(data["meta"]),
        "",
        f"TPOT (ms) of `json_schema`-constrained against unconstrained `/v1/completions` "
        f"({data['deploy_mode']}, {serving['output_tokens']} tokens an answer; {_schema(serving)}"
        "), median [min-max] over rounds; the ratio is each round's:",
        "",
        "| streams | unconstrained | constrained | ratio | goal |",
        "|---|---|---|---|---|",
    ]
    for streams, row in serving["streams"].items():
        ratio = row["ratio"]
        verdict = _goal(ratio, goals.get(streams), at_least=False)
        lines.append(
            f"| {streams} | {_cell(row['tpot_ms_unconstrained'])} | "
            f"{_cell(row['tpot_ms_constrained'])} | {_ratio_cell(ratio, 3)} | {verdict} |"
        )
    cold = compiled["cold_ms"]
    lines += [
        "",
        f"Constrained outputs that validate: {serving['valid_share']:.0%} of "
        f"{serving['outputs']}. Compile of a 20-property schema: cold {_cell(cold, 2)} ms "
        f"(goal <= {compiled['goal_cold_ms']:g} ms: "
        f"{_bound_verdict(cold, compiled['goal_cold_ms'])}), cached "
        f"{_cell(compiled['cached_ms'], 4)} ms; the tokenizer's view, built once per process, "
        f"{compiled['tokenizer_view_s']:.2f} s.",
    ]
    return "\n".join(lines)


def _schema(serving: dict[str, Any]) -> str:
    shape = serving.get("schema")
    if shape is None:
        return "a record of one-digit integers, no free-text field"
    return (
        f"a record of {shape['text_fields']} free-text strings (<= {shape['text_chars']} "
        f"characters) and {shape['digits']} one-digit integers"
    )


def _bound_verdict(spread: dict[str, Any], bound: float) -> str:
    """An absolute figure against an upper bound, by the verdict rule over its rounds."""
    if not spread.get("rounds"):
        return "undecided (a single figure, no rounds)"
    return str(judge(spread["rounds"], Goal(bound, at_least=False)))


def render_replicas(data: dict[str, Any]) -> str:
    lines = [provenance(data["meta"]), "", *_replicas_table(data)]
    lines += ["", f"Two over one: {_replicas_goals(data)}. {_replicas_kill(data['kill'])}"]
    lines += caveats.lines(caveats.replicas(data))
    return "\n".join(lines)


def _replicas_table(data: dict[str, Any]) -> list[str]:
    """The replicas result's setup sentence and its table, one row per number of coordinators."""
    short, chat, setup = data["short_completions"], data["prefix_chat"], data["setup"]
    lines = [
        f"One coordinator against two over one pool ({setup['workers']}; {setup['model']}), "
        f"{data['draw_set']} draws {', '.join(map(str, data['seeds']))}. Short streamed "
        f"`/v1/completions` ({setup['short']['words']} words, {setup['short']['max_tokens']} "
        "tokens) at Poisson rates; the highest rate whose pooled p99 TTFT is at most "
        f"{setup['ttft_slo_s']:g} s with no failed request [each draw's own, min-max]:",
        "",
        "| coordinators | highest rate within the SLO, req/s | completed there, req/s "
        "| shared-prefix chat hit rate [per draw] |",
        "|---|---|---|---|",
    ]
    for side in ("one", "two"):
        row, hits = short[side], chat[side]
        rate = "none" if row["max_rate"] is None else f"{row['max_rate']:g}"
        done = row["completed_per_s_at_slo"]
        per = hits["hit_rate_per_draw"]
        lines.append(
            f"| {side} | {rate} {_range(row['max_rate_per_draw'])} | "
            f"{'-' if done is None else f'{done:.1f}'} | {hits['hit_rate']:.1%} "
            f"[{per['min']:.1%}-{per['max']:.1%}] |"
        )
    return lines


def _replicas_goals(data: dict[str, Any]) -> str:
    """Two coordinators over one: the throughput ratio and the hit-rate difference, judged."""
    ratio = data["throughput_ratio_two_to_one"]
    gap = data["hit_rate_difference"]
    per_draw = data.get("max_rate_ratio_per_draw")
    if per_draw:
        ratio_text = f"{_ratio_cell(per_draw)} (each draw's highest rate, paired)"
    else:
        ratio_text = f"{'-' if ratio is None else f'{ratio:.2f}x'} (pooled, no paired draws)"
    differences = data.get("hit_rate_difference_per_draw")
    if differences:
        hit_goal = judge(differences["rounds"], Goal(-0.02))
        hit_text = (
            f"hit rate {differences['median'] * 100:+.1f} points per draw (goal: at most 2 "
            f"points below: {hit_goal})"
        )
    else:
        hit_text = (
            f"hit rate {gap * 100:+.1f} points (goal: at most 2 points below: undecided, one "
            "pooled figure per side, no paired draws)"
        )
    return f"{ratio_text} the requests/s within the SLO; {hit_text}"


def _replicas_kill(kill: dict[str, Any]) -> str:
    """The sentence on SIGKILL of a coordinator under load."""
    freed = kill["freed_s"]
    runs = kill["runs"]
    return (
        f"SIGKILL of a coordinator under load ({len(runs)} times): its requests aborted on every "
        f"worker {'(none in flight)' if freed is None else _cell(freed, 2)} s after the kill "
        f"(lease {kill['lease_s']:g} s); the other's clients saw "
        f"{sum(r['survivor_failed'] for r in runs)} failed of "
        f"{sum(r['survivor_requests'] for r in runs)} requests; blocks left in use: "
        f"{sum(r['blocks_in_use_after'] for r in runs)}."
    )


def _range(spread: dict[str, Any] | None) -> str:
    return "" if spread is None else f"[{spread['min']:g}-{spread['max']:g}]"


def render_memory(data: dict[str, Any]) -> str:
    return render_memory_tables(data, provenance(data["_meta"]))


# the whole tree's PSS against llama-server's at the sizes people serve, at most (per mode)
MEMORY_AT_SIZE_GOALS = {"single_node": 1.3, "pd_separate": 1.6}


def render_memory_at_size(data: dict[str, Any]) -> str:
    """``memory.py`` on a served-size file (``--model 1b-q4_k_m``), against those goals."""
    return render_memory_tables(data, provenance(data["_meta"]), MEMORY_AT_SIZE_GOALS)


def render_served_stream(data: dict[str, Any]) -> str:
    """The served stream against the engine's step and llama-server (``served_stream.py``)."""
    return render_served_stream_tables(data, provenance(data["_meta"]))


def render_served_stream_headline(data: dict[str, Any]) -> str:
    """The served stream's goals and their verdicts (``served_stream.py``)."""
    return render_stream_goals(data, provenance(data["_meta"]))


def render_event_loop(data: dict[str, Any]) -> str:
    """The coordinator on uvloop against asyncio, in one served-stream run."""
    return render_mode_pair(data, "single_node_uvloop", "single_node", provenance(data["_meta"]))


def render_burst(data: dict[str, Any]) -> str:
    return render_burst_table(data, provenance(data["_meta"]))


def _paired_row(label: str, a: dict[str, Any], b: dict[str, Any], ratio: dict[str, Any],
                judged: str, digits: int = 2) -> str:  # fmt: skip
    """A table row of two sides' spreads, their ratio with its interval, and the verdict."""
    return (
        f"| {label} | {_cell(a, 2)} | {_cell(b, 2)} | **{ratio['median']:.{digits}f}** "
        f"[{ratio['low']:.{digits}f}-{ratio['high']:.{digits}f}] | {judged} |"
    )


def _judged(row: dict[str, Any]) -> str:
    return f"{row['verdict']['verdict']} ({row['verdict']['goal']})"


def _per_event_intro(data: dict[str, Any]) -> list[str]:
    settings = data["settings"]
    return [
        provenance(data["_meta"]),
        "",
        f"{settings['tokens']}-token requests, the best of {settings['repeat']} a side and round;"
        " µs of CPU per event, median [min-max] over rounds.",
        "",
    ]


def render_door_framing(data: dict[str, Any]) -> str:
    """Each door's CPU per streamed event with orjson and the standard library's JSON."""
    lines = _per_event_intro(data) + [
        "| door | orjson µs/event | stdlib µs/event | orjson / stdlib [95 % interval] | verdict |",
        "|---|---|---|---|---|",
    ]
    for door, row in data["doors"].items():
        lines.append(_paired_row(door, row["orjson"], row["stdlib"], row["ratio"], _judged(row)))
    return "\n".join(lines)


def render_door_costs(data: dict[str, Any]) -> str:
    """The Responses and Messages doors, and log probabilities, against the chat door's stream."""
    lines = _per_event_intro(data) + [
        "| comparison | µs/event | chat µs/event | ratio [95 % interval] | verdict |",
        "|---|---|---|---|---|",
    ]
    for name, row in data["comparisons"].items():
        ours, theirs = name.split("/")
        judged = (_judged(row) if row.get("verdict") else
                  f"no goal: +{row['added_us_per_token']:.2f} µs a token")  # fmt: skip
        lines.append(
            _paired_row(f"{ours} / {theirs}", row[ours], row[theirs], row["ratio"], judged)
        )
    return "\n".join(lines)


def render_logprobs_cost(data: dict[str, Any]) -> str:
    """A decode step with log probabilities (5 alternatives) on every row against none."""
    settings = data["settings"]
    lines = [
        provenance(data["_meta"]),
        "",
        f"The bundled model, {settings['tokens']} decode steps a side and round, "
        f"{settings['threads']} threads; ms a decode step (its time per output token), median "
        "[min-max] over rounds.",
        "",
        "| streams | with logprobs (top 5) | without | ratio [95 % interval] | verdict |",
        "|---|---|---|---|---|",
    ]
    for streams, row in data["batches"].items():
        lines.append(
            _paired_row(streams, row["logprobs"], row["none"], row["ratio"], _judged(row), 3)
        )
    return "\n".join(lines)


def render_prompt_steps(data: dict[str, Any]) -> str:
    """A burst of prompts in steps bounded by ``prompt_step_target_ms`` against one step."""
    meta = data["_meta"]
    lines = [
        provenance(meta),
        "",
        f"{meta['prompts']} prompts of {meta['prompt_tokens']} tokens at once, one thread; "
        "seconds, median [min-max] over rounds:",
        "",
        f"| | bounded steps (`prompt_step_target_ms` {meta['prompt_step_target_ms']}) | one "
        "step (`0`) | bounded / one step [95 % interval] | goal | verdict |",
        "|---|---|---|---|---|---|",
    ]
    names = {"ttft_p50_s": "TTFT p50", "burst_s": "the burst's last first token"}
    for figure, name in names.items():
        a, b = data["sides"]["bounded"][figure], data["sides"]["one_step"][figure]
        ratio = data["ratios"][figure]
        lines.append(
            f"| {name} | {_cell(a, 2)} | {_cell(b, 2)} | **{ratio['median']:.2f}** "
            f"[{ratio['low']:.2f}-{ratio['high']:.2f}] | {ratio['goal']} | {ratio['judgement']} |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f}"


def _x(ratio: float | None) -> str:
    if ratio is None:
        return "not measurable: a side holds 90 % at no rate of the sweep"
    return f"**{ratio:.2f}x**"


def result_file(block: str) -> str:
    """The result file a block renders: ``vs_llamacpp`` for ``vs_llamacpp:headline``."""
    return block.partition(":")[0]


def render_engine_headline(data: dict[str, Any]) -> str:
    """The bundled file's row per measure with a goal: the ratio, its interval and verdict."""
    meta = data["_meta"]
    lines = [
        f"*{meta.get('cpu', '?')}, {meta.get('cores', '?')} cores; commit "
        f"{meta.get('commit', '?')}, {meta.get('date', '?')}*",
        "",
        "| pdserve / llama.cpp, bundled model | median [95 % interval] | goal |",
        "|---|---|---|",
    ]
    for name, key, entry in vs_llamacpp_measures(data):
        if name in (None, "bundled") and key in ENGINE_GOALS:
            ratio = entry["ratio"]
            lines.append(f"| {key} | {_ratio_cell(ratio)} | {_goal(ratio, ENGINE_GOALS[key])} |")
    return "\n".join(lines)


def render_rerun(data: dict[str, Any]) -> str:
    """A second run of ``vs_llamacpp`` (``vs_llamacpp_rerun.json``) against the first
    (``vs_llamacpp.json``): each goal's verdict in both, side by side."""
    from benchmarks.verdicts import side_by_side  # it reads this module's goals

    first = json.loads((RESULTS / "vs_llamacpp.json").read_text())
    pairs = side_by_side(first, data)
    when = [run["_meta"].get("started", run["_meta"].get("date", "?")) for run in (first, data)]
    ratios = [
        {f"{f} {m}" if f else m: _ratio_cell(e["ratio"]) for f, m, e in vs_llamacpp_measures(run)}
        for run in (first, data)
    ]
    lines = [
        provenance(data["_meta"]),
        "",
        f"The same command, run again at {when[1]} after the run above at {when[0]}:",
        "",
        "| measure | first run: ratio, verdict | second run: ratio, verdict | same verdict |",
        "|---|---|---|---|",
    ]
    for name, a, b in pairs:
        same = "yes" if a.verdict == b.verdict else "**no**"
        lines.append(f"| {name} | {ratios[0][name]}, {a} | {ratios[1][name]}, {b} | {same} |")
    agree = sum(a.verdict == b.verdict for _, a, b in pairs)
    lines += ["", f"The verdicts agree in {agree} of {len(pairs)} measures."]
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "vs_llamacpp": render_vs_llamacpp,
    "vs_llamacpp:headline": render_engine_headline,
    "vs_llamacpp_rerun": render_rerun,
    "vs_llamacpp_1b": render_vs_llamacpp,
    "vs_llamacpp_int8": render_vs_llamacpp,
    "vs_llamacpp_sizes": render_vs_llamacpp,
    "vs_llamacpp_3b": render_vs_llamacpp,
    "engine": render_engine,
    "compare_modes": render_compare_modes,
    "decode_step": render_decode_step,
    "avx2_paths": render_avx2_paths,
    "int8_rows": render_int8_rows,
    "accuracy": render_accuracy,
    "kv_dtype": render_kv_dtype,
    "speculation": render_speculation,
    "served_speculation": render_served_speculation,
    "multi_turn": render_multi_turn,
    "planner_shifting_mix": render_planner,
    "planner_live_shifting_mix": render_planner_live,
    "prompt_dtype": render_prompt_dtype,
    "decode_limit": render_decode_limit,
    "soak": render_soak,
    "http_edge": render_http_edge,
    "structured": render_structured,
    "memory": render_memory,
    "memory_1b": render_memory_at_size,
    "memory_1b_kv16": render_memory_at_size,
    "replicas": render_replicas,
    "served_stream": render_served_stream,
    "served_stream:headline": render_served_stream_headline,
    "served_stream_event_loop": render_event_loop,
    "door_framing": render_door_framing,
    "door_costs": render_door_costs,
    "logprobs_cost": render_logprobs_cost,
    "prompt_steps": render_prompt_steps,
    "burst": render_burst,
    "burst_short_timeout": render_burst,
}


def regenerate(readme: str, results: Path = RESULTS) -> str:
    """``readme`` with every generated block rendered anew from its JSON."""

    def block(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in RENDERERS:
            raise KeyError(f"README block {name!r} has no renderer (known: {', '.join(RENDERERS)})")
        data = json.loads((results / f"{result_file(name)}.json").read_text())
        return f"{match.group(1)}{RENDERERS[name](data)}\n{match.group(4)}"

    return BLOCK.sub(block, readme)


def stale_blocks(readme: str, results: Path = RESULTS) -> list[str]:
    """The names of the blocks whose text differs from what their JSON renders."""
    fresh = {m.group(2): m.group(3) for m in BLOCK.finditer(regenerate(readme, results))}
    return [m.group(2) for m in BLOCK.finditer(readme) if fresh[m.group(2)] != m.group(3)]


# a claimed speed: a ratio, a rate, or a share faster or slower (settings such as "50 ms" or
# "8 MiB" are not matched: they are limits, not measurements)
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:×|x\b|tokens?/s|tok/s|req/s|GB/s|weights/s)"
    r"|\b\d+(?:\.\d+)?\s?% (?:faster|slower|more|less|fewer)|\btimes as (?:many|fast|much)"
)


def prose_figures(text: str) -> list[str]:
    """The lines outside generated blocks that state a speed or size figure: in a performance
    document every figure is rendered from a result file, so each of these is a finding."""
    outside = BLOCK.sub("", text)
    return [line.strip() for line in outside.splitlines() if FIGURE.search(line)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which blocks are stale")
    parser.add_argument("--document", type=Path, action="append", help="(default: all of them)")
    args = parser.parse_args(argv)
    stale = []
    for document in args.document or DOCUMENTS:
        text = document.read_text()
        if not args.check:
            document.write_text(regenerate(text))
            continue
        for name in stale_blocks(text):
            stale.append(name)
            print(f"{document}: block {name!r} differs from benchmarks/results/{name}.json")
        for line in prose_figures(text):
            stale.append(line)
            print(f"{document}: a figure outside a generated block: {line[:120]}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
