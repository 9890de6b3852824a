"""``head_of_line_blocking``: short requests stuck behind a long prompt."""

from __future__ import annotations

import statistics

from ..signals import COMPLETED_SQL, Signals, Window, waiting_now
from ..stats import against_bound, compare
from ._common import (
    _BASE,
    Evidence,
    Param,
    Rule,
    _confidence,
    _ms,
    _ratio,
    _severity,
    _when,
    _window_evidence,
    _worst,
)

# Each completed short request with the long prompts that were ahead of it: arrived no later
# and still without their first token when it arrived (waiting for admission or prefilling).
_BLOCKED_SQL = f"""
WITH r AS (SELECT request_id, trace_id, arrival_ns, scheduled_ns, first_token_ns, end_ns,
                  ttft_ms, queue_ms, input_tokens
           FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until AND {COMPLETED_SQL}
             AND ttft_ms IS NOT NULL AND input_tokens IS NOT NULL)
SELECT s.request_id, s.trace_id, s.arrival_ns, coalesce(s.scheduled_ns, s.first_token_ns),
       s.ttft_ms, s.queue_ms,
       list(l.request_id ORDER BY l.arrival_ns) FILTER (WHERE l.request_id IS NOT NULL),
       max(l.input_tokens)
FROM r s LEFT JOIN r l
  ON l.input_tokens >= $long AND l.request_id <> s.request_id AND l.arrival_ns <= s.arrival_ns
 AND coalesce(l.first_token_ns, l.end_ns) > s.arrival_ns
WHERE s.input_tokens <= $short
GROUP BY ALL ORDER BY s.arrival_ns
"""

_KV_DURING_SQL = """
SELECT max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) FROM engine_steps
WHERE start_ns >= ? AND start_ns < ?
"""


