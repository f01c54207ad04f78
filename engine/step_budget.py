"""How many prompt tokens a step may carry, so that running streams keep their pace.

A step computes every running request's next token plus some prompt tokens (chunked prefill). A
big chunk stalls every stream for its whole length: a 1,000-token prompt on one CPU core holds
all running requests for seconds. With ``stepTargetMs`` set, a step that decodes running
requests carries only as many prompt tokens as fit in that time.

A step with nothing to decode (every step of a prefill worker; a burst of prompts reaching an
idle worker) is bounded the same way by ``prompt_step_target_ms``: in one step of 32 prompts,
every prompt has its first token when the last is computed, so a burst computed as one step gives
all of them the burst's whole time; in steps of what fits the target, in the waiting queue's
order, the first prompts have theirs a step or two in, and a prompt of a better priority or of
another client (the queue's round-robin) arriving meanwhile waits for one step, not the rest of
the burst. Such a step carries at least ``MIN_PROMPT_STEP_TOKENS`` (fewer rows leave the matrix
units idle, which costs the burst time) and at most ``maxPrefillTokens``.

The fit comes from the engine's own steps, one cost model per engine, updated after every step
by exponential averaging: a step of ``d`` decode rows and ``p`` prompt tokens takes about
``decode_s + p * token_s`` seconds, where ``decode_s`` is learnt from steps without prompt
tokens and ``token_s`` from the rest (their time beyond ``decode_s``, per prompt token). At least
``MIN_CHUNK_TOKENS`` go in each step, so a prompt always progresses.
"""

from __future__ import annotations

SMOOTHING = 0.2  # weight of the newest step in the averages
MIN_CHUNK_TOKENS = 16
MIN_PROMPT_STEP_TOKENS = 512
PRIOR_DECODE_S = 0.02  # before any step was seen: a decode step of a small model on a CPU core
PRIOR_TOKEN_S = 0.003  # and a prompt token
MIN_TOKEN_S = 1e-6  # a floor for the learnt cost of a prompt token


class StepBudget:
    def __init__(self, target_ms: int, max_tokens: int, prompt_target_ms: int = 0) -> None:
        """``target_ms``: the target duration of a step that decodes (0: no target);
        ``max_tokens``: ``maxPrefillTokens``; ``prompt_target_ms``: that of a step with nothing
        to decode (0: no target)."""
        self.target_s = target_ms / 1000
        self.prompt_target_s = prompt_target_ms / 1000
        self.max_tokens = max_tokens
        self.decode_s = PRIOR_DECODE_S
        self.decode_rows = 0.0  # the rows of the steps decode_s averages, averaged alike
        self.token_s = PRIOR_TOKEN_S  # the learnt cost of a prompt token
        self.num_steps = 0  # steps learnt from: a worker's first ones run cold

    def tokens(self, num_decodes: int) -> int:
        """Prompt tokens the next step may carry beside ``num_decodes`` decode rows."""
        if not num_decodes:
            if not self.prompt_target_s:
                return self.max_tokens
            fit = int(self.prompt_target_s / self.token_s)
            return min(max(MIN_PROMPT_STEP_TOKENS, fit), self.max_tokens)
        if not self.target_s:
            return self.max_tokens
        fit = int((self.target_s - self.decode_s) / self.token_s)
        return max(MIN_CHUNK_TOKENS, min(fit, self.max_tokens))

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from a step that took ``seconds``."""
        self.num_steps += 1
        if num_prompt_tokens == 0:
            if num_decodes:
                self.decode_s += SMOOTHING * (seconds - self.decode_s)
                self.decode_rows += SMOOTHING * (num_decodes - self.decode_rows)
            return
        base = self.decode_s if num_decodes else 0.0
        per_token = max(seconds - base, 0.0) / num_prompt_tokens
        learnt = self.token_s + SMOOTHING * (per_token - self.token_s)
        self.token_s = max(learnt, MIN_TOKEN_S)
