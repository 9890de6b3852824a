"""``ttft_prefill_bound``: TTFT up because prefill is slow."""

from __future__ import annotations

import statistics

from ..signals import COMPLETED_SQL, Signals, Window, recompute_steps
from ..signals.scope import store_has
from ..stats import compare
from ._common import (
    _BASE,
    Alert,
    Evidence,
    Param,
    Rule,
    _ms,
    _ratio,
    _when,
    _window_evidence,
    _worst,
)

# the most prompts any prefill step of each of the given requests carried
_SHARED_SQL = """
WITH st AS (SELECT num_prefill_chunks AS chunks, unnest(req_ids) AS rid,
                   unnest(req_prefill) AS pf
            FROM engine_steps WHERE start_ns >= ? AND num_prefill_tokens > 0
              AND req_ids IS NOT NULL)
SELECT rid, max(chunks) FROM st WHERE pf AND rid IN (SELECT unnest(?::VARCHAR[])) GROUP BY rid
"""


def _prefilled_together(sig: Signals, request_ids: list[str]) -> float:
    """The share of the requests whose prefill shared a step with another prompt's (0 where
    the store lacks the steps' request lists): prompts let in together are prefilled together,
    each as slow as all of them."""
    if not store_has(sig.con, "engine_steps", "req_ids", "req_prefill"):
        return 0.0
    rows = sig.con.execute(_SHARED_SQL, [sig.since_ns, request_ids]).fetchall()
    return sum((n or 0) >= 2 for _, n in rows) / len(rows) if rows else 0.0


def beside_recompute(sig: Signals, request_ids: list[str]) -> float:
    """The share of the requests whose prefill (scheduled to first token) overlapped a step
    recomputing preempted requests: their prefill waited on the KV pool's recompute work (the
    chain KV pressure → preemption → recompute prefill → slow TTFT; ``signals/recompute.py``)."""
    steps = recompute_steps(sig)
    if not steps or not request_ids:
        return 0.0
    rows = sig.con.execute(
        "SELECT first_token_ns - CAST(prefill_ms * 1e6 AS BIGINT), first_token_ns FROM requests "
        "WHERE request_id IN (SELECT unnest(?::VARCHAR[])) AND first_token_ns IS NOT NULL",
        [request_ids],
    ).fetchall()
    hit = sum(any(s.start_ns < b and a < s.end_ns for s in steps) for a, b in rows if a and b)
    return hit / len(rows) if rows else 0.0


