"""Warm-up set apart (seed 000, benchmark hygiene: a test states its warm-up, steady state,
overload and recovery, and does not read its warm-up as a symptom).

After each ``server_start`` or ``engine_restart`` event, the requests that arrive before the
first ``WARMUP_COMPLETIONS`` of them complete (at most ``WARMUP_MAX_S`` after the first arrival)
met cold caches, first allocations and any kernel compilation. They, and the engine steps that
start meanwhile, are left out of the per-window signals (so of the baseline and of every symptom
window); the overall signals keep them. ``Signals.warmup`` counts them.
"""

from __future__ import annotations

from tokenmill.telemetry.schema import COMPLETED_SQL

from .scope import NS, in_intervals

# warm-up after a (re)start: arrivals before the first completion, at most 30 s after the first
# arrival (one finished request has run the whole prefill + decode path once: every kernel
# compiled, the first blocks allocated; a server that never completes anything is not warming up)
WARMUP_EVENTS = ("server_start", "engine_restart")
WARMUP_COMPLETIONS = 1
WARMUP_MAX_S = 30.0


def warmup_intervals(con, since_ns: int, until_ns: int) -> list[tuple[int, int]]:
    """Arrival-time intervals ``[start_ns, end_ns)`` of warm-up within ``[since_ns, until_ns)``:
    from each ``server_start``/``engine_restart`` event (at or before ``until_ns``; one before
    ``since_ns`` counts when its warm-up reaches into the range) to the end of the
    ``WARMUP_COMPLETIONS``-th completed request that arrived after it, capped at
    ``WARMUP_MAX_S`` after its first arrival and at the next start event. Empty for a store
    without start events (a dump cut after the start, a synthetic store)."""
    starts = [
        t
        for (t,) in con.execute(
            "SELECT time_ns FROM events WHERE kind IN ? AND time_ns < ? ORDER BY time_ns",
            [list(WARMUP_EVENTS), until_ns],
        ).fetchall()
    ]
    out = []
    for i, start in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else until_ns
        (first,) = con.execute(
            "SELECT min(arrival_ns) FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?",
            [start, nxt],
        ).fetchone()
        if first is None:
            continue
        done = con.execute(
            f"SELECT end_ns FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? "
            f"AND {COMPLETED_SQL} ORDER BY end_ns LIMIT 1 OFFSET {WARMUP_COMPLETIONS - 1}",
            [start, nxt],
        ).fetchone()
        end = min(first + int(WARMUP_MAX_S * NS), nxt)
        if done is not None:
            end = min(end, done[0] + 1)  # the K-th completion's own arrival is inside
        lo, hi = max(start, since_ns), min(end, until_ns)
        if hi > lo:
            out.append((lo, hi))
    return out


def outside(column: str, intervals: list[tuple[int, int]]) -> str:
    """SQL: ``column`` lies in none of ``intervals`` (``TRUE`` when there are none)."""
    return f"NOT ({in_intervals(column, intervals)})" if intervals else "TRUE"
