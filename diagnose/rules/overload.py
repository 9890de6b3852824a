"""``overload``: arrivals exceed completions."""

from __future__ import annotations

import itertools
import statistics

from ..signals import Signals, Window
from ..stats import Support
from ._common import Alert, Evidence, Param, Rule, _clock, _confidence, _ms, _severity

# error types an overload causes itself: the admission queue's refusals and clients that gave
# up waiting (engine/api/stations.py, engine/api/openai_routes.py), the proxy among them: an upstream that
# sent no first byte within the proxy's timeout (proxy/app.py). A hung upstream completes
# nothing, so overload (which needs TTFT rising over completed requests) does not fire beside it
OVERLOAD_ERRORS = ("queue_full", "client_disconnected", "upstream_timeout")


OWN_TEST = "arrivals outpacing completions window after window (a trend over min_windows)"


def _errors_are_overloads(evidence: dict) -> bool:
    """An ``error_spike`` whose errors are mostly :data:`OVERLOAD_ERRORS`: the overload explains
    it (the demo's overload phase: 429s from a full queue ranked first by 1 % of confidence)."""
    by_type = evidence.get("errors_by_type") or {}
    total = sum(by_type.values())
    return total > 0 and sum(by_type.get(t, 0) for t in OVERLOAD_ERRORS) >= 0.5 * total


def _starved(first: Window, last: Window, p: dict) -> bool:
    """No latency to trend because nothing completed: the run's last window completed no
    request while the engine's own queue grew by ``min_queue_growth`` from its first (a
    backlog of long prompts that stops every completion)."""
    grew = (last.get("waiting_mean") or 0) - (first.get("waiting_mean") or 0)
    return not (last.get("completions") or 0) and grew >= p["min_queue_growth"]


def _calm(w: Window, in_engine_next: float) -> bool:
    """A window before a run whose requests in the engine were fewer than the run's first
    window's: the backlog had not begun, its latency is the reference."""
    return (w.get("waiting_mean") or 0) + (w.get("running_mean") or 0) < in_engine_next


def detect(sig: Signals, p: dict) -> Evidence | None:
    ws = sig.busy()
    n = int(p["min_windows"])
    # sustained: the queue grows from each window to the next (so by min_queue_growth over the
    # run). A closed-loop jump in clients fills the queue once; after it each completion brings
    # the next arrival and the queue holds, which is a cap on the batch (ttft_queueing), not
    # arrivals outgrowing it
    step = p["min_queue_growth"] / (n - 1)
    best = None
    for i in range(len(ws) - n + 1):
        run = ws[i : i + n]
        arr = sum(w.get("arrivals", 0) or 0 for w in run)
        done = sum(w.get("completions", 0) or 0 for w in run)
        # the requests in flight: waiting, or running where the engine admits them all (a
        # large max_num_seqs and KV pool turn an overload into a growing batch, whose steps
        # slow every stream, rather than a queue)
        waits = [(w.get("waiting_mean") or 0) + (w.get("running_mean") or 0) for w in run]
        # latency from the window before the backlog began: a surge that lands at once moves
        # TTFT or ITL in the run's first window already, and the trend inside the run is flat
        # (blind set: ITL p50 23 ms before a 5x surge, 275, 267 and 240 ms in the run)
        before = [ws[i - 1]] if i > 0 and _calm(ws[i - 1], waits[0]) else []
        ttfts = [w.get("ttft_p50") for w in before + run if w.get("ttft_p50") is not None]
        itls = [w.get("itl_p50") for w in before + run if w.get("itl_p50")]
        growing = all(b - a >= step for a, b in itertools.pairwise(waits))
        # arrivals outpace completions in each window, not only over the run: one burst that
        # lands at once and then drains (24 requests in 250 ms behind a blocked admission) fills
        # the queue across the windows around it without any rate exceeding capacity
        outpaced = all(
            (w.get("arrivals") or 0) >= max(1, p["window_excess"] * (w.get("completions") or 0))
            for w in run
        )
        if (
            growing
            and outpaced
            and arr >= p["arrival_excess"] * max(done, 1)
            and (
                (len(ttfts) >= 2 and ttfts[-1] >= p["ttft_trend"] * ttfts[0])
                or (len(itls) >= 2 and itls[-1] >= p["ttft_trend"] * itls[0])
                or _starved(run[0], run[-1], p)
            )
        ):
            # the largest backlog built, not the largest ratio: a ramp-up of 5 arrivals and
            # 2 completions has a higher ratio than a real overload of 40 and 20
            backlog = arr - done
            if best is None or backlog > best[0]:
                best = (backlog, arr / max(done, 1), run, ttfts, itls, waits)
    if best is None:
        return None
    _, ratio, run, ttfts, itls, waits = best
    # the latency that trended: TTFT where the backlog queued, ITL where it ran as a bigger batch
    ttft_up = len(ttfts) >= 2 and ttfts[-1] >= p["ttft_trend"] * ttfts[0]
    itl_up = len(itls) >= 2 and itls[-1] >= p["ttft_trend"] * itls[0]
    if ttft_up:
        lat, first_v, last_v = "TTFT p50", ttfts[0], ttfts[-1]
    elif itl_up:
        lat, first_v, last_v = "ITL p50", itls[0], itls[-1]
    first, last = run[0], run[-1]
    if not ttft_up and not itl_up:  # nothing completed to measure: the queue itself
        lat = "requests waiting"
        first_v, last_v = first.get("waiting_mean") or 0, last.get("waiting_mean") or 0
    arrivals = sum(w.get("arrivals", 0) or 0 for w in run)
    completions = sum(w.get("completions", 0) or 0 for w in run)
    # the test is the trend itself: every arrival of the run stands behind it, and it held in
    # each of the run's windows (an engine that reports no per-request queue time has no
    # example requests to count)
    support = Support(
        n=arrivals,
        unit="requests",
        reference=OWN_TEST,
        persistence=f"{len(run)} consecutive windows",
    )
    return Evidence(
        f"{arrivals} requests arrived but only {completions} completed in "
        f"{_clock(first.start_ns)}–{_clock(last.end_ns)} UTC; the requests in the engine "
        f"(waiting and running) grew from {waits[0]:.1f} to {waits[-1]:.1f} (waiting "
        f"{first.get('waiting_mean') or 0:.1f} to {last.get('waiting_mean') or 0:.1f}) and "
        + (
            f"{lat} from {_ms(first_v)} to {_ms(last_v)}"
            if lat != "requests waiting"
            else f"the last window completed nothing while {last_v:.1f} requests waited"
        ),
        {
            "arrivals": arrivals,
            "completions": completions,
            "arrival_rate_per_s": statistics.mean(w.get("arrival_rate") or 0 for w in run),
            "completion_rate_per_s": statistics.mean(w.get("completion_rate") or 0 for w in run),
            "waiting_first": first.get("waiting_mean"),
            "waiting_last": last.get("waiting_mean"),
            "in_engine_first": waits[0],
            "in_engine_last": waits[-1],
            "ttft_p50_first_ms": ttfts[0] if ttfts else None,
            "ttft_p50_last_ms": ttfts[-1] if ttfts else None,
            "itl_p50_first_ms": itls[0] if itls else None,
            "itl_p50_last_ms": itls[-1] if itls else None,
        },
        (first.start_ns, last.end_ns),
        "arrival_ns >= ? AND arrival_ns < ? AND queue_ms > 0.5 * ttft_ms",
        [first.start_ns, last.end_ns],
        _severity(ratio, p["arrival_excess"]),
        _confidence(
            ratio / p["arrival_excess"],
            (last_v / first_v) / p["ttft_trend"] if first_v else None,
        ),
        support=support,
    )


