"""``ttft_queueing``: TTFT up, ITL flat: requests wait in the queue."""

from __future__ import annotations

from ..signals import COMPLETED_SQL, Signals, Window, waiting_now
from ..stats import Support, against_bound, compare
from ._common import (
    _BASE,
    Alert,
    Evidence,
    Param,
    Rule,
    _confidence,
    _in_window,
    _ms,
    _ratio,
    _severity,
    _when,
    _window_evidence,
    _worst,
)
from .head_of_line_blocking import RULE as HOL
from .overload import _errors_are_overloads


def _causes(sig: Signals, w: Window, p: dict) -> tuple[tuple[str, ...], dict]:
    """The causes in the order the window supports them (those its numbers show first, then
    the rest in the rule's order), and those numbers: arrivals ``arrival_excess`` times the
    completions in the window,
    the running batch against ``max_num_seqs`` (config event) or the KV pool near full, the
    busiest tenant's share of the arrivals."""
    tenants = sig.con.execute(
        "SELECT coalesce(tenant, '?'), count(*) FROM requests WHERE arrival_ns >= ? "
        "AND arrival_ns < ? GROUP BY 1 ORDER BY 2 DESC, 1",
        [w.start_ns, w.end_ns],
    ).fetchall()
    total = sum(n for _, n in tenants)
    top_tenant, top_n = tenants[0] if tenants else (None, 0)
    cap = sig.config.max_num_seqs
    numbers = {
        "arrivals": w.get("arrivals") or 0,
        "completions": w.get("completions") or 0,
        "max_num_seqs": cap,
        "kv_usage_max": w.get("kv_usage_max"),
        "top_tenant": top_tenant,
        "top_tenant_share": top_n / total if total else None,
    }
    shown = (
        numbers["arrivals"] >= p["arrival_excess"] * max(numbers["completions"], 1),
        bool(cap and (w.get("running_max") or 0) >= cap)
        or (w.get("kv_usage_max") or 0) >= p["kv_full"],
        len(tenants) > 1 and top_n >= p["tenant_share"] * total,
    )
    order = sorted(range(len(RULE.causes)), key=lambda i: not shown[i])
    return tuple(RULE.causes[i] for i in order), numbers


def detect(sig: Signals, p: dict) -> Evidence | None:
    if not sig.healthy_baseline:
        return _absolute(sig, p)
    # also where the store's "healthy" windows are queued too, unseen: another engine reports
    # no queue time, so its windows can look healthy while every request waits
    return _risen(sig, p) or _onset(sig, p) or _absolute(sig, p)


# each completed request's TTFT and queue time in a window; where the engine reports no queue
# time (another engine behind the proxy), the TTFT beyond what its prompt costs on this engine
# at its quickest: the least TTFT of the dump's requests with a prompt of about its size
# (0.5-2x its tokens). The prefill floor a request would have had with no one ahead of it
_QUEUE_EST_SQL = f"""
WITH r AS (SELECT request_id, arrival_ns, ttft_ms, queue_ms, input_tokens FROM requests
           WHERE {COMPLETED_SQL} AND ttft_ms IS NOT NULL
             AND arrival_ns >= ? AND arrival_ns < ?)
SELECT a.ttft_ms, a.queue_ms,
       a.ttft_ms - (SELECT min(b.ttft_ms) FROM r b
                    WHERE b.input_tokens BETWEEN a.input_tokens / 2 AND a.input_tokens * 2)
FROM r a WHERE a.arrival_ns >= ? AND a.arrival_ns < ?
"""


def _queue_share(sig: Signals, w: Window) -> tuple[float | None, bool]:
    """The window's requests' queue time over their TTFT, summed; and whether it is estimated
    (no queue time from the engine: TTFT beyond the prompt's quickest TTFT in the dump)."""
    rows = sig.con.execute(
        _QUEUE_EST_SQL, [sig.since_ns, sig.until_ns, w.start_ns, w.end_ns]
    ).fetchall()
    ttft = sum(t for t, _, _ in rows)
    if not rows or not ttft:
        return None, False
    if all(q is not None for _, q, _ in rows):
        return sum(q for _, q, _ in rows) / ttft, False
    return sum(max(e or 0.0, 0.0) for _, _, e in rows) / ttft, True


