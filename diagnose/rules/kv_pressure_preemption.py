"""``kv_pressure_preemption``: KV cache full: preemptions slow everything."""

from __future__ import annotations

from ..signals import Signals, Window, recompute_steps
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
    _when,
    _window_evidence,
    _worst,
)


def _failing_share(w: Window) -> float | None:
    """Share of the window's working steps in which a KV block allocation failed; None where
    the store cannot say (another engine's scraped metrics count no allocation failures)."""
    if w.get("allocation_failure_steps") is None and w.get("steps") is None:
        return None
    steps = w.get("steps") or 0
    return (w.get("allocation_failure_steps") or 0) / steps if steps else 0.0


# the streams decoding across a step (first token before it, last after it), the recomputed
# requests themselves left out
_ACROSS_SQL = """
SELECT count(*) FROM requests
WHERE first_token_ns < ? AND last_token_ns > ? AND NOT list_contains(?::VARCHAR[], request_id)
"""
# the preempted requests' longest gap between tokens: the wait to be rescheduled and recomputed
_PREEMPTED_GAP_SQL = """
SELECT max(itl_max_ms), arg_max(request_id, itl_max_ms) FROM requests
WHERE preemptions > 0 AND arrival_ns >= ? AND arrival_ns < ?
"""


def recompute_chain(sig: Signals) -> tuple[str, dict]:
    """The chain past the preemptions over the range: the steps that recomputed preempted
    requests' tokens and the streams decoding beside them (each stalled for the step), and the
    preempted requests' own longest gap (waiting to be rescheduled, then recomputed).
    ``("", {})`` where the store shows no recompute step."""
    steps = recompute_steps(sig)
    if not steps:
        return "", {}
    worst = max(steps, key=lambda r: r.ms)
    (streams,) = sig.con.execute(
        _ACROSS_SQL, [worst.start_ns, worst.end_ns, list(worst.request_ids)]
    ).fetchone()
    gap, gap_id = sig.con.execute(_PREEMPTED_GAP_SQL, [sig.since_ns, sig.until_ns]).fetchone()
    tokens = sum(r.recomputed_tokens for r in steps)
    text = (
        f"; {len(steps)} steps recomputed {tokens} tokens of preempted requests, the slowest "
        f"{_ms(worst.ms)} ({worst.recomputed_tokens} tokens of {len(worst.request_ids)} "
        f"request(s)"
        + (f", stalling {streams} stream(s) decoding beside it" if streams else "")
        + ")"
        + (
            f"; a preempted request waited up to {_ms(gap)} between two tokens (request "
            f"{gap_id}: rescheduled, then recomputed)"
            if gap
            else ""
        )
    )
    return text, {
        "recompute_steps": len(steps),
        "recompute_step_tokens": tokens,
        "recompute_step_ms_max": worst.ms,
        "recompute_stalled_streams": streams,
        "preempted_gap_ms_max": gap,
        "recompute_example_requests": list(worst.request_ids[:5]),
    }