def detect(sig: Signals, p: dict) -> Evidence | None:
    base = sig.baseline.get("ttft_p99")
    base_prefill = sig.baseline.get("prefill_p99")

    def hit(w: Window) -> bool:
        r = _ratio(w.get("ttft_p99"), base)
        return (
            r is not None
            and r >= p["ttft_rise"]
            and (w.get("prefill_share_of_ttft") or 0) >= p["prefill_share"]
            and (_ratio(w.get("prefill_p99"), base_prefill) or 0) >= p["prefill_rise"]
        )

    w = _worst(sig, "ttft_p99", hit)
    if w is None:
        return None
    # one oversized prompt is an outlier (oom_low_average_memory, tenant limits), not a trend
    slow_rows = sig.con.execute(
        f"SELECT ttft_ms, arrival_ns, request_id, input_tokens - coalesce(cached_tokens, 0) "
        f"FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND {COMPLETED_SQL} AND ttft_ms >= ? AND prefill_ms >= ? * ttft_ms",
        [sig.since_ns, sig.until_ns, p["ttft_rise"] * base, p["prefill_share"]],
    ).fetchall()
    slow = len(slow_rows)
    if slow < p["min_requests"]:
        return None
    # request by request over the range (a low-rate dump has one or two a window): the slow
    # prefill-bound requests against the requests of the healthy windows
    ranges = sig.healthy_ranges or [(w.start_ns, w.end_ns) for w in sig.busy()]
    cond = " OR ".join("(arrival_ns >= ? AND arrival_ns < ?)" for _ in ranges)
    ref = sig.con.execute(
        f"SELECT ttft_ms FROM requests WHERE ({cond}) AND {COMPLETED_SQL} AND ttft_ms IS NOT NULL",
        [t for rng in ranges for t in rng],
    ).fetchall()
    # more to prefill: the slow requests' prompt tokens the cache did not serve against the
    # healthy windows' requests'. Prompts of the usual size whose prefill took longer were
    # slowed by what shared their steps (a burst of arrivals prefilled together, a batch grown
    # by overload, decodes beside them): other rules' causes, or the traffic's own clumps
    uncached = [r[3] for r in slow_rows if r[3] is not None]
    slow_new = statistics.median(uncached) if uncached else None
    (ref_new,) = sig.con.execute(
        f"SELECT median(input_tokens - coalesce(cached_tokens, 0)) FROM requests "
        f"WHERE ({cond}) AND {COMPLETED_SQL}",
        [t for rng in ranges for t in rng],
    ).fetchone()
    if (
        slow_new is not None
        and ref_new
        and slow_new < p["more_to_prefill"] * ref_new
        and _prefilled_together(sig, [r[2] for r in slow_rows]) >= 0.5
    ):
        return None
    w_ns = int(sig.window_s * 1e9)
    held = len({(r[1] - sig.start_ns) // w_ns for r in slow_rows})
    support = compare(
        [r[0] for r in slow_rows],
        [v for (v,) in ref],
        unit="requests",
        reference_name="TTFT in the dump's healthy windows",
        min_effect=p["support_effect"],
        min_n=int(p["min_requests"]),
        persistence=f"{held} of {sig.busy_windows or len(sig.windows)} busy windows",
    )
    r = _ratio(w.get("ttft_p99"), base)
    # the window's slow requests, for the chain: prefills that waited on recompute work
    in_window_slow = sig.con.execute(
        f"SELECT request_id FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
        f"AND {COMPLETED_SQL} AND ttft_ms >= ?",
        [w.start_ns, w.end_ns, p["ttft_rise"] * base],
    ).fetchall()
    hit_rate = w.get("prefix_hit_rate")
    return _window_evidence(
        f"TTFT p99 rose from {_ms(base)} to {_ms(w.get('ttft_p99'))} in {_when(w)}; "
        f"{w.get('prefill_share_of_ttft'):.0%} of it was prefill (prompt p50 "
        f"{w.get('input_p50') or 0:.0f}, p99 {w.get('input_p99') or 0:.0f} tokens; prefix-cache hit "
        f"rate {(hit_rate or 0):.0%}); {slow} requests that slow",
        {
            "ttft_p99_ms": w.get("ttft_p99"),
            "baseline_ttft_p99_ms": base,
            "prefill_p99_ms": w.get("prefill_p99"),
            "prefill_share_of_ttft": w.get("prefill_share_of_ttft"),
            "input_tokens_p50": w.get("input_p50"),
            "input_tokens_p99": w.get("input_p99"),
            "prefix_hit_rate": hit_rate,
            "slow_prefill_requests": slow,
            "slow_uncached_prompt_tokens_p50": slow_new,
            "healthy_uncached_prompt_tokens_p50": ref_new,
            "slow_prefills_beside_recompute_share": beside_recompute(
                sig, [rid for (rid,) in in_window_slow]
            ),
        },
        w,
        " AND prefill_ms > 0.5 * ttft_ms",
        r,
        p["ttft_rise"],
        (w.get("prefill_share_of_ttft") or 0) / p["prefill_share"],
        support=support,
    )


RULE = Rule(
    id="ttft_prefill_bound",
    test_metric="ttft_ms",
    title="TTFT up because prefill is slow",
    symptom="TTFT rises and prefill time, not queueing, is most of it",
    causes=(
        "longer prompts than usual (input length mix shifted)",
        "low prefix-cache hit rate for prompts that share a system prompt",
        "prefill competes with decode in the same steps (budget too small)",
    ),
    checks=(
        "input_tokens p50/p99 against the baseline windows",
        "prefix_hit_rate, and prefix_cache_miss's evidence",
        "prefill tokens per step vs max_num_batched_tokens",
    ),
    knob="--enable-prefix-caching, --max-num-batched-tokens up for prefill throughput, tenant max_prompt_tokens",
    params={
        "ttft_rise": Param(3.0, f"TTFT p99 {_BASE}"),
        "prefill_share": Param(0.5, "prefill time is the larger part of TTFT"),
        "prefill_rise": Param(2.0, f"prefill time p99 {_BASE}: prefill itself got slower"),
        "min_requests": Param(
            2,
            "requests in the range with TTFT at ttft_rise x the baseline, prefill the larger part: "
            "one oversized prompt is an outlier, not a trend",
        ),
        "more_to_prefill": Param(
            1.5,
            "the slow requests' uncached prompt tokens (median) over the healthy windows' "
            "requests': below it, with half of them prefilled in steps shared with other "
            "prompts, their prompts were the usual size and what slowed their prefill was what "
            "shared its steps (blind set: int8 chat under a Poisson burst, 150-180-token "
            "prompts prefilled together; a surge that grew the batch to 60)",
        ),
        "support_effect": Param(
            1.5,
            "the slow requests' TTFT median over the healthy windows' requests': the lower end "
            "of its 95% bootstrap interval must reach this",
        ),
    },
    detect=detect,
    healthy_baseline="needs",
    evidence_signals=("ttft_p99", "prefill_p99", "prefix_hit_rate"),
    alert=Alert(
        name="TokenmillTTFTPrefillBound",
        expr=(
            "($ttft_p99 / $ttft_p99_base >= $ttft_rise)\n"
            "and ($prefill_share_of_ttft >= $prefill_share)\n"
            "and ($prefill_p99 / $prefill_p99_base >= $prefill_rise)"
        ),
        value="TTFT p99 over its baseline",
    ),
    reads=("requests", "prefix", "completions"),
    needs={
        "requests": ("input_tokens", "cached_tokens", "prefill_ms", "request_id", "first_token_ns"),
        "engine_steps": (
            "num_prefill_tokens",
            "num_prefill_chunks",
            "req_ids",
            "req_prefill",
            "req_tokens",
        ),
    },
)