def _absolute(sig: Signals, p: dict) -> Evidence | None:
    """Judged on absolute terms, with no healthy window to compare with (an engine overloaded
    from its first second, seen through the proxy): in ``absolute_windows`` windows or more,
    the engine's own gauge had at least ``absolute_waiting`` requests waiting per request
    running, most of the TTFT was queue time (``absolute_queue_share``; estimated where the
    engine reports none), and TTFT p50 was ``absolute_ttft_itl`` x ITL p50 or more: the seed's
    first symptom, TTFT diverging from ITL, without a before to compare."""
    hits = []
    for w in sig.busy():
        waiting, running = w.get("waiting_mean"), w.get("running_mean")
        ttft, itl = w.get("ttft_p50"), w.get("itl_p50")
        if waiting is None or running is None or not ttft or not itl:
            continue
        if waiting < p["absolute_waiting"] * max(running, 1.0):
            continue
        if ttft < p["absolute_ttft_itl"] * itl:
            continue
        share, estimated = _queue_share(sig, w)
        if share is None or share < p["absolute_queue_share"]:
            continue
        hits.append((ttft, w, share, estimated))
    if len(hits) < p["absolute_windows"]:
        return None
    _, w, share, estimated = max(hits, key=lambda h: h[0])
    ratio = w.get("ttft_p50") / w.get("itl_p50")
    where, params = _in_window(w)
    causes, shown = _causes(sig, w, p)
    est = " (estimated: TTFT beyond the quickest TTFT of prompts of its size)" if estimated else ""
    return Evidence(
        f"requests queued in {len(hits)} of {sig.busy_windows or len(sig.windows)} busy windows: "
        f"in {_when(w)} the engine's gauge read {w.get('waiting_mean'):.1f} waiting beside "
        f"{w.get('running_mean'):.1f} running, {share:.0%} of TTFT was queue time{est}, and TTFT "
        f"p50 was {_ms(w.get('ttft_p50'))} against ITL p50 {_ms(w.get('itl_p50'))} "
        f"({ratio:.0f}x); judged on absolute terms (no healthy window in this store to compare "
        "with)",
        {
            "waiting_mean": w.get("waiting_mean"),
            "running_mean": w.get("running_mean"),
            "waiting_max": w.get("waiting_max"),
            "queue_share_of_ttft": share,
            "queue_share_estimated": estimated,
            "ttft_p50_ms": w.get("ttft_p50"),
            "ttft_p99_ms": w.get("ttft_p99"),
            "itl_p50_ms": w.get("itl_p50"),
            "ttft_over_itl": ratio,
            "queued_windows": len(hits),
            "healthy_baseline": False,
            **shown,
        },
        (w.start_ns, w.end_ns),
        where,
        params,
        _severity(share / p["absolute_queue_share"], 1.0),
        _confidence(
            share / p["absolute_queue_share"],
            (w.get("waiting_mean") / max(w.get("running_mean"), 1.0)) / p["absolute_waiting"],
        ),
        causes=causes,
        support=Support(
            n=len(hits),
            unit="windows",
            reference="the engine's own queue gauge and TTFT against ITL (absolute markers)",
            persistence=f"{len(hits)} of {sig.busy_windows or len(sig.windows)} busy windows",
            verdict="conclusive",
        ),
    )


def _risen(sig: Signals, p: dict) -> Evidence | None:
    """The symptom in the ended requests: a window's TTFT p99 ``ttft_rise`` x the baseline,
    most of it queue time, ITL flat."""
    base, base_itl = sig.baseline.get("ttft_p99"), sig.baseline.get("itl_p99")

    def hit(w: Window) -> bool:
        r = _ratio(w.get("ttft_p99"), base)
        itl = _ratio(w.get("itl_p99"), base_itl)
        return (
            r is not None
            and r >= p["ttft_rise"]
            and (itl is None or itl <= p["itl_flat"])
            and (w.get("queue_share_of_ttft") or 0) >= p["queue_share"]
        )

    w = _worst(sig, "ttft_p99", hit)
    if w is None:
        return None
    support = _support(sig, [x for x in sig.busy() if hit(x)], p)
    r = _ratio(w.get("ttft_p99"), base)
    causes, shown = _causes(sig, w, p)
    return _window_evidence(
        f"TTFT p99 rose from {_ms(base)} to {_ms(w.get('ttft_p99'))} in {_when(w)} while ITL p99 "
        f"stayed at {_ms(w.get('itl_p99'))} (baseline {_ms(base_itl)}); "
        f"{w.get('queue_share_of_ttft'):.0%} of TTFT was queue time",
        {
            "ttft_p99_ms": w.get("ttft_p99"),
            "baseline_ttft_p99_ms": base,
            "itl_p99_ms": w.get("itl_p99"),
            "baseline_itl_p99_ms": base_itl,
            "queue_share_of_ttft": w.get("queue_share_of_ttft"),
            "queue_p99_ms": w.get("queue_p99"),
            "waiting_max": w.get("waiting_max"),
            "running_max": w.get("running_max"),
            **shown,
        },
        w,
        " AND queue_ms > 0.5 * ttft_ms",
        r,
        p["ttft_rise"],
        (w.get("queue_share_of_ttft") or 0) / p["queue_share"],
        causes=causes,
        support=support,
    )


