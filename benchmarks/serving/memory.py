"""Resident memory of pdserve's whole process tree against llama-server's, on the same GGUF with
the same sequences and context (``SLOTS`` x ``CONTEXT_PER_SLOT`` tokens of KV).

    python -m benchmarks.serving.memory              # benchmarks/results/memory.json
    python -m benchmarks.serving.memory --scratch    # a trial run, outside results/

Each mode (``single_node``, ``pd_separate``) is started on its own (``harness.launch``)
with ``maxBatchSize`` ``SLOTS``, ``maxSeqLen`` ``CONTEXT_PER_SLOT`` and ``kvCacheMemoryMB`` the
KV of that many tokens (``pd_separate``'s prefill engine: ``--prefill-kv-tokens``, by default one
step's prompt tokens, through ``prefill_kv_cache_memory_mb``). Once ready it answers
``--requests`` requests (so that whatever a request builds lazily exists), settles for
``--settle-s``, and then every process of its tree is measured (``process_tree.py``: role, RSS,
PSS, USS). llama-server runs with ``--parallel SLOTS -c SLOTS*CONTEXT_PER_SLOT`` from the cache
folder (``benchmarks/llamacpp/build.py --server``), after the same requests; while it is not built
there (or the model has no GGUF), pdserve is measured alone and the result says so. A request
that fails is recorded (``failed_requests``, with its error), not raised. ``--embedding-model``
is the modes' ``embedding_model_path`` (default ``bundled``, as ``pdserve`` starts; ``""``: none).
``--model`` is ``bundled``, a file set of ``benchmarks/llamacpp/gguf_sets.py`` (``1b-q4_k_m``,
made once) or a model path; ``--kv-cache-dtype`` is the engines' ``kv_cache_dtype`` (each
budget is its tokens at that dtype's bytes).

The JSON holds each side's processes and sums and the machine (``results_meta.py``), and with
``--before FILE`` the modes of an earlier result (the run before a cut) under ``before``;
``benchmarks/report.py`` renders it into ``docs/performance/memory.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.harness.launch import free_port, start_pdserve, stop_pdserve
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.llamacpp.build import SERVER, has_tools, tools_dir
from benchmarks.llamacpp.gguf_sets import is_named, resolve_gguf
from benchmarks.llamacpp.server import LlamaServer, ServerSetting
from engine.config import KV_CACHE_DTYPES, resolve_kv_dtype
from testbed.process_tree import measure, summarize, tree_pids

SLOTS = 32
CONTEXT_PER_SLOT = 1024
MODES = ("single_node", "pd_separate")
# pd_separate's prefill engine holds a prompt until its pages are handed off: one step's worth
PREFILL_KV_TOKENS = 8192  # maxPrefillTokens
PROMPT = "Explain in a few sentences what a paged KV cache is and why it helps serving."


def kv_cache_mib(model: str, tokens: int, itemsize: int) -> int:
    """MiB of KV for ``tokens`` tokens of ``model`` at ``itemsize`` bytes a value (4: float32,
    the engine's default on CPU; 2: a 16-bit cache, llama-server's f16)."""
    from engine.model.llama import ModelShape
    from engine.model.loader import load_model

    shape = ModelShape.from_hf_config(load_model(model).hf_config)
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * itemsize
    return -(-per_token * tokens // 2**20)


def gguf_path(model: str) -> Path | None:
    """The GGUF llama-server would serve ``model`` from (None: it has none)."""
    from engine.model.loader import load_model

    return load_model(model).gguf_path


def send_requests(url: str, count: int, max_tokens: int = 32) -> dict[str, Any] | None:
    """``count`` concurrent completions through the OpenAI route, each answered in full; the
    failed ones (their count and errors), None when none failed."""

    def one(i: int) -> str | None:
        body = {"model": "m", "prompt": f"{i}. {PROMPT}", "max_tokens": max_tokens}
        try:
            httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        return None

    with concurrent.futures.ThreadPoolExecutor(max(count, 1)) as pool:
        errors = [e for e in pool.map(one, range(count)) if e is not None]
    return {"count": len(errors), "examples": sorted(set(errors))[:5]} if errors else None


def _failed(failed: dict[str, Any] | None) -> dict[str, Any]:
    return {"failed_requests": failed} if failed else {}


def measure_pdserve(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    backend = {
        "maxBatchSize": SLOTS,
        "maxSeqLen": CONTEXT_PER_SLOT,
        "maxInputTokenLen": CONTEXT_PER_SLOT - 1,
        "kvCacheMemoryMB": args.kv_mib,
        "embedding_model_path": args.embedding_model,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if mode == "pd_separate" and args.prefill_kv_tokens:
        prefill_mib = kv_cache_mib(args.model, args.prefill_kv_tokens, args.kv_itemsize)
        backend["prefill_kv_cache_memory_mb"] = prefill_mib
    process, ports = start_pdserve(mode, args.model, workdir / mode, backend)
    try:
        failed = send_requests(f"http://127.0.0.1:{ports['predict_port']}", args.requests)
        time.sleep(args.settle_s)
        return {"given": backend, **summarize(measure(tree_pids(process.pid))), **_failed(failed)}
    finally:
        stop_pdserve(process)


def measure_llama_server(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    folder = args.llama_cpp_dir or tools_dir()
    if not has_tools(folder, SERVER):
        return {"missing": f"{folder / SERVER[0]} is not built"}
    gguf = gguf_path(args.model)
    if gguf is None:
        return {"missing": f"{args.model}: no GGUF file to serve with llama-server"}
    setting = ServerSetting(slots=SLOTS)
    port = free_port()
    server = LlamaServer(
        folder, gguf, port, workdir / "llama_server.log", setting, CONTEXT_PER_SLOT
    )
    try:
        failed = send_requests(server.url, args.requests)
        time.sleep(args.settle_s)
        processes = summarize(measure(tree_pids(server.pid)))
        given = {"given": {**setting.to_dict(), "command": server.command}}
        return {**given, **processes, **_failed(failed)}
    finally:
        server.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bundled", help="bundled, a file set or a path")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--embedding-model", default="bundled", help='"": no embedding model')
    parser.add_argument(
        "--prefill-kv-tokens",
        type=int,
        default=PREFILL_KV_TOKENS,
        help="pd_separate: the prefill engine's KV in tokens (0: the decode engine's budget)",
    )
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--llama-cpp-dir", type=Path, default=None)
    parser.add_argument("--no-llama-server", action="store_true")
    add_output_arguments(parser, "memory")
    parser.add_argument(
        "--before", type=Path, default=None, help="an earlier result whose modes to show beside"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    if args.model != "bundled" and is_named(args.model):
        args.model = str(resolve_gguf(args.model))
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, torch.float32)  # the CPU model's dtype
    args.kv_itemsize = kv_dtype.itemsize
    args.kv_mib = kv_cache_mib(args.model, SLOTS * CONTEXT_PER_SLOT, args.kv_itemsize)
    result: dict[str, Any] = {
        "_meta": {
            "slots": SLOTS,
            "context": CONTEXT_PER_SLOT,
            "kv_mib": args.kv_mib,
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
            "llama_server_kv_mib": kv_cache_mib(args.model, SLOTS * CONTEXT_PER_SLOT, 2),
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for mode in args.modes.split(","):
            result[mode] = measure_pdserve(mode, args, workdir)
            print(mode, json.dumps(result[mode]["total"]), flush=True)
            result_file.write(result, complete=False)
        if not args.no_llama_server:
            result["llama_server"] = measure_llama_server(args, workdir)
            print("llama_server", json.dumps(result["llama_server"].get("total")), flush=True)
    gguf = gguf_path(args.model)
    result["_meta"]["gguf_mib"] = gguf and round(gguf.stat().st_size / 2**20, 1)
    if args.before:
        earlier = json.loads(args.before.read_text())
        result["before"] = {k: v for k, v in earlier.items() if k in ("_meta", *MODES)}
    failing = {k: v["failed_requests"] for k, v in result.items() if k in (*MODES, "llama_server")
               and isinstance(v, dict) and v.get("failed_requests")}  # fmt: skip
    if failing:
        result["failed_requests"] = failing
    print(f"results: {result_file.write(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
