"""The accuracy gate: how far each engine setting moves the model's next-token distributions
from the exact path, beside what llama.cpp's own arithmetic moves them on the same file.

    python -m benchmarks.engine.accuracy                       # -> benchmarks/results/accuracy.json
    python -m benchmarks.engine.accuracy --gguf bundled --gguf bundled-q8_0 --no-peer --scratch

The text is ``benchmarks/engine/data/accuracy_text.txt`` (held here: nothing is downloaded),
tokenized once and cut into windows of ``--ctx`` tokens, as ``llama-perplexity`` cuts its chunks.
Each window is fed to the engine token by token through the decode path (teacher forcing: the
step's logits are recorded, then the text's next token is forced as the sampled one), four windows
a step (``ROWS_PER_STEP``: steps that 8-bit activations take on every kind), so a setting that
changes decode rows, such as ``activation_dtype: int8``, or what decode reads, such as a 16-bit
``kv_cache_dtype`` (every token after a window's first is read back from the cache), is what the
figures measure. The reference is the same file on float32 activations and a float32 KV cache
(``SETTINGS`` names each setting's configuration). Scored are the second half of each
window's positions (as ``llama-perplexity`` scores them): per setting the perplexity, the mean and
99th percentile of KL(reference || setting), and top-1 agreement (the same most likely token).

The peer figure: ``llama-perplexity --kl-divergence`` of the file against llama.cpp's own run of
its F32 copy (``llama-quantize`` to F32: the same weights, dequantized), on the same text, window
and thread count, with llama.cpp's default float16 KV cache on both sides. A setting may be a
default where its KL is at most llama.cpp's on the same file and its top-1 agreement at least
``MIN_TOP1``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.accuracy_peer import llamacpp_kl
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.llamacpp.gguf_sets import resolve_gguf
from engine.config import EngineConfig
from engine.kernels import set_activation_dtype
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

TEXT = Path(__file__).parent / "data" / "accuracy_text.txt"
DEFAULT_FILES = ("bundled", "bundled-q4_k_m", "bundled-q8_0")
# each setting's engine configuration, measured against the float32 reference
REFERENCE = {
    "activation_dtype": "float32",
    "kv_cache_dtype": "float32",
    "prompt_matmul_dtype": "float32",
}
# settings of what decode steps compute, scored by teacher-forced decode
SETTINGS: dict[str, dict[str, str]] = {
    "int8": {"activation_dtype": "int8"},
    "kv_float16": {"kv_cache_dtype": "float16"},
    "kv_bfloat16": {"kv_cache_dtype": "bfloat16"},
    "int8_kv_float16": {"activation_dtype": "int8", "kv_cache_dtype": "float16"},
}
# settings of what prompt steps compute, scored on whole windows computed as prompts
PROMPT_SETTINGS: dict[str, dict[str, str]] = {
    "prompt_bfloat16": {"prompt_matmul_dtype": "bfloat16"},
    "prompt_bfloat16_kv_float16": {"prompt_matmul_dtype": "bfloat16", "kv_cache_dtype": "float16"},
}
MIN_TOP1 = 0.98
# windows decoded together: every decode step within the rows 8-bit activations take on every
# kind (``int8_max_rows``: 4 on the 32-weight kinds, 8 on the K kinds)
ROWS_PER_STEP = 4


def windows_of(token_ids: list[int], ctx: int, count: int | None = None) -> list[list[int]]:
    """The text's whole windows of ``ctx`` tokens (at most ``count``)."""
    found = [token_ids[i : i + ctx] for i in range(0, len(token_ids) - ctx + 1, ctx)]
    return found if count is None else found[:count]