# the requests that arrived in a window and have ended: their queue wait (ms)
_ENDED_WAITS_SQL = """
SELECT request_id, queue_ms FROM requests
WHERE arrival_ns >= ? AND arrival_ns < ? AND queue_ms IS NOT NULL
"""
# long prompts without their first token at some time in a window (queued or prefilling)
_LONG_OPEN_SQL = """
SELECT count(*) FROM requests
WHERE input_tokens >= ? AND arrival_ns < ? AND coalesce(first_token_ns, end_ns) > ?
"""


def _admission_closed(sig: Signals, w: Window, p: dict) -> bool:
    """The window's steps began with requests waiting and prefilled nothing, ``queue_steps`` of
    them; with no steps of the engine in the store, its waiting gauge's mean at
    ``onset_waiting``."""
    share = w.get("waiting_decode_only_share")
    if share is not None or sig.overall.get("steps"):
        return (share or 0) >= p["queue_steps"]
    return (w.get("waiting_mean") or 0) >= p["onset_waiting"]


def _onset(sig: Signals, p: dict) -> Evidence | None:
    """The queue as it forms, before its requests' TTFT has risen far or they have ended (a
    live store). In a window, a share ``queue_steps`` of the engine's steps began with requests
    waiting and prefilled nothing: admission was closed (the running batch at its cap, the KV
    pool at its limit), not a burst of prompts let in over the step budget. Requests waited at
    least ``wait_rise`` x the healthy TTFT p50 for admission (their queue wait if they have
    ended, their wait so far if not), no long prompt held the queue (that is head-of-line
    blocking) and ITL stayed within ``onset_itl_flat`` (the batch grows to its cap as the queue
    forms, so its steps slow). Where the store has no steps of the engine (another engine
    behind ``tokenmill proxy``), its own waiting gauge says admission was closed: at least
    ``onset_waiting`` requests waiting on average in the window."""
    base50, base_itl = sig.baseline.get("ttft_p50"), sig.baseline.get("itl_p99")
    if not base50:
        return None
    bound = p["wait_rise"] * base50
    # a queue behind a long prompt is head_of_line_blocking's: its own cut for "long"
    long = HOL.params["long_factor"].default * (sig.overall.get("short_prompt_tokens") or 0)
    live = waiting_now(sig)
    hits = []  # (window, [(request id, wait ms)] past the bound)
    for w in sig.busy():
        itl = _ratio(w.get("itl_p99"), base_itl)
        if not _admission_closed(sig, w, p) or (itl is not None and itl > p["onset_itl_flat"]):
            continue
        if long and (
            sig.con.execute(_LONG_OPEN_SQL, [long, w.end_ns, w.start_ns]).fetchone()[0]
            or any(
                (x.prompt_tokens or 0) >= long and x.at_ns >= w.start_ns and x.queued_ns < w.end_ns
                for x in live
            )
        ):
            continue
        rows = sig.con.execute(_ENDED_WAITS_SQL, [w.start_ns, w.end_ns]).fetchall()
        waits = {rid: ms or 0.0 for rid, ms in rows}
        for x in live:
            if w.start_ns <= x.queued_ns < w.end_ns:
                waits[x.request_id] = max(x.wait_ms, waits.setdefault(x.request_id, 0.0))
        past = [(rid, ms) for rid, ms in waits.items() if ms >= bound]
        if past:
            hits.append((w, past))
    if not hits:
        return None
    w, past = max(hits, key=lambda h: max(ms for _, ms in h[1]))
    rid, longest = max(past, key=lambda x: x[1])
    r = longest / base50
    where, params = _in_window(w)
    causes, shown = _causes(sig, w, p)
    share = w.get("waiting_decode_only_share")
    closed = (
        f"{share:.0%} of its steps began with requests waiting and admitted none "
        if share is not None
        else "the engine's own gauge "
    )
    return Evidence(
        f"requests queue for admission in {_when(w)}: {closed}"
        f"({w.get('waiting_mean'):.1f} waiting on average), {len(past)} request(s) waited {_ms(bound)} or more "
        f"(request {rid}: {_ms(longest)}), against a TTFT p50 of {_ms(base50)} in the healthy "
        f"windows; ITL p99 {_ms(w.get('itl_p99'))} (baseline {_ms(base_itl)}), no long prompt "
        "ahead of them",
        {
            "longest_wait_ms": longest,
            "waiting_request": rid,
            "baseline_ttft_p50_ms": base50,
            "waiting_mean": w.get("waiting_mean"),
            "waiting_decode_only_share": w.get("waiting_decode_only_share"),
            "waiting_max": w.get("waiting_max"),
            "running_max": w.get("running_max"),
            "itl_p99_ms": w.get("itl_p99"),
            "baseline_itl_p99_ms": base_itl,
            "queued_requests": len(past),
            **shown,
        },
        (w.start_ns, w.end_ns),
        # the examples are the window's ended requests that waited past the bound; the requests
        # still waiting count in queued_requests and may be the one named
        where + " AND queue_ms >= ?",
        [*params, bound],
        _severity(r, 2 * p["wait_rise"]),
        _confidence(
            r / p["wait_rise"],
            share / p["queue_steps"]
            if share is not None
            else (w.get("waiting_mean") or 0) / p["onset_waiting"],
        ),
        causes=causes,
        support=against_bound(
            [ms / base50 for h in hits for _, ms in h[1]],
            p["wait_rise"],
            unit="requests",
            reference_name=f"each queued request's wait over the healthy windows' TTFT p50, "
            f"against {p['wait_rise']:g} (wait_rise)",
            persistence=f"{len(hits)} of {sig.busy_windows or len(sig.windows)} busy windows",
            why_one="a request that waited in the queue has at least that TTFT: its wait is "
            "the symptom itself",
        ),
    )


