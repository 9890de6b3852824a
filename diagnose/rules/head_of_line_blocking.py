"""``head_of_line_blocking``: short requests stuck behind a long prompt."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import (
    _BASE,
    Evidence,
    Param,
    Rule,
    _confidence,
    _in_window,
    _ms,
    _ratio,
    _severity,
    _when,
    _worst,
)


def detect(sig: Signals, p: dict) -> Evidence | None:
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
    where, params = _in_window(w)
    return Evidence(
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
        (w.start_ns, w.end_ns),
        where + f" AND input_tokens <= {int(short)} AND queue_ms > 0.5 * ttft_ms",
        params,
        _severity(r, p["short_ttft_rise"]),
        _confidence(r / p["short_ttft_rise"]),
    )


RULE = Rule(
    id="head_of_line_blocking",
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
        "kv_free_below": Param(0.95, "KV not full: the wait is not memory pressure"),
        # in the queue, not in slow steps: a slowed engine (a busy host, a bigger batch) stretches
        # prefill and ITL too, and a batch of twenty short prompts let in at once decodes at a
        # fraction of the pace of the two streams before it, so ITL cannot tell the two apart
        "queue_share": Param(
            0.5, "mean share of the short prompts' TTFT spent waiting for admission"
        ),
    },
    detect=detect,
    healthy_baseline="needs",
    # the long prompts that block the queue are the prefills that stall the running decodes
    explains=("ttft_queueing", "ttft_prefill_bound", "itl_prefill_interference"),
    evidence_signals=("short_ttft_p99", "input_max", "waiting_max"),
)