def forced_logits(
    engine: LLMEngine, windows: list[list[int]], batch: int = ROWS_PER_STEP
) -> list[torch.Tensor]:
    """Per window ``[ctx - 1, vocab]``: the logits after each of its first ``ctx - 1`` tokens,
    the window's first token its prompt and each next one forced, step by step, ``batch``
    windows at a time."""
    seen: dict[str, list[torch.Tensor]] = {f"w{i}": [] for i in range(len(windows))}
    run = engine.runner.run

    def forcing_run(scheduled: Any, *hooks: Any) -> tuple[torch.Tensor, list]:
        logits, samplers = run(scheduled, *hooks)
        forced = torch.full_like(logits, -math.inf)
        for row, request in enumerate(samplers):
            recorded = seen[request.request_id]
            recorded.append(logits[row].to(torch.float64, copy=True))
            window = windows[int(request.request_id[1:])]
            forced[row, window[len(recorded)]] = 0.0
        return forced, samplers

    engine.runner.run = forcing_run  # type: ignore[method-assign]
    try:
        for first in range(0, len(windows), batch):
            for i in range(first, min(first + batch, len(windows))):
                window = windows[i]
                params = SamplingParams(max_new_tokens=len(window) - 1, ignore_eos=True)
                engine.add_request(engine.request(f"w{i}", window[:1], params))
            while engine.has_work():
                engine.step()
    finally:
        engine.runner.run = run  # type: ignore[method-assign]
    return [torch.stack(seen[f"w{i}"]) for i in range(len(windows))]


def prompt_logits(
    engine: LLMEngine, windows: list[list[int]], batch: int = ROWS_PER_STEP
) -> list[torch.Tensor]:
    """Per window ``[ctx - 1, vocab]``: the logits of its first ``ctx - 1`` positions, the
    window computed as one prompt (in the chunks the scheduler gives it), ``batch`` windows at a
    time, so every row goes through what prompt steps compute (the tiled GEMM path beyond
    ``quantized.NATIVE_MAX_ROWS`` rows)."""
    seen: dict[str, list[torch.Tensor]] = {f"w{i}": [] for i in range(len(windows))}
    runner = engine.runner

    def every_row_run(scheduled: Any, before_forward: Any = None) -> tuple[torch.Tensor, list]:
        forward_batch, samplers = runner.prepare(scheduled)
        sampling_rows = forward_batch.logits_indices
        forward_batch.logits_indices = torch.arange(forward_batch.input_ids.shape[0])
        if before_forward is not None:
            before_forward(samplers)
        logits = runner.forward(forward_batch)
        for seq, (request, _) in zip(forward_batch.prefill_seqs, scheduled.prefills, strict=True):
            rows = logits[seq.query_start : seq.query_start + seq.query_len]
            seen[request.request_id].append(rows.to(torch.float64, copy=True))
        return logits[sampling_rows], samplers

    runner.run = every_row_run  # type: ignore[method-assign]
    try:
        for first in range(0, len(windows), batch):
            for i in range(first, min(first + batch, len(windows))):
                params = SamplingParams(max_new_tokens=1, ignore_eos=True)
                engine.add_request(engine.request(f"w{i}", windows[i], params))
            while engine.has_work():
                engine.step()
    finally:
        del runner.run  # the class's own again
    return [torch.cat(seen[f"w{i}"])[: len(windows[i]) - 1] for i in range(len(windows))]