RULE = Rule(
    id="overload",
    own_test=OWN_TEST,
    title="arrivals exceed completions",
    symptom=(
        "arrivals outpace completions in every window of a run while the requests in the engine "
        "and TTFT (or ITL, where the backlog runs as a bigger batch) trend up together"
    ),
    causes=(
        "offered load above capacity",
        "capacity dropped (fewer workers, throttling, restart)",
    ),
    checks=("completion rate vs its baseline (capacity loss) vs arrival rate (load growth)",),
    knob="scale out, rate-limit tenants (requests_per_minute), --max-queue-len to fail fast with 429",
    params={
        "min_windows": Param(3, "consecutive windows to call it a trend"),
        "arrival_excess": Param(1.2, "arrivals / completions over those windows"),
        "window_excess": Param(
            0.9,
            "arrivals / completions in each of those windows, at least (a window in which the "
            "backlog's first requests complete may finish a few more than arrive; tune split: "
            "23 arrivals beside 25 completions while the requests in the engine still grew "
            "from 14 to 24)",
        ),
        "ttft_trend": Param(
            2.0,
            "TTFT p50 (or ITL p50, where the engine admits the backlog into its batch) at the "
            "end / at the start of the run",
        ),
        "min_queue_growth": Param(
            1.0,
            "mean requests in the engine (waiting and running) grows by at least one over the "
            "run, and by its share (1 / (min_windows - 1)) from each window to the next",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    # a batch grown past capacity slows every prefill in it: slow prefill of prompts of the
    # usual size is the backlog's
    explains=("ttft_queueing", "ttft_prefill_bound"),
    explains_when={"error_spike": _errors_are_overloads},
    evidence_signals=("arrival_rate", "completion_rate", "waiting_mean"),
    # arrivals over the run = finished requests + growth of the requests in flight; the
    # queue's and TTFT p50's first window is the one $run_offset back
    alert=Alert(
        name="TokenmillOverload",
        expr=(
            "(\n"
            "  (sum by ($by) (increase(tokenmill_requests_total[$run]))\n"
            "    + sum by ($by) (tokenmill_requests_in_flight"
            " - tokenmill_requests_in_flight offset $run))\n"
            "  / clamp_min(sum by ($by) (increase(tokenmill_requests_total[$run])), 1)\n"
            "  >= $arrival_excess\n"
            ")\n"
            "and (\n"
            "  sum by ($by) (avg_over_time(tokenmill_num_requests_waiting[$window]))\n"
            "  - sum by ($by) (avg_over_time(tokenmill_num_requests_waiting[$window]"
            " offset $run_offset))\n"
            "  >= $min_queue_growth\n"
            ")\n"
            "and ($ttft_p50 / ($ttft_p50 offset $run_offset) >= $ttft_trend)"
        ),
        value="arrivals / completions",
    ),
    reads=("requests", "completions", "steps"),
)
