"""The healthy baseline: the dump's own healthiest windows, and whether they are healthy.

For each latency signal of :data:`BASELINE_KEYS`, the baseline is the 25th percentile
(:data:`BASELINE_QUANTILE`) of its per-window values over the healthy windows (below), or over
every window with a completed request when fewer than :data:`BASELINE_MIN_HEALTHY` are healthy
(the 75th for signals where higher is healthier: the SM clock, tokens/s). Rules compare a window
to that baseline as a ratio, so thresholds hold across machine speeds (a 2-core CPU and an H200
differ 100x in ms, not in ratios).

A healthy baseline needs healthy windows: a dump cut to start inside an incident has none, and
then every ratio compares trouble with trouble. A busy window is *healthy* when it shows none of
the absolute trouble markers (a preemption, a block allocation failing in at least
``HEALTHY_MAX_FAILING_STEPS`` of its working steps, errors in at least
``HEALTHY_MAX_ERROR_RATE`` of the requests ending in it, queue time at least
``HEALTHY_MAX_QUEUE_SHARE`` of TTFT); the baseline is usable (``Signals.healthy_baseline``) when
at least ``MIN_HEALTHY_WINDOWS`` busy windows are healthy. Otherwise ``healthy_baseline_reason``
says why, and rules that need the baseline are not judged (``Rule.healthy_baseline``). One
healthy window is enough on purpose: the test only catches the dump that has no healthy period
at all. (Until 2026-12-03 the baseline was the 25th percentile of every busy window: a fault
that filled most of a dump lifted its own yardstick, and a queue that tripled TTFT read 2.6x.)

Each baseline key is the per-window key of the same name (its family yields it).
"""

from __future__ import annotations

from .scope import quantile
from .window import Window

# latency signals whose healthy level is the dump's best windows
BASELINE_KEYS = (
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "tpot_p50",
    "tpot_p99",
    "queue_p50",
    "queue_p99",
    "prefill_p50",
    "prefill_p99",
    "e2e_p50",
    "e2e_p99",
    "short_ttft_p99",
    "step_ms_p50",
    "step_ms_p99",
    "decode_step_ms_p50",
    "kv_usage_max",
    "error_rate",
    "sm_clock_mean",
    "throughput_tok_s",
)
BASELINE_QUANTILE = 0.25  # "the healthiest windows": the best quarter of windows with traffic
BASELINE_MIN_HEALTHY = 2  # healthy windows needed to take the baseline from them alone
# a healthy window's ceilings: error_spike's min_rate (5%) and ttft_queueing's queue_share (half)
HEALTHY_MAX_ERROR_RATE = 0.05
HEALTHY_MAX_QUEUE_SHARE = 0.5
# kv_pressure_preemption's absolute_failing_steps: allocations failing in most steps
HEALTHY_MAX_FAILING_STEPS = 0.5
MIN_HEALTHY_WINDOWS = 1
# a window with fewer requests ending than this cannot show an error rate under 5% on its own
# (one error in 10 is already 10%): it is judged on its neighbourhood instead, the nearest
# windows around it pooled until this many requests end there (errors spread thin over a slow
# period show in every neighbourhood; a burst of errors spoils only the windows near it)
HEALTHY_MIN_ENDED = 10
# signals where a higher value is the healthier one
HIGHER_IS_HEALTHIER = ("sm_clock_mean", "throughput_tok_s")


def baseline_values(busy: list[Window], healthy: list[Window]) -> dict[str, float | None]:
    """Each of :data:`BASELINE_KEYS`: the healthiest quarter's edge over the ``healthy`` windows,
    or over the ``busy`` ones (those with a completed request) when fewer than
    :data:`BASELINE_MIN_HEALTHY` are healthy: a fault that fills most of a dump must not lift
    its own yardstick."""
    ref = healthy if len(healthy) >= BASELINE_MIN_HEALTHY else busy
    out = {}
    for key in BASELINE_KEYS:
        vals = [w.get(key) for w in ref]
        if key in HIGHER_IS_HEALTHIER:
            out[key] = quantile(vals, 1 - BASELINE_QUANTILE)
        else:
            out[key] = quantile(vals, BASELINE_QUANTILE)
    return out