def _support(sig: Signals, hits: list[Window], p: dict) -> Support:
    """The queued requests of every window that shows the symptom (queue time the larger part
    of their TTFT) against the requests of the healthy windows that do not."""
    spans = [(x.start_ns, x.end_ns) for x in hits]
    cond = " OR ".join("(arrival_ns >= ? AND arrival_ns < ?)" for _ in spans)
    sym = sig.con.execute(
        f"SELECT ttft_ms FROM requests WHERE ({cond}) AND {COMPLETED_SQL} "
        "AND queue_ms > 0.5 * ttft_ms",
        [t for s in spans for t in s],
    ).fetchall()
    ref_spans = [r for r in sig.healthy_ranges if r not in spans]
    ref = []
    if ref_spans:
        rc = " OR ".join("(arrival_ns >= ? AND arrival_ns < ?)" for _ in ref_spans)
        ref = sig.con.execute(
            f"SELECT ttft_ms FROM requests WHERE ({rc}) AND {COMPLETED_SQL}",
            [t for s in ref_spans for t in s],
        ).fetchall()
    return compare(
        [v for (v,) in sym],
        [v for (v,) in ref],
        unit="requests",
        reference_name="TTFT in the dump's healthy windows",
        min_effect=p["support_effect"],
        persistence=f"{len(hits)} of {sig.busy_windows or len(sig.windows)} busy windows",
    )


