"""``batching_ineffective``: the batch is capped while memory is free."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import Evidence, Param, Rule, _confidence, _in_window, _when, _worst


def detect(sig: Signals, p: dict) -> Evidence | None:
    cap = sig.config.max_num_seqs
    known = bool(cap)
    if not known:
        # another engine's store has no config event: the most requests it ever ran at once
        # (its running gauge) stands for the cap; a batch flat at that while requests wait and
        # KV is mostly free is capped by something other than memory all the same
        cap = sig.overall.get("running_max")
        if not cap or sig.config.recorded:
            return None

    def hit(w: Window) -> bool:
        return (
            (w.get("running_max") or 0) >= cap
            and (w.get("waiting_mean") or 0) >= p["min_waiting"]
            and (w.get("kv_usage_max") or 1) < p["kv_usage_below"]
            and (w.get("queue_share_of_ttft") or 0) >= p["queue_share"]
        )

    w = _worst(sig, "waiting_mean", hit)
    if w is None:
        return None
    where, params = _in_window(w)
    held = (
        f"max_num_seqs={cap}"
        if known
        else (
            f"{cap:.0f} running (the most it ever ran; the engine's own cap is not in this store)"
        )
    )
    return Evidence(
        f"the batch stayed at {held} with {w.get('waiting_mean'):.1f} requests waiting "
        f"on average in {_when(w)} while KV use peaked at only {(w.get('kv_usage_max') or 0):.0%}; "
        f"{w.get('queue_share_of_ttft'):.0%} of TTFT was queueing",
        {
            "max_num_seqs": cap if known else None,
            "running_max": w.get("running_max"),
            "waiting_mean": w.get("waiting_mean"),
            "kv_usage_max": w.get("kv_usage_max"),
            "queue_share_of_ttft": w.get("queue_share_of_ttft"),
            "ttft_p99_ms": w.get("ttft_p99"),
        },
        (w.start_ns, w.end_ns),
        where + " AND queue_ms > 0.5 * ttft_ms",
        params,
        "warning",
        _confidence(
            (w.get("waiting_mean") or 0) / p["min_waiting"],
            p["kv_usage_below"] / max(w.get("kv_usage_max") or 1e-3, 1e-3),
        ),
    )


RULE = Rule(
    id="batching_ineffective",
    own_test="the running batch against max_num_seqs while requests wait",
    title="the batch is capped while memory is free",
    symptom="requests wait although KV is mostly free: the batch is stuck at max_num_seqs",
    causes=("max_num_seqs too low for this traffic",),
    checks=("running_max == max_num_seqs with KV usage low",),
    knob="--max-num-seqs up",
    params={
        "min_waiting": Param(1.0, "mean requests waiting in the engine"),
        "kv_usage_below": Param(0.5, "KV counted as mostly free"),
        "queue_share": Param(0.5, "queue time is the larger part of TTFT"),
    },
    detect=detect,
    healthy_baseline="absolute",
    explains=("ttft_queueing",),
    evidence_signals=("running_max", "waiting_mean", "kv_usage_max"),
    reads=("requests", "completions", "steps", "kv"),
)
