"""``--speculative-config``: its fields, defaults, bounds and parser (torch-free, so the
API process and ``EngineConfig.validate`` can check it). The proposer and verifier are in
``engine/spec_decode.py``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = [
    "MAX_PROMPT_LOOKUP",
    "MAX_SPECULATIVE_TOKENS",
    "SpeculativeConfig",
    "parse_speculative_config",
]

METHODS = ("ngram",)
# verification of K drafts runs K + 1 positions through every layer; beyond ~10 the chance
# that all drafts survive is small and the chunk starts to cost like a prefill
MAX_SPECULATIVE_TOKENS = 16
# n-gram lengths are searched in the request's whole context each step; longer patterns
# than this almost never match where shorter ones did not
MAX_PROMPT_LOOKUP = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` as parsed (vLLM's field names).

    Attributes:
        method: ``"ngram"`` (prompt lookup; the only method).
        num_speculative_tokens: K, draft tokens proposed per request and step, 1..16.
        prompt_lookup_min: shortest n-gram matched, >= 1.
        prompt_lookup_max: longest n-gram matched, >= prompt_lookup_min, <= 32.
        disable_by_batch_size: no drafts in a step that starts with more running requests
            than this (None: never). Verification pays while a step is bandwidth-bound; a
            large batch makes it compute-bound, and then each draft token costs its FLOPs.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """Parse ``--speculative-config`` (a JSON object, or an already-decoded dict).

    A field set to ``null`` counts as not given (its default), as in vLLM's config.

    Returns:
        The config, or None for None (the flag not given: speculation off).

    Raises:
        ValueError: one line naming the field: an empty string, malformed JSON, not an
            object, an unknown key,
            an unknown ``method``, ``num_speculative_tokens`` outside 1..16, a lookup length
            below 1 or above 32, ``prompt_lookup_min > prompt_lookup_max``, or
            ``disable_by_batch_size`` below 1.
    """
    if text is None:
        return None
    if isinstance(text, str):
        if not text.strip():
            raise ValueError(
                "speculative_config: empty; give a JSON object such as "
                '{"method": "ngram", "num_speculative_tokens": 4}, or leave the flag out'
            )
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
    else:
        raw = text
    if not isinstance(raw, dict):
        raise ValueError(
            "speculative_config: expected a JSON object such as "
            '{"method": "ngram", "num_speculative_tokens": 4}'
        )
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f"speculative_config.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})"
        )
    if "method" not in raw:
        raise ValueError('speculative_config.method: required (the only method is "ngram")')
    if raw["method"] not in METHODS:
        raise ValueError(
            f"speculative_config.method: unknown method {raw['method']!r} (supported: ngram)"
        )
    values = {}
    for name in (
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    ):
        v = raw.get(name)
        if v is None:
            continue  # not given, or null: the default
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"speculative_config.{name}: must be an integer, got {v!r}")
        if name.startswith("prompt_lookup") and not 1 <= v <= MAX_PROMPT_LOOKUP:
            raise ValueError(
                f"speculative_config.{name}: must be in 1..{MAX_PROMPT_LOOKUP}, got {v}"
            )
        values[name] = v
    defaults = SpeculativeConfig()
    k = values.get("num_speculative_tokens", defaults.num_speculative_tokens)
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config.num_speculative_tokens: must be in 1..{MAX_SPECULATIVE_TOKENS}, "
            f"got {k}"
        )
    lo = values.get("prompt_lookup_min")
    hi = values.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo, hi = defaults.prompt_lookup_min, defaults.prompt_lookup_max
    elif lo is None:
        lo = min(defaults.prompt_lookup_min, hi)
    elif hi is None:
        hi = max(defaults.prompt_lookup_max, lo)
    if lo > hi:
        raise ValueError(
            f"speculative_config.prompt_lookup_min: {lo} is above prompt_lookup_max {hi}"
        )
    cutoff = values.get("disable_by_batch_size")
    if cutoff is not None and cutoff < 1:
        raise ValueError(f"speculative_config.disable_by_batch_size: must be >= 1, got {cutoff}")
    return SpeculativeConfig("ngram", k, lo, hi, cutoff)
