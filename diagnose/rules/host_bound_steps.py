"""``host_bound_steps``: steps wait on the host."""

from __future__ import annotations

from ..signals import BASELINE_QUANTILE, Signals, Window, _quantile
from ._common import (
    _BASE,
    Evidence,
    Param,
    Rule,
    _confidence,
    _in_window,
    _ms,
    _ratio,
    _when,
    _worst,
)

_HOST_PARTS = ("schedule_ms_mean", "prepare_ms_mean", "sample_ms_mean", "detokenize_ms_mean")


def _host_ms(w: Window) -> float:
    return sum(w.get(k) or 0 for k in _HOST_PARTS)


def detect(sig: Signals, p: dict) -> Evidence | None:
    base_step = sig.baseline.get("step_ms_p50")
    # the host time of a step in the healthiest windows, the same quantile as the baseline of
    # every latency signal
    base_host = _quantile([_host_ms(w) for w in sig.busy() if w.get("steps")], BASELINE_QUANTILE)

    def hit(w: Window) -> bool:
        share = w.get("host_share_of_step") or 0
        # the slowdown is a ratio to the healthy windows; without them only the GPU-idle path.
        # The host's own time growing counts too: a noisy VM can slow the baseline's forward
        # as much as the host work slows the step (CI: greedy 24-row steps at 2x their usual
        # time, then sampling at 1.16x them with host share 0.5 and host time ~19x)
        slow = (_ratio(w.get("step_ms_p50"), base_step) or 0) if sig.healthy_baseline else 0
        grew = (_ratio(_host_ms(w), base_host) or 0) if sig.healthy_baseline else 0
        gpu_idle = (
            sig.device_kind == "gpu" and (w.get("gpu_util_mean") or 100) < p["gpu_busy_below"]
        )
        return share >= p["host_share"] and (
            slow >= p["step_slowdown"] or grew >= p["host_growth"] or gpu_idle
        )

    w = _worst(sig, "host_share_of_step", hit)
    if w is None:
        return None
    share = w.get("host_share_of_step")
    util = w.get("gpu_util_mean")
    return Evidence(
        f"{share:.0%} of each engine step went to host work in {_when(w)} (schedule "
        f"{_ms(w.get('schedule_ms_mean'))}, input preparation {_ms(w.get('prepare_ms_mean'))}, "
        f"sample {_ms(w.get('sample_ms_mean'))}, detokenize "
        f"{_ms(w.get('detokenize_ms_mean'))}; forward {_ms(w.get('forward_ms_mean'))}"
        + (
            f"; then {_ms(w.get('output_send_ms_mean'))} to send the outputs to the API"
            if w.get("output_send_ms_mean") is not None
            else ""
        )
        + (
            f" and {_ms(w.get('stream_write_ms_mean'))} for the API to write them to the streams"
            if w.get("stream_write_ms_mean") is not None
            else ""
        )
        + (f"; GPU busy {util:.0f}%" if util is not None and sig.device_kind == "gpu" else "")
        + ")",
        {
            "host_share_of_step": share,
            "schedule_ms_mean": w.get("schedule_ms_mean"),
            "sample_ms_mean": w.get("sample_ms_mean"),
            "prepare_ms_mean": w.get("prepare_ms_mean"),
            "detokenize_ms_mean": w.get("detokenize_ms_mean"),
            "output_send_ms_mean": w.get("output_send_ms_mean"),
            "stream_write_ms_mean": w.get("stream_write_ms_mean"),
            "forward_ms_mean": w.get("forward_ms_mean"),
            "step_ms_p50": w.get("step_ms_p50"),
            "baseline_step_ms_p50": base_step,
            "gpu_util_mean": util,
        },
        (w.start_ns, w.end_ns),
        *_in_window(w),
        "warning",
        _confidence(share / p["host_share"]),
    )


RULE = Rule(
    id="host_bound_steps",
    own_test="the host's share of the step time over the window's steps",
    title="steps wait on the host",
    symptom=(
        "the host side of each step (schedule, input preparation, sample, detokenize) is a "
        "large share while steps are slow"
    ),
    causes=(
        "Python scheduling overhead at large batch",
        "sampling on the host",
        "kernel launch overhead",
    ),
    checks=("schedule_ms, prepare_ms, sample_ms and detokenize_ms vs forward_ms",),
    knob="--max-num-seqs down; CUDA graphs where available",
    params={
        "host_share": Param(
            0.3, "(schedule + input preparation + sample + detokenize) / step time"
        ),
        "step_slowdown": Param(1.5, f"step time {_BASE}"),
        "host_growth": Param(
            5.0, f"host time per step {_BASE}: counts as the slowdown when the step's is hidden"
        ),
        "gpu_busy_below": Param(50.0, "GPU utilization % counted as low"),
    },
    detect=detect,
    healthy_baseline="either",
    evidence_signals=("host_share_of_step", "gpu_util_mean"),
    reads=("requests", "completions", "steps", "step_split", "devices"),
)
