"""``periodic_itl_spikes``: ITL spikes at a steady period."""

from __future__ import annotations

import itertools
import statistics

from ..signals import Signals
from ._common import Evidence, Param, Rule, _confidence


def detect(sig: Signals, p: dict) -> Evidence | None:
    # a median step of 0 ms (durations not measured) would make every step a "spike"
    rows = sig.con.execute(
        """
        WITH s AS (SELECT start_ns, (end_ns - start_ns) / 1e6 AS ms, num_running
                   FROM engine_steps WHERE start_ns >= ? AND start_ns < ?
                     AND num_prefill_tokens = 0 AND num_decode_tokens > 0)
        SELECT start_ns, ms, num_running FROM s, (SELECT quantile_cont(ms, 0.5) AS med FROM s)
        WHERE med > 0 AND ms >= ? * med ORDER BY start_ns
        """,
        [sig.since_ns, sig.until_ns, p["spike"]],
    ).fetchall()
    if len(rows) < p["min_spikes"]:
        return None
    times = [r[0] for r in rows]
    gaps = [(b - a) / 1e9 for a, b in itertools.pairwise(times)]
    period = statistics.median(gaps)
    if period <= 0:
        return None
    # a spike can be missed (it fell on a prefill step): gaps at 2x or 3x the period still count
    off = [abs(g / period - round(g / period)) for g in gaps if round(g / period) >= 1]
    regular = sum(1 for o in off if o <= p["max_cv"]) / len(gaps)
    on_period = [g for g in gaps if abs(g / period - 1) <= p["max_cv"]]
    cv = statistics.pstdev(on_period) / period if len(on_period) > 1 else 1.0
    if regular < p["min_regular"] or cv > p["max_cv"]:
        return None
    mean = statistics.mean(on_period)
    running = [r[2] for r in rows]
    return Evidence(
        f"{len(rows)} decode steps took ≥ {p['spike']:.0f}x the median step, every "
        f"{mean:.2f} s (period varies by {cv:.0%}), without a load change (running "
        f"{min(running)}–{max(running)}): something periodic (GC, a sampler, a cron, a checkpoint) "
        f"stalls the loop",
        {
            "spikes": len(rows),
            "period_s": mean,
            "period_cv": cv,
            "spike_ms_max": max(r[1] for r in rows),
        },
        (times[0], times[-1]),
        "first_token_ns < ? AND last_token_ns > ?",
        [times[-1], times[0]],
        "warning",
        _confidence(p["max_cv"] / max(cv, 1e-3), len(rows) / p["min_spikes"]),
    )


RULE = Rule(
    id="periodic_itl_spikes",
    title="ITL spikes at a steady period",
    symptom="decode steps spike at a regular interval without a load change",
    causes=(
        "garbage collection",
        "a periodic job on the host (sampler, logrotate, cron)",
        "checkpoints",
    ),
    checks=("spike period vs known periodic jobs",),
    knob="find the periodic job; pin the engine to its own cores",
    params={
        "spike": Param(5.0, "decode step vs the median decode step"),
        "min_spikes": Param(5, "spikes needed"),
        "max_cv": Param(0.2, "coefficient of variation of the spike period"),
        "min_regular": Param(0.8, "share of spike gaps that are a multiple of the period"),
    },
    detect=detect,
    healthy_baseline="absolute",
    evidence_signals=("step_ms_p99", "itl_max"),
)
