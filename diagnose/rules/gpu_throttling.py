"""``gpu_throttling``: GPU clocks down."""

from __future__ import annotations

from ..signals import Signals, Window
from ._common import _BASE, Evidence, Param, Rule, _confidence, _in_window, _ms, _ratio, _when


def detect(sig: Signals, p: dict) -> Evidence | None:
    if sig.device_kind != "gpu":
        return None
    base_clock, base_itl = sig.baseline.get("sm_clock_mean"), sig.baseline.get("itl_p99")

    def hit(w: Window) -> bool:
        drop = _ratio(w.get("sm_clock_mean"), base_clock)
        return (
            drop is not None
            and drop <= p["clock_drop"]
            and (w.get("throttled_samples") or 0) > 0
            and (_ratio(w.get("itl_p99"), base_itl) or 0) >= p["itl_rise"]
        )

    cands = [w for w in sig.busy() if hit(w)]
    if not cands:
        return None
    w = min(cands, key=lambda w: w.get("sm_clock_mean"))
    reasons = sig.con.execute(
        "SELECT list_distinct(flatten(list(clock_event_reasons))) FROM device_samples "
        "WHERE kind = 'gpu' AND time_ns >= ? AND time_ns < ?",
        [w.start_ns, w.end_ns],
    ).fetchone()[0]
    return Evidence(
        f"SM clock fell from {base_clock:.0f} to {w.get('sm_clock_mean'):.0f} MHz in {_when(w)} "
        f"(reasons: {', '.join(sorted(reasons or []))}; max temperature "
        f"{w.get('temperature_max') or 0:.0f} C, power {w.get('power_w_mean') or 0:.0f} W) while ITL "
        f"p99 rose from {_ms(base_itl)} to {_ms(w.get('itl_p99'))}",
        {
            "sm_clock_mhz": w.get("sm_clock_mean"),
            "baseline_sm_clock_mhz": base_clock,
            "clock_event_reasons": sorted(reasons or []),
            "temperature_max_c": w.get("temperature_max"),
            "power_w_mean": w.get("power_w_mean"),
            "itl_p99_ms": w.get("itl_p99"),
            "baseline_itl_p99_ms": base_itl,
        },
        (w.start_ns, w.end_ns),
        *_in_window(w),
        "critical",
        _confidence(p["clock_drop"] / w.get("sm_clock_mean") * base_clock),
    )


RULE = Rule(
    id="gpu_throttling",
    own_test="device samples with throttle reasons and lowered clocks",
    title="GPU clocks down",
    symptom="SM clocks drop with thermal or power reasons while ITL rises",
    causes=("thermal throttling", "power cap"),
    checks=("clock_event_reasons and temperature in device_samples",),
    knob="fix cooling or the power cap; outside the engine",
    params={
        "clock_drop": Param(0.85, "SM clock vs the baseline's"),
        "itl_rise": Param(1.2, f"ITL p99 {_BASE}"),
    },
    detect=detect,
    healthy_baseline="needs",
    explains=("host_bound_steps",),
    evidence_signals=("sm_clock_mean", "power_w_mean", "temperature_max"),
    reads=("requests", "completions", "devices"),
)
