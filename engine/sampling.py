"""Sampling parameters and next-token selection for one batch of logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        max_tokens: output tokens to generate at most.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p.
        top_k: keep the k most likely tokens (0 = all).
        seed: per-request RNG seed, so a request samples the same tokens in any batch.
        stop_token_ids: tokens that end the request (the model's EOS is added by the caller).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def validate(self) -> None:
        """Raises ValueError naming the first out-of-range field."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Pick one token from ``logits [vocab]`` (float32) under ``params``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop a token when the tokens before it already reach top_p
        drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
