"""``prefix_cache_miss``: shared prompts miss the prefix cache."""

from __future__ import annotations

from tokenmill.telemetry.schema import DEFAULT_BLOCK_SIZE

from ..signals import Signals, prefix_block_stats, prefix_head_stats
from ._common import Evidence, Param, Rule, _confidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    hit_rate = sig.overall.get("prefix_hit_rate")
    if hit_rate is None or hit_rate >= p["hit_rate_below"]:
        return None
    stats = prefix_block_stats(sig.con, sig.since_ns, sig.until_ns, int(p["shared_blocks"]))
    if stats["prompts"] < p["min_prompts"] or stats["share"] < p["share"]:
        return _shorter_than_a_block(sig, p, hit_rate)
    # prompt hashes are per engine block (the config event has its size)
    bs = int(sig.config.get("block_size") or DEFAULT_BLOCK_SIZE)
    return Evidence(
        f"{stats['shared_tail_differs_first']} of {stats['prompts']} prompts share the "
        f"{int(p['shared_blocks'])} blocks after block {stats['block']} with another prompt but "
        f"differ in block {stats['block']} (tokens {bs * stats['block']}–"
        f"{bs * stats['block'] + bs - 1}), and the prefix-cache hit rate is {hit_rate:.0%}: "
        f"something early in the prompt (a timestamp, a request id) changes every time",
        {
            "prefix_hit_rate": hit_rate,
            "prompts_with_shared_tail": stats["shared_tail_differs_first"],
            "prompts": stats["prompts"],
            "share": stats["share"],
            "differing_block": stats["block"],
            "ttft_p50_ms": sig.overall.get("ttft_p50"),
            "prefill_p50_ms": sig.overall.get("prefill_p50"),
        },
        (sig.since_ns, sig.until_ns),
        "cached_tokens = 0 AND len(prompt_block_hashes) > ?",
        [int(p["shared_blocks"])],
        "warning",
        _confidence(stats["share"] / p["share"], p["hit_rate_below"] / max(hit_rate, 1e-3)),
    )


def _shorter_than_a_block(sig: Signals, p: dict, hit_rate: float) -> Evidence | None:
    """Prompts share a prefix, but one shorter than a KV block: the cache (whole blocks only)
    cannot reuse it, however often it repeats."""
    head = prefix_head_stats(sig.con, sig.since_ns, sig.until_ns, p["share"])
    if head["head_tokens"] is None or head["sharing"] < p["min_prompts"]:
        return None
    k, bs = int(head["head_tokens"]), int(head["block_size"])
    smaller = 1 << (k.bit_length() - 1)  # the largest power of two within the shared prefix
    return Evidence(
        f"{head['sharing']} of {head['prompts']} prompts share their first {k}+ tokens with "
        f"other prompts but not one full {bs}-token block, and the prefix-cache hit rate is "
        f"{hit_rate:.0%}: the cache reuses whole {bs}-token blocks only, so a shared prefix "
        f"shorter than one block is never reused",
        {
            "prefix_hit_rate": hit_rate,
            "prompts_sharing_short_prefix": head["sharing"],
            "prompts": head["prompts"],
            "share": head["share"],
            "shared_prefix_tokens_at_least": k,
            "block_size": bs,
            "ttft_p50_ms": sig.overall.get("ttft_p50"),
        },
        (sig.since_ns, sig.until_ns),
        "cached_tokens = 0 AND len(prompt_head_hashes) >= ?",
        [k // max(1, bs // 4)],
        "warning",
        _confidence(head["share"] / p["share"]),
        causes=(SHORT_PREFIX, *RULE.causes),
        knob=(
            f"make the shared prefix at least {bs} tokens (one block) long, or serve with "
            f"--block-size {smaller} (the cache then reuses {smaller}-token blocks)"
        ),
    )


SHORT_PREFIX = "the shared prefix is shorter than one KV block (the cache reuses whole blocks)"

RULE = Rule(
    id="prefix_cache_miss",
    own_test="prompt blocks that share their content but not their first block (structural)",
    title="shared prompts miss the prefix cache",
    symptom="prompts share a long prefix but the hit rate is low: they differ near the start",
    causes=(
        "a timestamp or id at the top of the system prompt",
        "prefix_cache_scope=tenant with the same prompt across tenants",
    ),
    checks=(
        "prompts with identical blocks 2..k but a different first block",
        "prompts sharing only a prefix shorter than one block (requests.prompt_head_hashes)",
    ),
    knob="move the changing part to the end of the prompt; --prefix-cache-scope global if tenants may share",
    params={
        "hit_rate_below": Param(0.2, "prefix-cache hit rate counted as low"),
        "shared_blocks": Param(
            4, "blocks after the first that must match (64 tokens at 16 per block)"
        ),
        "share": Param(0.5, "share of prompts with a shared tail but a different first block"),
        "min_prompts": Param(5, "prompts needed to call it a pattern"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("ttft_prefill_bound", "itl_prefill_interference"),
    evidence_signals=("prefix_hit_rate", "ttft_p99"),
)