def local_error_rates(windows: list[Window]) -> dict[int, float]:
    """For each window (by index) where fewer than ``HEALTHY_MIN_ENDED`` requests end: the
    error rate of the requests ending in the smallest span of windows centred on it (every
    window of the range counts, also those where no request completed) in which at least
    ``HEALTHY_MIN_ENDED`` end, or the whole range when none is that large."""
    ended = [0]
    errors = [0]
    for w in windows:
        ended.append(ended[-1] + (w.get("ended") or 0))
        errors.append(errors[-1] + (w.get("errors") or 0))
    n = len(windows)

    def span(i: int, r: int) -> tuple[int, int]:
        lo, hi = max(0, i - r), min(n, i + r + 1)
        return ended[hi] - ended[lo], errors[hi] - errors[lo]

    out = {}
    for i, w in enumerate(windows):
        if (w.get("ended") or 0) >= HEALTHY_MIN_ENDED:
            continue
        lo, hi = 0, n  # the least radius whose span holds enough ended requests
        while lo < hi:
            mid = (lo + hi) // 2
            if span(i, mid)[0] >= HEALTHY_MIN_ENDED:
                hi = mid
            else:
                lo = mid + 1
        done, failed = span(i, lo)
        out[w.index] = failed / done if done else 0.0
    return out


def judge_baseline(busy: list[Window], windows: list[Window]) -> tuple[bool, list[Window], str]:
    """Whether the healthiest windows can serve as a baseline: ``(usable, healthy windows,
    reason it is not)``. A healthy window is busy and shows no preemption, allocation failures
    in fewer than ``HEALTHY_MAX_FAILING_STEPS`` of its working steps, errors below
    ``HEALTHY_MAX_ERROR_RATE`` (a window with fewer than ``HEALTHY_MIN_ENDED`` requests ending:
    its neighbourhood's rate among ``windows``, every window of the range,
    :func:`local_error_rates`, when higher) and queue time below ``HEALTHY_MAX_QUEUE_SHARE`` of
    TTFT; usable with at least ``MIN_HEALTHY_WINDOWS`` of them. Returns the healthy windows
    themselves as the second item."""
    local = local_error_rates(windows)

    def error_rate(w: Window) -> float:
        return max(w.get("error_rate") or 0, local.get(w.index, 0.0))

    markers = {
        "preemptions": lambda w: (
            (w.get("preemptions") or 0) > 0 or (w.get("preempted_requests_n") or 0) > 0
        ),
        "allocation failures in most steps": lambda w: (
            (w.get("allocation_failure_steps") or 0)
            >= HEALTHY_MAX_FAILING_STEPS * max(w.get("steps") or 0, 1)
        ),
        f"errors in ≥ {HEALTHY_MAX_ERROR_RATE:.0%} of requests": lambda w: (
            error_rate(w) >= HEALTHY_MAX_ERROR_RATE
        ),
        f"queue time ≥ {HEALTHY_MAX_QUEUE_SHARE:.0%} of TTFT": lambda w: (
            (w.get("queue_share_of_ttft") or 0) >= HEALTHY_MAX_QUEUE_SHARE
        ),
    }
    healthy = [w for w in busy if not any(m(w) for m in markers.values())]
    need = MIN_HEALTHY_WINDOWS
    if len(healthy) >= need:
        return True, healthy, ""
    if not busy:
        return False, [], "no window has a completed request to compare with"
    seen = ", ".join(
        f"{name} in {n}" for name, m in markers.items() if (n := sum(1 for w in busy if m(w)))
    )
    return (
        False,
        healthy,
        f"{len(healthy)} of {len(busy)} busy windows healthy, {need} needed ({seen})",
    )