RULE = Rule(
    id="ttft_queueing",
    test_metric="ttft_ms",
    title="TTFT up, ITL flat: requests wait in the queue",
    symptom="TTFT rises while ITL stays flat and queue time dominates TTFT",
    causes=(
        "offered load above what the engine can admit (arrivals > completions)",
        "max_num_seqs or the KV pool caps the running batch",
        "one tenant floods the queue",
    ),
    checks=(
        "arrival vs completion rate in the window (overload if arrivals win)",
        "running_max vs max_num_seqs and KV usage (cap vs memory)",
        "requests per tenant in the window",
    ),
    knob="--max-num-seqs up (if KV allows), more replicas, or tenant max_concurrent / --max-queue-len to shed load early",
    params={
        "ttft_rise": Param(
            2.5,
            f"TTFT p99 {_BASE}; seed article: TTFT up with ITL flat. 2.5 on the corpus's tune "
            "split: a stepped-up load queueing at 2.8-2.9x was missed at 3.0, healthy runs "
            "peaked at 2.0x",
        ),
        "itl_flat": Param(1.5, f"ITL p99 {_BASE} still counted as flat"),
        "queue_share": Param(
            0.4,
            "queue time a large part of TTFT (0.4 on the tune split: that load's windows showed "
            "0.44-0.48, healthy windows 0.0)",
        ),
        "queue_steps": Param(
            0.25,
            "share of a window's steps that began with requests waiting and prefilled nothing, "
            "for the queue as it forms (tune split: the stepped-up load's windows after its 2x "
            "step 0.30-0.71, a pool that nearly holds the 2x step's clients 0.30-0.36 for three "
            "5 s windows; 0 in every window of the healthy runs, of head-of-line blocking "
            "at a low rate and of 24 prompts let in over a 256-token step budget)",
        ),
        "onset_waiting": Param(
            2.0,
            "where the store has no steps of the engine (another engine behind the proxy): "
            "requests waiting on average in the window by its own gauge, for the queue as it "
            "forms (a clump of arrivals at a 4-slot engine can queue one for a few seconds)",
        ),
        "wait_rise": Param(
            1.0,
            "a request's queue wait over the healthy windows' TTFT p50, for the queue as it "
            "forms: it waited a whole usual TTFT before its prefill began (tune split: 1.2x "
            "and 1.6x in those windows)",
        ),
        "onset_itl_flat": Param(
            2.0,
            f"ITL p99 {_BASE} still counted as flat while the queue forms: the running batch "
            "fills to its cap then, and each step carries more decodes (tune split: the "
            "stepped-up load's queueing windows 1.05-1.74x; the windows of head-of-line "
            "blocking that queued 5-15x)",
        ),
        "support_effect": Param(
            1.5,
            "the queued requests' TTFT median over the healthy windows' requests': the lower "
            "end of its 95% bootstrap interval must reach this",
        ),
        # which cause the window shows first (causes ranked by them, not fixed)
        "arrival_excess": Param(1.2, "arrivals / completions in the window (overload's)"),
        "kv_full": Param(0.9, "KV use counted as capping the batch (kv_pressure_preemption's)"),
        "tenant_share": Param(0.75, "one tenant of several sent this share of the arrivals"),
        # judged without a healthy window (an engine in trouble from the store's first second)
        "absolute_waiting": Param(
            1.0, "no healthy window: requests waiting per request running (the engine's gauge)"
        ),
        "absolute_queue_share": Param(
            0.5, "no healthy window: queue time over TTFT (estimated where the engine has none)"
        ),
        "absolute_ttft_itl": Param(
            20.0,
            "no healthy window: TTFT p50 over ITL p50 (seed: TTFT diverges from ITL; a short "
            "chat's TTFT is a handful of decode steps)",
        ),
        "absolute_windows": Param(2, "no healthy window: windows showing all three, at least"),
    },
    detect=detect,
    healthy_baseline="either",
    # the full admission queue's own refusals (429 queue_full) and the waits clients gave up:
    # the queue is their cause, ranked first (the live soak's overload on three client processes
    # opened error_spike first)
    explains_when={"error_spike": _errors_are_overloads},
    evidence_signals=("ttft_p99", "queue_p99", "waiting_mean"),
    alert=Alert(
        name="TokenmillTTFTQueueing",
        expr=(
            "($ttft_p99 / $ttft_p99_base >= $ttft_rise)\n"
            "and ($queue_share_of_ttft >= $queue_share)\n"
            "unless ($itl_p99 / $itl_p99_base > $itl_flat)"
        ),
        value="TTFT p99 over its baseline",
    ),
    reads=("requests", "completions", "steps", "kv"),
    needs={"requests": ("tenant", "request_id", "queue_ms", "input_tokens", "first_token_ns")},
)