def scored(
    logits: list[torch.Tensor], windows: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scored rows' log-probabilities ``[n, vocab]`` and the tokens they predict ``[n]``:
    positions ``ctx // 2`` to ``ctx - 2`` of each window."""
    rows, targets = [], []
    for window_logits, window in zip(logits, windows, strict=True):
        first = len(window) // 2
        rows.append(torch.log_softmax(window_logits[first:], dim=-1))
        targets.append(torch.tensor(window[first + 1 :]))
    return torch.cat(rows), torch.cat(targets)


def perplexity(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(-logprobs.gather(1, targets[:, None]).mean().item())


def divergence(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict:
    """KL(reference || other) per scored token (mean with its standard error, 99th percentile,
    max), top-1 agreement and both perplexities, from log-probabilities."""
    kl = (reference.exp() * (reference - other)).sum(-1).clamp(min=0)
    return {
        "tokens": int(kl.numel()),
        "kl_mean": round(kl.mean().item(), 6),
        "kl_mean_se": round(kl.std().item() / math.sqrt(kl.numel()), 6),
        "kl_p99": round(torch.quantile(kl, 0.99).item(), 6),
        "kl_max": round(kl.max().item(), 6),
        "top1_agreement": round(
            (reference.argmax(-1) == other.argmax(-1)).double().mean().item(), 5
        ),
        "perplexity_reference": round(perplexity(reference, targets), 4),
        "perplexity": round(perplexity(other, targets), 4),
    }


def measure_file(name: str, args: argparse.Namespace) -> dict[str, Any]:
    path = resolve_gguf(name)
    loaded = load_model("bundled" if name == "bundled" else str(path))

    def engine_for(setting: dict[str, str]) -> LLMEngine:
        config = EngineConfig(device="cpu", **{**REFERENCE, **setting})
        return LLMEngine(config, loaded)  # also sets this process's activation dtype

    engine = engine_for({})
    ids = engine.tokenizer.encode(TEXT.read_text())
    windows = windows_of(ids, args.ctx, args.windows)
    if not windows:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than one window of {args.ctx}")
    reference, targets = scored(forced_logits(engine, windows), windows)
    prompt_reference, _ = scored(prompt_logits(engine, windows), windows)
    del engine
    entry: dict[str, Any] = {
        "file": path.name,
        "text_tokens": len(ids),
        "windows": len(windows),
        "settings": {},
    }
    scorings = [
        (SETTINGS, forced_logits, reference),
        (PROMPT_SETTINGS, prompt_logits, prompt_reference),
    ]
    try:
        for settings, logits_of, baseline in scorings:
            for setting, overrides in settings.items():
                engine = engine_for(overrides)
                logprobs, _ = scored(logits_of(engine, windows), windows)
                runs = {
                    "activations": engine.activation_dtype,
                    "kv_cache": str(engine.kv_dtype),
                    "prompts": engine.prompt_matmul_dtype,
                }
                del engine
                figures = divergence(baseline, logprobs, targets)
                entry["settings"][setting] = {"runs": runs, **figures}
                print(f"{name} {setting}: {figures}", flush=True)
    finally:
        set_activation_dtype("float32")
    if not args.no_peer:
        entry["llamacpp"] = llamacpp_kl(path, TEXT, args.ctx, len(windows), args.threads)
        print(f"{name} llama.cpp: {entry['llamacpp']}", flush=True)
    entry["verdicts"] = verdicts(entry)
    return entry


def verdicts(entry: dict[str, Any]) -> dict[str, str]:
    """Per setting: ``passes`` (KL no more than llama.cpp's on the file, top-1 ≥ ``MIN_TOP1``),
    ``fails``, or ``undecided`` without a peer figure."""
    peer = entry.get("llamacpp")
    found = {}
    for setting, figures in entry["settings"].items():
        if figures["top1_agreement"] < MIN_TOP1:
            found[setting] = "fails"
        elif peer is None:
            found[setting] = "undecided"
        else:
            found[setting] = "passes" if figures["kl_mean"] <= peer["kl_mean"] else "fails"
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "accuracy")
    parser.add_argument("--gguf", action="append", help=f"a file set (default: {DEFAULT_FILES})")
    parser.add_argument("--ctx", type=int, default=128, help="tokens per window")
    parser.add_argument("--windows", type=int, help="windows scored (default: all the text has)")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity's threads")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp's figure")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    files = {}
    for name in args.gguf or DEFAULT_FILES:
        files[name] = measure_file(name, args)
        result_file.write({"ctx": args.ctx, "min_top1": MIN_TOP1, "files": files}, complete=False)
    result_file.write({"ctx": args.ctx, "min_top1": MIN_TOP1, "files": files})


if __name__ == "__main__":
    main()
