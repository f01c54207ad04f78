"""The engine's own decode step, measured in a process of its own on the cores and threads a
worker gets, asked for again and again without reloading the model.

    probe = StepProbe("bundled", {1}, prompt_tokens=164, new_tokens=32, log=path)  # 1 thread
    probe.step_ms(32)     # ms per decode step of 32 sequences
    probe.stop()

The child (``python -m benchmarks.engine.step_probe --model M --threads T --prompt-tokens P
--new-tokens K``) builds an ``LLMEngine`` as a worker does (``num_threads``,
``OMP_NUM_THREADS``; pinned by its parent to one core a thread), then reads a sequence count per
line of its input and answers ``STEP <ms>``: the mean time of the decode-only steps of that many
fresh random prompts of ``P`` tokens (never from the prefix cache), each decoding ``K`` tokens
(``ignore_eos``), timed by :class:`benchmarks.engine.decode_step.StepClock`. A served answer of
``n`` tokens after a prompt of ``p`` decodes at contexts from ``p`` to ``p + n``: a probe at
``P = p + n / 2`` steps at its mean context, in a fraction of the time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ANSWER = "STEP "
LOOP, RATE = "LOOP ", "RATE "


class StepProbe:
    """A running child engine (module docstring); ``stop`` ends it."""

    def __init__(
        self,
        model: str,
        cores: set[int],
        prompt_tokens: int,
        new_tokens: int,
        log: Path,
        spin_count: int = -1,
        loop: tuple[int, int] = (100, 128),
    ) -> None:
        """``spin_count``: the OpenMP spin count the worker has (``omp_spin_count``; -1: the
        runtime's own); ``loop``: the prompt and answer tokens of ``loop_rate``'s streams."""
        threads = len(cores)
        command = [sys.executable, "-m", "benchmarks.engine.step_probe", "--model", model]
        command += ["--threads", str(threads), "--prompt-tokens", str(prompt_tokens)]
        command += ["--new-tokens", str(new_tokens)]
        command += ["--loop-prompt-tokens", str(loop[0]), "--loop-new-tokens", str(loop[1])]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if spin_count >= 0:
            env["GOMP_SPINCOUNT"] = str(spin_count)
        self.cores, self.threads = sorted(cores), threads
        self._log = log.open("w")
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )

    def step_ms(self, sequences: int) -> float:
        """Milliseconds per decode step of ``sequences`` sequences."""
        return self._ask(f"{sequences}", ANSWER)

    def loop_rate(self, streams: int) -> float:
        """Tokens/s of ``streams`` closed-loop streams in the engine itself."""
        return self._ask(f"{LOOP}{streams}", RATE)

    def _ask(self, question: str, answer: str) -> float:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(f"{question}\n")
        self._process.stdin.flush()
        for line in self._process.stdout:
            if line.startswith(answer):
                return float(line[len(answer) :])
        raise RuntimeError(f"the step probe ended ({self._process.wait()}); see {self._log.name}")

    def stop(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


def serve(
    model: str, threads: int, prompt_tokens: int, new_tokens: int, loop: tuple[int, int]
) -> None:
    """The child's loop: a sequence count in, ``STEP <ms>`` out (``LOOP <n>`` in, ``RATE
    <tokens/s>`` out), until its input ends."""
    from benchmarks.engine.closed_loop import run_closed_loop
    from benchmarks.engine.decode_step import StepClock
    from benchmarks.engine.measures import PromptDraw
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.loader import load_model

    loaded = load_model(model)
    engine = LLMEngine(EngineConfig(model_path=model, device="cpu", num_threads=threads), loaded)
    clock = StepClock(engine)
    draw = PromptDraw(7, loaded.hf_config.vocab_size)
    clock.run(draw.prompts(1, prompt_tokens, prompt_tokens), 4)  # first-call costs, not timed
    for line in sys.stdin:
        if line.startswith(LOOP):
            rate = run_closed_loop(engine, draw, int(line[len(LOOP) :]), *loop).tokens_per_s
            print(f"{RATE}{rate:.4f}", flush=True)
            continue
        sequences = int(line)
        prompts = draw.prompts(sequences, prompt_tokens, prompt_tokens)
        print(f"{ANSWER}{clock.run(prompts, new_tokens)['step']:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=164)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--loop-prompt-tokens", type=int, default=100)
    parser.add_argument("--loop-new-tokens", type=int, default=128)
    args = parser.parse_args()
    loop = (args.loop_prompt_tokens, args.loop_new_tokens)
    serve(args.model, args.threads, args.prompt_tokens, args.new_tokens, loop)


if __name__ == "__main__":
    main()
