"""``midstream_stall``: fast first token, then a long stall."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _confidence, _in_window, _ms, _when, _worst


def detect(sig: Signals, p: dict) -> Evidence | None:
    def hit(w: Window) -> bool:
        done = w.get("completed_arrivals") or 0
        stalled = w.get("stalled_n") or 0
        return (
            done > 0
            and stalled / done >= p["share"]
            and (w.get("stalled_preempted_n") or 0) >= p["preempted_share"] * stalled
        )

    w = _worst(sig, "stalled_n", hit)
    if w is None:
        return None
    share = (w.get("stalled_n") or 0) / (w.get("completed_arrivals") or 1)
    pre = w.get("stalled_preempted_n") or 0
    where, params = _in_window(w)
    return Evidence(
        f"{w.get('stalled_n')} requests got their first token fast, then stalled (largest gap "
        f"{_ms(w.get('itl_max'))}, ≥ 10x their own ITL p50) in {_when(w)}; {pre} of them were "
        f"preempted and recomputed",
        {
            "stalled_requests": w.get("stalled_n"),
            "stalled_share": share,
            "stalled_and_preempted": pre,
            "itl_max_ms": w.get("itl_max"),
            "itl_p50_ms": w.get("itl_p50"),
        },
        (w.start_ns, w.end_ns),
        where + " AND itl_max_ms >= 10 * itl_p50_ms",
        params,
        "warning",
        _confidence(share / p["share"], 1.5 if pre else 1.0),
    )


RULE = Rule(
    id="midstream_stall",
    own_test="a stream stalled 10x its own ITL p50: one stall is the symptom",
    title="fast first token, then a long stall",
    symptom="first token fast, then a gap far above the request's own ITL",
    causes=("preemption and recompute of running requests", "a long prefill in between"),
    checks=("preemptions of the stalled requests",),
    knob="--kv-watermark up or --max-num-seqs down to avoid preemption",
    params={
        "share": Param(0.05, "share of completed requests in the window that stalled"),
        "preempted_share": Param(
            0.5, "share of the stalled ones that were preempted (else: interference)"
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("stalled_n", "itl_max"),
    reads=("requests", "kv_requests", "completions"),
)
