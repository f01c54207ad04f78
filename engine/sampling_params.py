"""Per-request generation settings, validated at construction."""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.constraint import Constraint
from engine.errors import ConfigError

MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
MAX_TOP_LOGPROBS = 20  # alternatives a token's log probabilities may list (OpenAI's bound)


@dataclass(frozen=True)
class SamplingParams:
    """Semantics follow transformers' logits processors, applied in its order:
    repetition_penalty, temperature, top_k, top_p, typical_p. ``constraint``: what the output
    must match (``engine/constraint.py``); its mask applies before all of them.
    ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` are OpenAI's, on the logits
    before everything else: a token's logit loses ``presence_penalty`` once it appeared in the
    output and ``frequency_penalty`` per time it did, and gains its bias (``(token_id, bias)``
    pairs, at most :data:`MAX_LOGIT_BIAS`). ``logprobs``: each output token's log probability
    is reported (``TokenEvent.logprobs``) with its ``logprobs`` most likely alternatives (0: the
    token's own only; -1: none), from the scores the sampler drew from, before temperature."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off; >= vocab size means the whole vocabulary
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = field(default_factory=lambda: secrets.randbelow(MAX_SEED) + 1)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # False: decoded without speculative drafts (engine/speculation.py; the tokens are the same)
    speculative: bool = True
    logprobs: int = -1

    def __post_init__(self) -> None:
        _require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        _require(self.temperature > 0, "temperature", "> 0", self.temperature)
        _require(self.top_k >= 0, "top_k", ">= 0", self.top_k)
        _require(0 < self.top_p <= 1, "top_p", "(0, 1]", self.top_p)
        _require(0 < self.typical_p <= 1, "typical_p", "(0, 1]", self.typical_p)
        _require(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        _require(0 <= self.seed <= MAX_SEED, "seed", f"[0, {MAX_SEED}]", self.seed)
        if isinstance(self.stop, str | list):
            object.__setattr__(
                self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            )
        _require(all(s for s in self.stop), "stop", "non-empty strings", self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, "[-2, 2]", getattr(self, name))
        _require(-1 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
                 f"[-1, {MAX_TOP_LOGPROBS}]", self.logprobs)  # fmt: skip
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        _require(
            len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<= {MAX_LOGIT_BIAS} entries", len(bias)
        )
        _require(
            all(t >= 0 and -100 <= b <= 100 for t, b in bias),
            "logit_bias",
            "token ids >= 0 with biases in [-100, 100]",
            self.logit_bias,
        )

    @property
    def penalizes(self) -> bool:
        """Whether any of the OpenAI logit adjustments applies."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible (``stop`` as a list)."""
        return {
            **asdict(self),
            "stop": list(self.stop),
            "logit_bias": [list(pair) for pair in self.logit_bias],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        constraint = Constraint.from_dict(data.get("constraint"))
        return cls(**{**data, "stop": tuple(data.get("stop", ())), "constraint": constraint})


def _require(ok: bool, name: str, valid: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {valid}, got {value!r}")