def _per_request(sig: Signals, p: dict) -> Evidence | None:
    """The symptom request by request, for traffic too thin for windows (one client, a few
    requests a window): short requests whose TTFT was mostly queue time while a long prompt
    ahead of them waited or prefilled, against the short requests nothing long was ahead of."""
    short = int(sig.overall.get("short_prompt_tokens") or 0)
    if short <= 0:
        return None
    rows = sig.con.execute(
        _BLOCKED_SQL,
        {
            "since": sig.since_ns,
            "until": sig.until_ns,
            "short": short,
            "long": max(p["long_factor"] * short, short + 1),
        },
    ).fetchall()
    free = [r[4] for r in rows if not r[6]]
    if len(free) < 2:
        return None
    free_med = statistics.median(free)
    stuck = [
        r
        for r in rows
        if r[6]
        and (r[5] or 0) >= p["queue_share"] * r[4]
        and r[4] >= p["short_ttft_rise"] * free_med
    ]
    if not stuck:
        return None
    start, end = stuck[0][2], max(r[3] or r[2] for r in stuck)
    kv = sig.con.execute(_KV_DURING_SQL, [start, max(end, start + 1)]).fetchone()[0]
    if kv is not None and kv >= p["kv_free_below"]:
        return None
    blockers = list(dict.fromkeys(b for r in stuck for b in r[6]))
    windows = {(r[2] - sig.start_ns) // int(sig.window_s * 1e9) for r in stuck}
    support = compare(
        [r[4] for r in stuck],
        free,
        unit="requests",
        reference_name="short requests no long prompt was ahead of",
        min_effect=p["short_ttft_rise"],
        persistence=f"{len(windows)} of {sig.busy_windows or len(sig.windows)} busy windows",
        why_one="each request is its own evidence (its queue wait against its blockers)",
    )
    ttft = statistics.median(r[4] for r in stuck)
    queue_share = statistics.mean((r[5] or 0) / r[4] for r in stuck if r[4])
    return Evidence(
        f"{len(stuck)} short request(s) (≤ {short} prompt tokens) waited behind "
        f"{len(blockers)} long prompt(s) (up to {max(r[7] or 0 for r in stuck):.0f} tokens) "
        f"that were queued or prefilling ahead of them: their TTFT p50 {_ms(ttft)} against "
        f"{_ms(free_med)} for short requests nothing long was ahead of; "
        f"{queue_share:.0%} of it was queue time"
        + (f"; KV use peaked at {kv:.0%}" if kv is not None else ""),
        {
            "short_ttft_p50_ms": ttft,
            "unblocked_short_ttft_p50_ms": free_med,
            "short_prompt_tokens": short,
            "stuck_requests": len(stuck),
            "long_prompts": len(blockers),
            "blocking_request_ids": blockers[:5],
            "input_tokens_max": max(r[7] or 0 for r in stuck),
            "kv_usage_max": kv,
            "short_queue_share_of_ttft": queue_share,
        },
        (start, end),
        "request_id IN (SELECT unnest(?::VARCHAR[]))",
        [[r[0] for r in stuck]],
        _severity(ttft / free_med if free_med else None, p["short_ttft_rise"]),
        _confidence((ttft / free_med) / p["short_ttft_rise"] if free_med else None),
        support=support,
    )


# ended requests: prompt size, arrival, when they stopped holding the queue (their first token),
# TTFT, and whether nothing held them back (completed, queue time under queue_share of TTFT):
# the reference for requests that have not ended yet
_ENDED_SQL = f"""
SELECT request_id, input_tokens, arrival_ns, coalesce(first_token_ns, end_ns), ttft_ms,
       coalesce({COMPLETED_SQL} AND ttft_ms > 0 AND coalesce(queue_ms, 0) < ? * ttft_ms, false)
FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? AND input_tokens IS NOT NULL
"""


def _still_waiting(sig: Signals, p: dict) -> Evidence | None:
    """The symptom before its requests have ended (a live store, ``signals/queue_now.py``): a
    request not ended yet that waited at the head of the engine queue ``live_wait_rise`` x the
    TTFT of ended requests of its size or smaller that nothing held back, behind a prompt
    ``long_factor`` x its own queued before it and still without its first token then."""
    waiting = [x for x in waiting_now(sig) if x.prompt_tokens]
    if not waiting:
        return None
    ended = sig.con.execute(_ENDED_SQL, [p["queue_share"], sig.since_ns, sig.until_ns]).fetchall()
    unheld = [(n, ttft) for _, n, _, _, ttft, ok in ended if ok]
    if len(unheld) < 2:
        return None
    found = []  # (waiting, blockers, reference TTFT)
    for x in waiting:
        peers = [t for n, t in unheld if n <= x.prompt_tokens]
        if len(peers) < 2:
            peers = [t for _, t in unheld]
        ref = statistics.median(peers)
        if x.wait_ms < p["live_wait_rise"] * ref:
            continue
        long = p["long_factor"] * x.prompt_tokens
        ahead = [
            (y.request_id, y.prompt_tokens)
            for y in waiting
            if y.prompt_tokens >= long and y.queued_ns <= x.queued_ns
        ] + [
            (rid, n)
            for rid, n, arr, first, _, _ in ended
            if n >= long and arr <= x.queued_ns < first
        ]
        if ahead:
            found.append((x, ahead, ref))
    if not found:
        return None
    worst, blockers, free_med = max(found, key=lambda f: f[0].wait_ms)
    kv = sig.con.execute(_KV_DURING_SQL, [worst.queued_ns, worst.at_ns + 1]).fetchone()[0]
    if kv is not None and kv >= p["kv_free_below"]:
        return None
    r = worst.wait_ms / free_med
    names = ", ".join(f"{rid} ({n} tokens)" for rid, n in blockers[:3])
    return Evidence(
        f"request {worst.request_id} ({worst.prompt_tokens} prompt tokens) waited "
        f"{_ms(worst.wait_ms)} at the head of the queue behind {names}, queued before it; "
        f"ended requests of its size that nothing held back had TTFT p50 "
        f"{_ms(free_med)}; the waiting request has not ended yet"
        + (f"; KV use peaked at {kv:.0%}" if kv is not None else ""),
        {
            "longest_wait_ms": worst.wait_ms,
            "waiting_request": worst.request_id,
            "waiting_prompt_tokens": worst.prompt_tokens,
            "unheld_ttft_p50_ms": free_med,
            "blocking_request_ids": [rid for rid, _ in blockers[:5]],
            "input_tokens_max": max(n for _, n in blockers),
            "waiting_max": worst.num_waiting,
            "kv_usage_max": kv,
        },
        (worst.queued_ns, worst.at_ns),
        None,
        [],
        _severity(r, p["live_wait_rise"]),
        _confidence(r / p["live_wait_rise"]),
        support=against_bound(
            [f[0].wait_ms / f[2] for f in found],
            p["live_wait_rise"],
            unit="requests",
            reference_name=f"its wait over the TTFT p50 of ended requests of its size nothing "
            f"held back, against {p['live_wait_rise']:g} (live_wait_rise)",
            min_n=1,
            why_one="a request that waited behind a long prompt past the bound has at least "
            "that TTFT: its wait is the symptom itself",
        ),
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    ev = _per_request(sig, p) or _still_waiting(sig, p)
    if ev is not None or not sig.healthy_baseline:
        return ev  # the per-window ratios need healthy windows; requests are their own reference
    return _per_window(sig, p)


def _per_window(sig: Signals, p: dict) -> Evidence | None:
    base = sig.baseline.get("short_ttft_p99")
    short = sig.overall.get("short_prompt_tokens") or 0

    def hit(w: Window) -> bool:
        r = _ratio(w.get("short_ttft_p99"), base)
        return (
            r is not None
            and r >= p["short_ttft_rise"]
            and (w.get("long_n") or 0) >= 1
            and (w.get("kv_usage_max") or 0) < p["kv_free_below"]
            and (w.get("short_queue_share") or 0) >= p["queue_share"]
        )

    w = _worst(sig, "short_ttft_p99", hit)
    if w is None:
        return None
    r = _ratio(w.get("short_ttft_p99"), base)
    return _window_evidence(
        f"short prompts (≤ {short} tokens) waited: their TTFT p99 rose from {_ms(base)} to "
        f"{_ms(w.get('short_ttft_p99'))} in {_when(w)} behind {w.get('long_n')} long prompt(s) "
        f"(up to {w.get('input_max') or 0:.0f} tokens) while KV use peaked at "
        f"{(w.get('kv_usage_max') or 0):.0%}; {w.get('short_queue_share') or 0:.0%} of their TTFT "
        f"was queue time",
        {
            "short_ttft_p99_ms": w.get("short_ttft_p99"),
            "baseline_short_ttft_p99_ms": base,
            "short_prompt_tokens": short,
            "long_prompts": w.get("long_n"),
            "input_tokens_max": w.get("input_max"),
            "kv_usage_max": w.get("kv_usage_max"),
            "short_queue_share_of_ttft": w.get("short_queue_share"),
            "waiting_max": w.get("waiting_max"),
        },
        w,
        f" AND input_tokens <= {int(short)} AND queue_ms > 0.5 * ttft_ms",
        r,
        p["short_ttft_rise"],
    )


RULE = Rule(
    id="head_of_line_blocking",
    test_metric="ttft_ms",
    title="short requests stuck behind a long prompt",
    symptom="short prompts' TTFT jumps while a long prompt is admitted or prefilled, with KV free",
    causes=(
        "strict FCFS admission stops at a long prompt that does not fit yet",
        "a long prefill takes whole steps (no chunking or a large chunk)",
    ),
    checks=(
        "queue time of the short requests (admission) vs their prefill time (steps)",
        "prefill tokens per step while the short requests waited",
    ),
    knob="--long-prefill-token-threshold (cap one request's chunk), --max-num-batched-tokens down, --scheduling-policy priority",
    params={
        "short_ttft_rise": Param(5.0, f"short-prompt TTFT p99 {_BASE} (symptom case C01)"),
        "live_wait_rise": Param(
            3.0,
            "a request still waiting, behind a long prompt queued before it and without its "
            "first token: its wait so far over the TTFT p50 of ended requests of its size that "
            "nothing held back. Lower than short_ttft_rise because the long prompt ahead is "
            "seen, not inferred (tune split: strict admission's 90-token requests had waited "
            "4.9x two windows in, and were named a window later at 5x)",
        ),
        "kv_free_below": Param(0.95, "KV not full: the wait is not memory pressure"),
        # in the queue, not in slow steps: a slowed engine (a busy host, a bigger batch) stretches
        # prefill and ITL too, and a batch of twenty short prompts let in at once decodes at a
        # fraction of the pace of the two streams before it, so ITL cannot tell the two apart
        "queue_share": Param(
            0.5, "mean share of the short prompts' TTFT spent waiting for admission"
        ),
        "long_factor": Param(
            4.0,
            "a long prompt has at least this many times the dump's median prompt tokens "
            "(the same cut the per-window long-prompt count uses)",
        ),
    },
    detect=detect,
    healthy_baseline="either",
    # the long prompts that block the queue are the prefills that stall the running decodes
    # (and the short requests it held back, let in together, make one big decode batch); while
    # the head blocks admission arrivals outpace completions: a backlog it builds, not overload
    explains=(
        "ttft_queueing",
        "overload",
        "ttft_prefill_bound",
        "itl_prefill_interference",
        "batch_too_large",
    ),
    evidence_signals=("short_ttft_p99", "input_max", "waiting_max"),
    reads=("requests", "completions", "steps", "kv"),
    needs={"requests": ("request_id", "scheduled_ns", "first_token_ns")},
)
