"""``prefix_cache_miss``: shared prompts miss the prefix cache."""

from __future__ import annotations

from ..signals import Signals, prefix_block_stats, prefix_head_stats
from ..stats import Support, judge
from ._common import Evidence, Param, Rule, _confidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    hit_rate = sig.overall.get("prefix_hit_rate")
    if hit_rate is None:
        return None
    stats = prefix_block_stats(sig.con, sig.since_ns, sig.until_ns, int(p["shared_blocks"]))
    # the prompts that share a tail but differ early miss by construction: judged on their own
    # hit rate where they are enough prompts, whatever other prompts (another tenant's, with a
    # stable system prompt) the cache serves beside them
    group = stats["hit_rate"]
    on_their_own = (
        stats["shared_tail_differs_first"] >= p["min_tail_prompts"]
        and group is not None
        and group < p["hit_rate_below"]
    )
    if not on_their_own and hit_rate >= p["hit_rate_below"]:
        return None
    if not on_their_own and (
        stats["prompts"] < p["min_tail_prompts"] or stats["share"] < p["share"]
    ):
        return _recomputed_repeats(sig, p, hit_rate) or _shorter_than_a_block(sig, p, hit_rate)
    # prompt hashes are per engine block (the config event has its size)
    bs = sig.config.block_size
    return Evidence(
        f"{stats['shared_tail_differs_first']} of {stats['prompts']} prompts share the "
        f"{int(p['shared_blocks'])} blocks after block {stats['block']} with another prompt but "
        f"differ in block {stats['block']} (tokens {bs * stats['block']}–"
        f"{bs * stats['block'] + bs - 1}), and the prefix-cache hit rate is {hit_rate:.0%}"
        + (f" ({group:.0%} on those prompts)" if group is not None else "")
        + ": something early in the prompt (a timestamp, a request id) changes every time",
        {
            "prefix_hit_rate": hit_rate,
            "differing_prompts_hit_rate": group,
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
        _confidence(
            max(stats["share"] / p["share"], 1.0 if on_their_own else 0.0),
            p["hit_rate_below"] / max(min(hit_rate, 1.0 if group is None else group), 1e-3),
        ),
    )


# Each prompt against the latest earlier prompt with the same first k blocks: how many leading
# blocks the two share (prompt_block_hashes are per-block content hashes) and how many tokens
# the cache served. A chat's next turn repeats the whole conversation so far.
_REPEATS_SQL = """
WITH r AS (
    SELECT request_id, arrival_ns, prompt_block_hashes AS h, coalesce(cached_tokens, 0) AS cached,
           input_tokens, ttft_ms, prefill_ms,
           lag(prompt_block_hashes) OVER (PARTITION BY prompt_block_hashes[1:$k]
                                          ORDER BY arrival_ns) AS prev
    FROM requests
    WHERE arrival_ns >= $since AND arrival_ns < $until AND len(prompt_block_hashes) >= $k),
m AS (SELECT *, least(len(h), len(prev)) AS n FROM r WHERE prev IS NOT NULL)
SELECT request_id, coalesce(list_position(list_transform(range(1, n + 1), lambda i: h[i] = prev[i]),
                                          false) - 1, n) AS shared_blocks,
       cached, input_tokens, ttft_ms, prefill_ms
FROM m
"""


def _recomputed_repeats(sig: Signals, p: dict, hit_rate: float) -> Evidence | None:
    """Prompts that repeat an earlier prompt's leading blocks (a chat's history, a shared
    document) and were computed again: with the prefix cache off, or its blocks evicted before
    the repeat arrived. Request by request, so it holds for one slow chat as for many."""
    bs = sig.config.block_size
    k = int(p["shared_blocks"])
    rows = sig.con.execute(
        _REPEATS_SQL, {"since": sig.since_ns, "until": sig.until_ns, "k": k}
    ).fetchall()
    missed = [r for r in rows if r[1] >= k and (r[1] * bs - r[2]) >= k * bs]
    if len(missed) < p["min_repeats"]:
        return None
    recomputed = sum(r[1] * bs - r[2] for r in missed)
    total = sig.con.execute(
        "SELECT sum(input_tokens) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?",
        [sig.since_ns, sig.until_ns],
    ).fetchone()[0]
    share = recomputed / total if total else 0.0
    if share < p["recomputed_share"]:
        return None
    caching = sig.config.enable_prefix_caching
    off = caching is False
    prefill_share = sum(r[5] or 0 for r in missed) / max(1e-9, sum(r[4] or 0 for r in missed))
    support = Support(
        n=len(missed),
        unit="requests",
        reference="the earlier prompt each one repeats (its leading blocks, computed again)",
        why_one="each repeat is its own evidence: blocks an earlier prompt computed, computed again",
    )
    judge(support, min_n=int(p["min_repeats"]), min_effect=0.0)
    return Evidence(
        f"{len(missed)} prompts repeated at least {k} leading blocks of an earlier prompt "
        f"(a conversation's history, a shared document) and had them computed again: "
        f"{recomputed:,} prompt tokens recomputed, {share:.0%} of all prompt tokens; "
        f"prefill was {prefill_share:.0%} of their TTFT; prefix-cache hit rate {hit_rate:.0%}"
        + ("; prefix caching is off" if off else ""),
        {
            "prefix_hit_rate": hit_rate,
            "repeating_prompts": len(missed),
            "recomputed_tokens": recomputed,
            "recomputed_share_of_prompt_tokens": share,
            "prefill_share_of_ttft": prefill_share,
            "enable_prefix_caching": caching,
            "ttft_p50_ms": sig.overall.get("ttft_p50"),
        },
        (sig.since_ns, sig.until_ns),
        "request_id IN (SELECT unnest(?::VARCHAR[]))",
        [[r[0] for r in missed]],
        "warning",
        _confidence(share / p["recomputed_share"], len(missed) / p["min_repeats"]),
        causes=(CACHING_OFF, *RULE.causes) if off else (EVICTED, *RULE.causes),
        knob="--enable-prefix-caching"
        if off
        else (
            "a larger KV pool (--kv-cache-memory, --num-gpu-blocks-override) so repeated "
            "prefixes stay cached; --prefix-cache-scope global if tenants share them"
        ),
        support=support,
    )


CACHING_OFF = "prefix caching is off (--no-enable-prefix-caching): every repeat is recomputed"
EVICTED = "the repeated blocks were evicted before the repeat arrived (a KV pool too small)"


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
    own_test="prompt blocks that share their content but not their first block, or repeat an "
    "earlier prompt's and were computed again (structural, prompt by prompt)",
    title="shared prompts miss the prefix cache",
    symptom="prompts share a long prefix but the hit rate is low: they differ near the start, "
    "or a repeated prefix (a chat's history) is computed again",
    causes=(
        "a timestamp or id at the top of the system prompt",
        "prefix_cache_scope=tenant with the same prompt across tenants",
    ),
    checks=(
        "prompts with identical blocks 2..k but a different first block",
        "prompts sharing only a prefix shorter than one block (requests.prompt_head_hashes)",
        "prompts repeating an earlier prompt's leading blocks with cached_tokens below them, "
        "and enable_prefix_caching in the config event",
    ),
    knob="move the changing part to the end of the prompt; --prefix-cache-scope global if tenants may share",
    params={
        "hit_rate_below": Param(0.2, "prefix-cache hit rate counted as low"),
        "shared_blocks": Param(
            4, "blocks after the first that must match (64 tokens at 16 per block)"
        ),
        "share": Param(0.5, "share of prompts with a shared tail but a different first block"),
        "min_prompts": Param(5, "prompts needed to call a short shared head a pattern"),
        "min_tail_prompts": Param(
            3,
            "prompts needed when they share whole blocks after a differing first one: two "
            "prompts agreeing on 64+ tokens yet differing before them is structure, not "
            "chance (5 took 3-4 windows to gather at one or two clients)",
        ),
        "min_repeats": Param(
            2, "prompts that repeat an earlier prompt's leading blocks, computed again"
        ),
        "recomputed_share": Param(
            0.2,
            "repeated blocks computed again, share of all prompt tokens: below it the waste "
            "is too small to tune for (tune split: uncached multi-turn chats 0.36-0.39 over "
            "the whole run and 0.298 when their first two repeats had ended, which 0.3 "
            "missed; no repeat computed again in any run of another family)",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    # prefill the cache should have served is work: the queue it builds and the prefill steps
    # it stalls decodes with are its consequences
    explains=("ttft_prefill_bound", "itl_prefill_interference", "overload"),
    evidence_signals=("prefix_hit_rate", "ttft_p99"),
    reads=("requests", "prefix"),
    needs={"requests": ("prompt_block_hashes", "prompt_head_hashes", "cached_tokens")},
)
