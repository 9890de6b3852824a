"""``prefix_cache_miss``: shared prompts miss the prefix cache."""

from __future__ import annotations

from tokenmill.telemetry.schema import DEFAULT_BLOCK_SIZE

from ..signals import Signals, prefix_block_stats
from ._common import Evidence, Param, Rule, _confidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    hit_rate = sig.overall.get("prefix_hit_rate")
    if hit_rate is None or hit_rate >= p["hit_rate_below"]:
        return None
    stats = prefix_block_stats(sig.con, sig.since_ns, sig.until_ns, int(p["shared_blocks"]))
    if stats["prompts"] < p["min_prompts"] or stats["share"] < p["share"]:
        return None
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


RULE = Rule(
    id="prefix_cache_miss",
    title="shared prompts miss the prefix cache",
    symptom="prompts share a long prefix but the hit rate is low: they differ near the start",
    causes=(
        "a timestamp or id at the top of the system prompt",
        "prefix_cache_scope=tenant with the same prompt across tenants",
    ),
    checks=("prompts with identical blocks 2..k but a different first block",),
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
    explains=("ttft_prefill_bound",),
    evidence_signals=("prefix_hit_rate", "ttft_p99"),
)
