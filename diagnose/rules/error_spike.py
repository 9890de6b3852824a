"""``error_spike``: errors up while throughput is normal."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import _BASE, Alert, Evidence, Param, Rule, _confidence, _ratio, _when, _worst


def detect(sig: Signals, p: dict) -> Evidence | None:
    base_rate = sig.baseline.get("error_rate") or 0.0
    base_tp = sig.baseline.get("throughput_tok_s")

    def hit(w: Window) -> bool:
        rate = w.get("error_rate")
        if rate is None:
            return False
        if rate < max(p["min_rate"], p["rise"] * base_rate) and rate < p["absolute_rate"]:
            return False
        if (w.get("errors") or 0) < p["min_errors"]:
            return False
        tp = _ratio(w.get("throughput_tok_s"), base_tp)
        return tp is None or tp >= p["throughput_normal"]

    w = _worst(sig, "error_rate", hit)
    if w is None:
        return None
    by_type = sig.errors_by_window.get(w.index, {})
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    return Evidence(
        f"{w.get('error_rate'):.0%} of requests ended in errors in {_when(w)} (baseline "
        f"{base_rate:.0%}) while throughput stayed at {w.get('throughput_tok_s') or 0:.0f} tok/s: "
        f"{kinds}",
        {
            "error_rate": w.get("error_rate"),
            "baseline_error_rate": base_rate,
            "errors_by_type": by_type,
            "throughput_tok_s": w.get("throughput_tok_s"),
            "baseline_throughput_tok_s": base_tp,
        },
        (w.start_ns, w.end_ns),
        "end_ns >= ? AND end_ns < ? AND error_type IS NOT NULL",
        [w.start_ns, w.end_ns],
        "critical"
        if w.get("error_rate") >= 2 * max(p["min_rate"], base_rate * p["rise"])
        else "warning",
        _confidence(w.get("error_rate") / max(p["min_rate"], p["rise"] * base_rate)),
    )


RULE = Rule(
    id="error_spike",
    title="errors up while throughput is normal",
    symptom="the error rate jumps while tokens/s stays normal",
    causes=(
        "numerical failures (nan_logits)",
        "clients aborting (timeouts upstream)",
        "rejections (rate limits, context length)",
    ),
    checks=("errors by type in the window",),
    knob="depends on the type: dtype/model for nan_logits, client timeouts for aborts, tenant limits for 429",
    params={
        "min_rate": Param(0.05, "at least 5% of requests in the window"),
        "min_errors": Param(5, "errors in the window (a rate of 1 in 10 is noise)"),
        "absolute_rate": Param(
            0.2, "a fifth of requests failing is a spike even if the whole dump is like it"
        ),
        "rise": Param(3.0, "error rate vs the healthiest windows"),
        "throughput_normal": Param(0.7, f"tokens/s {_BASE} still counted as normal"),
    },
    detect=detect,
    evidence_signals=("error_rate", "throughput_tok_s"),
    alert=Alert(
        name="TokenmillErrorSpike",
        expr=(
            "(\n"
            "  ($error_ratio >= clamp_min($rise * $error_ratio_base, $min_rate))\n"
            "  or ($error_ratio >= $absolute_rate)\n"
            ")\n"
            "and (sum by ($by) (increase(tokenmill_request_errors_total[$window])) >= $min_errors)\n"
            "unless ($tokens_per_s / $tokens_per_s_base < $throughput_normal)"
        ),
        value="share of requests ending in an error",
        unit="%",
        severity="critical",  # requests fail here; the other alerts' requests are slow
    ),
)