def _detect_absolute(sig: Signals, p: dict) -> Evidence | None:
    """Without a healthy baseline: the pool's own absolute markers, which need no comparison
    (allocation failures in most steps, the pool nearly full, requests preempted)."""

    def hit(w: Window) -> bool:
        share = _failing_share(w)  # unknown from scraped metrics: the other two markers
        return (
            (w.get("preemptions") or 0) >= p["min_preemptions"]
            and (w.get("kv_usage_max") or 0) >= p["absolute_kv_full"]
            and (share is None or share >= p["absolute_failing_steps"])
        )

    w = _worst(sig, "preemptions", hit)
    if w is None:
        # no single window holds all three (a slow engine runs few steps a window, and the
        # step that preempts frees blocks): the whole range, which is all incident here
        w = Window(-1, sig.start_ns, sig.end_ns, values=dict(sig.overall))
        if not hit(w):
            return None
    share = _failing_share(w)
    where, params = _in_window(w)
    chain, chain_numbers = recompute_chain(sig)
    span = "over the whole range, " if w.index < 0 else ""
    # recompute is counted on the requests that arrived in the window: say it only when seen
    n_re = w.get("recomputed_tokens") or 0
    recomputed = f" ({n_re:.0f} tokens recomputed)" if n_re else ""
    failed = (
        f"a block allocation failed in {w.get('allocation_failure_steps'):.0f} of "
        f"{w.get('steps'):.0f} steps ({share:.0%})"
        if share is not None
        else "the engine's metrics count no allocation failures"
    )
    return Evidence(
        f"KV cache at {(w.get('kv_usage_max') or 0):.0%} with {w.get('preemptions'):.0f} "
        f"preemptions{recomputed} {span}in {_when(w)}; {failed}"
        + (
            f"; TTFT p99 {_ms(w.get('ttft_p99'))}, TPOT p99 {_ms(w.get('tpot_p99'))}"
            if w.get("ttft_p99") is not None
            else ""
        )
        + " (no healthy baseline in this dump to compare with)"
        + chain,
        {
            **chain_numbers,
            "kv_usage_max": w.get("kv_usage_max"),
            "preemptions": w.get("preemptions"),
            "preempted_requests": w.get("preempted_requests_n"),
            "recomputed_tokens": w.get("recomputed_tokens"),
            "allocation_failures": w.get("allocation_failures"),
            "allocation_failure_steps": w.get("allocation_failure_steps"),
            "steps": w.get("steps"),
            "allocation_failure_step_share": share,
            "ttft_p99_ms": w.get("ttft_p99"),
            "tpot_p99_ms": w.get("tpot_p99"),
            "healthy_baseline": False,
        },
        (w.start_ns, w.end_ns),
        where + " AND preemptions > 0",
        params,
        "warning",
        _confidence(
            share / p["absolute_failing_steps"] if share is not None else None,
            (w.get("kv_usage_max") or 0) / p["absolute_kv_full"],
        ),
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    if not sig.healthy_baseline:
        return _detect_absolute(sig, p)
    base_ttft, base_tpot = sig.baseline.get("ttft_p99"), sig.baseline.get("tpot_p99")

    def hit(w: Window) -> bool:
        return (
            (w.get("preemptions") or 0) >= p["min_preemptions"]
            and (w.get("kv_usage_max") or 0) >= p["kv_full"]
            and (_ratio(w.get("ttft_p99"), base_ttft) or 0) >= p["degrade"]
            and (_ratio(w.get("tpot_p99"), base_tpot) or 0) >= p["degrade"]
        )

    w = _worst(sig, "preemptions", hit)
    if w is None:
        return None
    r = min(_ratio(w.get("ttft_p99"), base_ttft), _ratio(w.get("tpot_p99"), base_tpot))
    chain, chain_numbers = recompute_chain(sig)
    return _window_evidence(
        f"KV cache at {(w.get('kv_usage_max') or 0):.0%} with {w.get('preemptions'):.0f} preemptions "
        f"({w.get('recomputed_tokens') or 0:.0f} tokens recomputed) in {_when(w)}; TTFT p99 "
        f"{_ms(base_ttft)} → {_ms(w.get('ttft_p99'))}, TPOT p99 {_ms(base_tpot)} → "
        f"{_ms(w.get('tpot_p99'))}" + chain,
        {
            "kv_usage_max": w.get("kv_usage_max"),
            "preemptions": w.get("preemptions"),
            "recomputed_tokens": w.get("recomputed_tokens"),
            **chain_numbers,
            "ttft_p99_ms": w.get("ttft_p99"),
            "baseline_ttft_p99_ms": base_ttft,
            "tpot_p99_ms": w.get("tpot_p99"),
            "baseline_tpot_p99_ms": base_tpot,
            "allocation_failures": w.get("allocation_failures"),
        },
        w,
        " AND preemptions > 0",
        r,
        p["degrade"],
        (w.get("kv_usage_max") or 0) / p["kv_full"],
    )


def _prefills_waited_on_recompute(evidence: dict) -> bool:
    """A ``ttft_prefill_bound`` whose slow requests mostly prefilled beside the recompute of
    preempted requests: the pool's shortage is what slowed their prefill."""
    return (evidence.get("slow_prefills_beside_recompute_share") or 0.0) >= 0.5


RULE = Rule(
    id="kv_pressure_preemption",
    own_test="preemptions by recompute and KV use in the engine's steps (absolute markers)",
    title="KV cache full: preemptions slow everything",
    symptom="TTFT and ITL both degrade with the KV cache near full and preemptions/recompute",
    causes=(
        "too many concurrent long sequences for the KV pool",
        "greedy admission without headroom (watermark too low)",
    ),
    checks=(
        "kv_usage_max and preemptions per window",
        "recomputed tokens vs generated tokens",
    ),
    knob="--max-num-seqs down, --kv-watermark up, more KV memory (--kv-cache-memory / --gpu-memory-utilization)",
    params={
        "kv_full": Param(0.9, "KV use counted as near full"),
        "min_preemptions": Param(1, "at least one preemption in the window"),
        "degrade": Param(1.5, f"TTFT p99 and TPOT p99 {_BASE} (seed: both degrade)"),
        # without a healthy baseline (signals.py): evidence that is absolute by nature
        "absolute_kv_full": Param(
            0.95, "no healthy baseline: KV pool at least 95% used (next to no block left)"
        ),
        "absolute_failing_steps": Param(
            0.5, "no healthy baseline: a block allocation failed in most working steps"
        ),
    },
    detect=detect,
    healthy_baseline="either",
    explains=("midstream_stall", "ttft_queueing", "overload"),
    explains_when={"ttft_prefill_bound": _prefills_waited_on_recompute},
    evidence_signals=("kv_usage_max", "preemptions", "ttft_p99"),
    alert=Alert(
        name="TokenmillKVPressurePreemption",
        expr=(
            "(max by ($by) (max_over_time(tokenmill_kv_cache_usage_perc[$window])) >= $kv_full)\n"
            "and (sum by ($by) (increase(tokenmill_num_preemptions_total[$window]))"
            " >= $min_preemptions)\n"
            "and ($ttft_p99 / $ttft_p99_base >= $degrade)\n"
            "and ($tpot_p99 / $tpot_p99_base >= $degrade)"
        ),
        value="peak KV-cache usage",
        unit="%",
    ),
    reads=("requests", "kv_requests", "completions", "steps", "kv"),
    needs={
        "requests": ("first_token_ns", "request_id", "preemptions", "itl_max_ms"),
        "engine_steps": ("req_ids", "req_tokens", "req_prefill"),
    },
)
