"""``pdserve`` generation demo: the bundled model (or ``--model``) answers a chat prompt, streamed.

This is the engine on its own, in-process; the serving cluster builds on the same engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.config import CacheConfig, EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

DEFAULT_PROMPT = "What is a KV cache in LLM serving? Answer in two sentences."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--model", default="bundled", help="'bundled', a HF directory or a .gguf")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=128)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(argv)
    try:
        engine = _engine_with_request(args)
    except EngineError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    start, count, reason = time.monotonic(), 0, None
    while engine.has_work():
        for event in engine.step():
            print(event.text, end="", flush=True)
            count += event.token_id is not None
            reason = event.finish_reason or reason
    elapsed = time.monotonic() - start
    print(
        f"\n[{count} tokens in {elapsed:.2f} s, {count / elapsed:.1f} tok/s, finish: "
        f"{reason.value if reason else '-'}]",
        file=sys.stderr,
    )
    return 0


def _engine_with_request(args: argparse.Namespace) -> LLMEngine:
    """An engine of ``args``' model with the prompt queued as a chat turn."""
    config = EngineConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
        cache=CacheConfig(block_size=args.block_size),
    )
    engine = LLMEngine(config)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.temperature is not None,
        temperature=args.temperature or 1.0,
        **({"seed": args.seed} if args.seed is not None else {}),
    )
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    engine.add_request(engine.request("demo", prompt, params))
    return engine


if __name__ == "__main__":
    sys.exit(main())
