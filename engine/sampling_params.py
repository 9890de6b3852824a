"""SamplingParams: how to pick tokens for one request (torch-free, so it can cross the process
boundary inside :class:`~tokenmill.engine.messages.AddRequest`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this a temperature is treated as greedy: dividing logits by it would overflow
# (the same cut-off vLLM uses).
GREEDY_TEMPERATURE_EPS = 1e-5

# The largest top_k or stop token id accepted: int32's maximum. Requests cross to the engine
# core as msgpack, whose integers stop at 64 bits; int32 also covers any vocabulary.
MAX_TOKEN_INT = 2**31 - 1


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        max_tokens: output tokens at most.
        temperature: 0 = greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (0 = all).
        min_p: drop tokens below ``min_p * p_max`` (0 = off).
        seed: per-request seed: the request samples the same tokens in any batch.
        stop: strings that end the output (not included in the text).
        stop_token_ids: token ids that end the output (included in the token ids).
        ignore_eos: keep generating past the model's EOS (benchmarks).
        skip_special_tokens: leave special tokens out of the text.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOKEN_INT:
            raise ValueError(f"top_k must be in [0, {MAX_TOKEN_INT}], got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.stop, (tuple, list)) or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            raise ValueError("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, (tuple, list)) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_INT
            for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of integers in [0, {MAX_TOKEN_INT}]")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS
