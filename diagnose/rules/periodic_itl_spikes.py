"""``periodic_itl_spikes``: ITL spikes at a steady period."""

from __future__ import annotations

import bisect
import itertools
import math
import statistics

from ..signals import Signals
from ..signals.host_bursts import (
    Burst,
    burst_slowdown,
    host_bursts,
    loadgen_starts,
    near_any,
    overlaps_any,
    own_runs,
    quiet_between,
)
from ._common import Evidence, Param, Rule, _confidence

# the host's CPU use outside the server (or, on a GPU, other processes on the device) during
# the spike steps and during the other steps of the same span
_NEIGHBOUR_SQL = """
WITH spikes AS (SELECT unnest(?::BIGINT[]) AS s, unnest(?::BIGINT[]) AS e),
     d AS (SELECT time_ns, {value} AS v FROM device_samples
           WHERE kind = ? AND time_ns >= ? AND time_ns <= ? AND {value} IS NOT NULL)
SELECT avg(v) FILTER (WHERE EXISTS (SELECT 1 FROM spikes WHERE time_ns BETWEEN s AND e)),
       avg(v) FILTER (WHERE NOT EXISTS (SELECT 1 FROM spikes WHERE time_ns BETWEEN s AND e))
FROM d
"""


def _neighbour(sig: Signals, rows: list) -> tuple[float | None, float | None]:
    """Mean ``cpu_others_pct`` (host) or ``other_processes`` (GPU) in the device samples taken
    during the spike steps, and in those taken between them; None where there are none."""
    if sig.device_kind is None:
        return None, None
    value = "other_processes" if sig.device_kind == "gpu" else "cpu_others_pct"
    starts = [r[0] for r in rows]
    ends = [r[3] for r in rows]
    return sig.con.execute(
        _NEIGHBOUR_SQL.format(value=value),
        [starts, ends, sig.device_kind, starts[0], ends[-1]],
    ).fetchone()


def _causes(sig: Signals, p: dict, during: float | None, between: float | None):
    """A periodic job on the host first when the samples show a neighbour busy during the
    spikes and not between them; otherwise the rule's order."""
    host_job = during is not None and (
        during >= 1
        if sig.device_kind == "gpu"
        else during >= p["others_cpu_pct"] and during >= 2 * (between or 0)
    )
    if not host_job:
        return RULE.causes
    first = RULE.causes[1]
    return (first, *(c for c in RULE.causes if c != first))


def _spikes(slow: list, spike: float, max_gap: int) -> list[tuple[int, float, int, int]]:
    """Slow decode steps (``(i, start_ns, ms, num_running, end_ns, median_ms, usual_ms)``,
    ``usual_ms`` the median of the steps of the same batch size, ``i`` the
    step's place among all steps: a long prefill step between two decode steps keeps them
    apart) → spikes ``(start_ns, ms, num_running, end_ns)``.
    A spike is a run of slow steps, at most ``max_gap`` usual-speed steps apart, lasting
    ``spike`` x the median step in all: a process stalled outright stretches one step, a CPU
    shared for a second slows most of the steps it overlaps (the scheduler lets one through at
    full speed now and then), and the client sees one bump in ITL either way."""
    out: list[tuple[int, float, int, int]] = []
    run: list = []
    for row in [*slow, None]:
        if run and (row is None or row[0] > run[-1][0] + 1 + max_gap):
            ms = sum(r[2] for r in run)
            if ms >= spike * max(r[6] for r in run):
                out.append((run[0][1], ms, max(r[3] for r in run), run[-1][4]))
            run = []
        if row is not None:
            run.append(row)
    return out


def _on_grid(times: list[int], ends: list[int], period_s: float, tol: float) -> list[bool]:
    """Which spikes (start and end times, ns) fall on one grid of about ``period_s``.

    Each spike gets a cycle number, counted in periods from the last spike that began within
    ``tol`` periods of its cycle; a spike that began off its cycle but ran on into the next
    grid point takes that point's cycle, unless a spike that began near it holds it. A line
    through (cycle, start) is fitted by least squares on the spikes that began near their
    cycle (on all of them when those cover fewer than two cycles), refitted on those within
    ``tol`` of it, and a spike is on the grid when its grid point lies between its start and
    its end (give or take ``tol``).
    Counting spikes on the grid rather than gaps of one period lets a missed spike (it fell on
    a prefill step: a gap of 2 or 3 periods) and one extra spike off the grid (a slow step
    after the job: one period split in two) each cost one spike, not two gaps; the fit keeps
    a long window's grid from drifting off the period's rounding. A stall whose slow steps
    began well before the job's burst and ran on through it (a prefill the burst slowed, the
    tail of another stall) holds its grid point inside it rather than at its start."""
    ts = [(t - times[0]) / 1e9 for t in times]
    te = [(e - times[0]) / 1e9 for e in ends]
    cycles, near, ref = [0], [True], 0  # ref: the last spike that began near its cycle
    moved = []  # spikes given the cycle of a grid point they ran into
    for i in range(1, len(ts)):
        n = (ts[i] - ts[ref]) / period_s
        cycles.append(cycles[ref] + round(n))
        near.append(abs(n - round(n)) <= tol)
        if near[-1]:
            ref = i
        else:
            # the first cycle the stall reaches, if it reaches one before it ends
            k = math.ceil(n - tol)
            if k <= (te[i] - ts[ref]) / period_s + tol:
                cycles[-1] = cycles[ref] + k
                moved.append(i)
    held = {c for c, nr in zip(cycles, near, strict=True) if nr}
    # a grid point counts once: a spike that began near it holds it over one that ran into it
    twice = {i for i in moved if cycles[i] in held}
    fit = near if len(held) >= 2 else [True] * len(ts)
    for _ in range(2):
        pts = [(c, t) for c, t, f in zip(cycles, ts, fit, strict=True) if f]
        if len({c for c, _ in pts}) < 2:
            return fit
        mc = statistics.mean(c for c, _ in pts)
        mt = statistics.mean(t for _, t in pts)
        slope = sum((c - mc) * (t - mt) for c, t in pts) / sum((c - mc) ** 2 for c, _ in pts)
        if slope <= 0:
            return [False] * len(ts)
        line = [mt + slope * (c - mc) for c in cycles]
        fit = [abs(t - x) <= tol * slope for t, x in zip(ts, line, strict=True)]
    return [
        i not in twice and t - tol * slope <= x <= e + tol * slope
        for i, (t, e, x) in enumerate(zip(ts, te, line, strict=True))
    ]


MIN_SAME_BATCH_STEPS = 5


def decode_stalls(
    sig: Signals, p: dict | None = None, *, judged_only: bool = False
) -> list[tuple[int, float, int, int]]:
    """Stalls of decode-only steps (no prefill in them), periodic or not: ``(start_ns, ms,
    num_running, end_ns)`` per run of slow steps (``_spikes``), with this rule's thresholds
    (``p``, default its params). A disturbance from outside the engine slows steps whatever
    they carry; a prefill slows only the steps that carry it (itl_prefill_interference asks).
    ``judged_only``: only steps of a batch size seen MIN_SAME_BATCH_STEPS times (a batch that
    grew past anything before it, under a load that keeps rising, is slower for its work)."""
    p = p or {k: v.default for k, v in RULE.params.items()}
    # a step is slow against the decode-only steps of its own batch size where there are
    # MIN_SAME_BATCH_STEPS of them (and never against less than the median of all): a burst of
    # arrivals grows the batch, and the bigger batch's steps are slower for their work, not
    # stalled (a healthy run with clumped arrivals read as a periodic job)
    # a median step of 0 ms (durations not measured) would make every step a "spike"
    slow = sig.con.execute(
        """
        WITH a AS (SELECT row_number() OVER (ORDER BY start_ns) AS i, start_ns, end_ns,
                          (end_ns - start_ns) / 1e6 AS ms, num_running,
                          num_prefill_tokens = 0 AND num_decode_tokens > 0 AS decode_only
                   FROM engine_steps WHERE start_ns >= ? AND start_ns < ?),
             s AS (SELECT i, start_ns, end_ns, ms, num_running FROM a WHERE decode_only),
             b AS (SELECT num_running, quantile_cont(ms, 0.5) AS med_b, count(*) AS n_b
                   FROM s GROUP BY num_running)
        SELECT i, start_ns, ms, s.num_running, end_ns, med,
               CASE WHEN n_b >= ? THEN greatest(med_b, med) ELSE med END AS usual
        FROM s JOIN b USING (num_running), (SELECT quantile_cont(ms, 0.5) AS med FROM s)
        WHERE med > 0 AND ms >= ? * usual AND (NOT ? OR n_b >= ?) ORDER BY start_ns
        """,
        [
            sig.since_ns,
            sig.until_ns,
            MIN_SAME_BATCH_STEPS,
            p["slow_step"],
            judged_only,
            MIN_SAME_BATCH_STEPS,
        ],
    ).fetchall()
    return _spikes(slow, p["spike"], int(p["max_gap_steps"]))


# arrivals of requests (the client's and the API's work on them: tokenizing, a client process
# starting) and the first scheduling of their prompts, in the range
_ARRIVALS_SQL = """
SELECT arrival_ns FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?
UNION ALL
SELECT scheduled_ns FROM requests WHERE scheduled_ns >= ? AND scheduled_ns < ?
ORDER BY 1
"""


def arrival_locked(sig: Signals, rows: list, lead_s: float) -> tuple[float, float]:
    """How tied the stalls are to the traffic: the share of stalls (``(start_ns, ms, running,
    end_ns)``) with a request arriving or first scheduled from ``lead_s`` before the stall
    began to its end, and the share of the same stretches laid evenly over the stalls' span
    that have one by chance. A periodic job keeps its period whatever arrives; stalls that
    come with arrivals are the traffic's (clumped arrivals, client processes starting)."""
    lead = int(lead_s * 1e9)
    first, last = rows[0][0], rows[-1][3]
    events = [
        t
        for (t,) in sig.con.execute(
            _ARRIVALS_SQL, [first - lead, last, first - lead, last]
        ).fetchall()
    ]

    def has(a: int, b: int) -> bool:
        k = bisect.bisect_left(events, a)
        return k < len(events) and events[k] <= b

    locked = sum(has(s - lead, e) for s, _, _, e in rows) / len(rows)
    length = int(statistics.median(e - s for s, _, _, e in rows)) + lead
    n = 200
    starts = (
        [first + (last - first - length) * k // n for k in range(n)]
        if last - first > length
        else [first]
    )
    chance = sum(has(a, a + length) for a in starts) / len(starts)
    return locked, chance


def _periodicity(starts: list[int], ends: list[int], p: dict):
    """``(period_s, grid, on_period gaps, cv)`` of events (start and end times, ns): the
    median gap, which events fall on one grid of it (``_on_grid``), the gaps between two
    on-grid events within ``max_cv`` of the period, and their coefficient of variation (1.0
    with fewer than two); None when the median gap is not positive."""
    gaps = [(b - a) / 1e9 for a, b in itertools.pairwise(starts)]
    period = statistics.median(gaps)
    if period <= 0:
        return None
    grid = _on_grid(starts, ends, period, p["max_cv"])
    on_period = [
        g for g, a, b in zip(gaps, grid, grid[1:], strict=False)
        if a and b and abs(g / period - 1) <= p["max_cv"]
    ]  # fmt: skip
    cv = statistics.pstdev(on_period) / period if len(on_period) > 1 else 1.0
    return period, grid, on_period, cv


def arrivals_after(sig: Signals, bursts: list[Burst], lag_s: float) -> float | None:
    """Arrivals per second from each burst's start to ``lag_s`` after its end, against the
    arrival rate over the bursts' span: a client process starting (the load generator's) is a
    burst its requests follow; a job keeps its period whatever arrives."""
    lag = int(lag_s * 1e9)
    first, last = bursts[0].start_ns, bursts[-1].end_ns
    (total,) = sig.con.execute(
        "SELECT count(*) FROM requests WHERE arrival_ns >= ? AND arrival_ns <= ?", [first, last]
    ).fetchone()
    if not total or last <= first:
        return None
    (near,) = sig.con.execute(
        "WITH b AS (SELECT unnest(?::BIGINT[]) AS s, unnest(?::BIGINT[]) AS e) "
        "SELECT count(*) FROM requests, b WHERE arrival_ns BETWEEN s AND e + ?",
        [[b.start_ns for b in bursts], [b.end_ns for b in bursts], lag],
    ).fetchone()
    near_s = sum(b.seconds + lag_s for b in bursts)
    return (near / near_s) / (total / ((last - first) / 1e9))


def _host_job(sig: Signals, p: dict, starting: list[int]) -> Evidence | None:
    """The host's own record of a job that comes and goes (``signals/host_bursts.py``): bursts
    of outside CPU use on one period, the host quiet between them, not followed by arrivals,
    and the decode steps they overlapped slower than their batch size's usual. ``starting``:
    when our own client processes started (``loadgen_starts``)."""
    lag = int(p["census_lag_s"] * 1e9)
    bursts = [
        b
        for b in host_bursts(sig, p["others_cpu_pct"], p["burst_min_s"], p["burst_merge_s"])
        if not near_any(starting, b.start_ns, b.start_ns + lag)
    ]
    if len(bursts) < p["min_spikes"]:
        return None
    starts, ends = [b.start_ns for b in bursts], [b.end_ns for b in bursts]
    got = _periodicity(starts, ends, p)
    if got is None:
        return None
    period, grid, on_period, cv = got
    # start-up bursts of other processes fall off the grid: count the ones on it
    if sum(grid) < p["min_spikes"] or len(on_period) < p["min_spikes"] - 1 or cv > p["max_cv"]:
        return None
    busy_s = statistics.median(b.seconds for b in bursts)
    if busy_s > p["max_duty"] * period:
        return None
    between = quiet_between(sig, starts, ends, p["burst_merge_s"])
    if between is not None and between >= p["others_cpu_pct"] / 2:
        return None  # a sustained neighbour whose share wavers (host_contention's)
    follow = arrivals_after(sig, bursts, p["arrival_lead_s"] * 2)
    if follow is not None and follow >= p["max_arrivals_after"]:
        return None
    slow = burst_slowdown(sig, bursts, MIN_SAME_BATCH_STEPS)
    if slow is None or slow.ratio < p["burst_slowdown"]:
        return None
    # steps that outlast the period ran through the bursts and the gaps alike: the engine was
    # starved throughout (a sustained neighbour the samples see in pulses), not stalled now
    # and then
    if slow.inside_ms / 1e3 > p["max_duty"] * period:
        return None
    mean = statistics.mean(on_period)
    pct = statistics.median(b.mean_pct for b in bursts)
    return Evidence(
        f"{sum(grid)} bursts of CPU use outside the server ({pct:.0f}% of the host for "
        f"{busy_s:.1f} s) every {mean:.2f} s (period varies by {cv:.0%}), the host quiet "
        f"between them ({between or 0:.0f}%); decode steps during them took "
        f"{slow.inside_ms:.0f} ms against {slow.outside_ms:.0f} ms for the same batch sizes "
        f"outside (×{slow.ratio:.1f}): a periodic job on the host stalls the loop",
        {
            "spikes": sum(grid),
            "period_s": mean,
            "period_cv": cv,
            "burst_s_p50": busy_s,
            "arrivals_after_bursts": follow,
            "step_slowdown": slow.ratio,
            "steps_in_bursts": slow.steps_inside,
            "neighbour_during_spikes": pct,
            "neighbour_between_spikes": between,
        },
        (starts[0], ends[-1]),
        "first_token_ns < ? AND last_token_ns > ?",
        [ends[-1], starts[0]],
        "warning",
        _confidence(p["max_cv"] / max(cv, 1e-3), sum(grid) / p["min_spikes"]),
        causes=(RULE.causes[1], *(c for c in RULE.causes if c != RULE.causes[1])),
    )


def detect(sig: Signals, p: dict) -> Evidence | None:
    starting = loadgen_starts(sig)
    return _from_stalls(sig, p, starting) or _host_job(sig, p, starting)


def _from_stalls(sig: Signals, p: dict, starting: list[int]) -> Evidence | None:
    """Decode-only stalls on one period (a job on the host, GC, a checkpoint)."""
    lead, lag = int(p["arrival_lead_s"] * 1e9), int(p["census_lag_s"] * 1e9)
    # a stall while one of our own clients started is the benchmark's; one during a run of
    # the live loop (on its fixed period by design) is the observer's, whose cost is measured
    # on its own (tokenmill_diagnosis_cpu_seconds_total)
    runs = [(s, e + int(p["own_run_margin_s"] * 1e9)) for s, e in own_runs(sig)]
    stalls = [
        r
        for r in decode_stalls(sig, p, judged_only=True)
        if not near_any(starting, r[0] - lead, r[0] + lag)
    ]
    rows = [r for r in stalls if not overlaps_any(runs, r[0], r[3])]
    if len(rows) < p["min_spikes"]:
        return None
    times = [r[0] for r in rows]
    got = _periodicity(times, [r[3] for r in rows], p)
    if got is None:
        return None
    period, grid, on_period, cv = got
    regular = sum(grid) / len(times)
    if regular < p["min_regular"] or cv > p["max_cv"]:
        return None
    mean = statistics.mean(on_period)
    # a spike is a brief stall that recurs: slow steps back to back (a sustained slowdown, the
    # noisy neighbour of host_contention) have a "period" as long as the steps themselves
    spike_s = statistics.median(r[1] for r in rows) / 1e3
    if spike_s > p["max_duty"] * period:
        return None
    # stalls that come with the traffic's arrivals far more often than chance are the
    # traffic's: a job on the host keeps its period whatever arrives
    locked, chance = arrival_locked(sig, rows, p["arrival_lead_s"])
    if locked >= p["max_arrival_locked"] and locked - chance >= p["arrival_lock_excess"]:
        return None
    # a neighbour busy between the stalls as well is a sustained one (host_contention's),
    # its stalls where the traffic made the steps heavier
    quiet = quiet_between(sig, times, [r[3] for r in rows], p["burst_merge_s"])
    if quiet is not None and quiet >= p["others_cpu_pct"] / 2:
        return None
    running = [r[2] for r in rows]
    during, between = _neighbour(sig, rows)
    return Evidence(
        f"{len(rows)} times decode stalled for ≥ {p['spike']:.0f}x the median step, every "
        f"{mean:.2f} s (period varies by {cv:.0%}), without a load change (running "
        f"{min(running)}–{max(running)}): something periodic (GC, a sampler, a cron, a checkpoint) "
        f"stalls the loop"
        + (
            f"; processes outside the server used {during:.0f}% of the CPU during the spikes "
            f"and {between or 0:.0f}% between them"
            if during is not None and sig.device_kind == "host"
            else ""
        ),
        {
            "spikes": len(rows),
            "period_s": mean,
            "period_cv": cv,
            "spike_ms_max": max(r[1] for r in rows),
            "spike_ms_p50": spike_s * 1e3,
            "spikes_with_arrivals": locked,
            "arrivals_by_chance": chance,
            "neighbour_during_spikes": during,
            "neighbour_between_spikes": between,
            "stalls_during_own_runs": len(stalls) - len(rows),
        },
        (times[0], times[-1]),
        "first_token_ns < ? AND last_token_ns > ?",
        [times[-1], times[0]],
        "warning",
        _confidence(p["max_cv"] / max(cv, 1e-3), len(rows) / p["min_spikes"]),
        causes=_causes(sig, p, during, between),
    )


RULE = Rule(
    id="periodic_itl_spikes",
    # a 30 s range holds few periods: the factorial corpus's tune split opened it on the
    # healthy spec and pd twins after one period (benchmarks/live_tuning.py)
    live_open_after=2,
    own_test="min_spikes decode-only stalls on one period",
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
        "spike": Param(5.0, "a spike's time (its slow steps in a row) vs the median decode step"),
        "slow_step": Param(
            2.0,
            "a decode step this many times the median is slow; slow steps in a row are one spike",
        ),
        "max_gap_steps": Param(
            2,
            "usual-speed steps (decode or prefill) that may fall between two slow decode "
            "steps of one spike",
        ),
        "min_spikes": Param(
            4,
            "stalls needed, min_regular of them on one grid of the period (tune split: a job every 6 s one of whose "
            "bursts left no slow decode step showed 4 stalls at two 15 s windows; 5 took a "
            "third window)",
        ),
        "max_cv": Param(0.2, "coefficient of variation of the spike period"),
        "min_regular": Param(0.8, "share of spikes on one grid of the period"),
        "max_duty": Param(
            0.5,
            "median spike step / the period: above it the slow steps run back to back, a "
            "sustained slowdown rather than a recurring stall",
        ),
        "arrival_lead_s": Param(
            0.5,
            "a stall comes with an arrival when a request arrived or was first scheduled from "
            "this long before it began to its end (the client's and the API's work on a new "
            "request runs just before its prefill)",
        ),
        "max_arrival_locked": Param(
            0.6,
            "share of stalls that come with an arrival above which the stalls may be the "
            "traffic's, not a periodic job's",
        ),
        "arrival_lock_excess": Param(
            0.3,
            "and by this much more than stretches of the same length laid evenly over the span "
            "(chance): a job's stalls meet arrivals only as often as any moment does",
        ),
        "burst_min_s": Param(
            0.2, "a burst of CPU use outside the server lasts at least this long (s)"
        ),
        "burst_merge_s": Param(
            0.3, "host samples above others_cpu_pct this close together (s) are one burst"
        ),
        "burst_slowdown": Param(
            1.3,
            "decode steps during the bursts vs steps of the same batch size outside them: "
            "below it the job did not cost the streams",
        ),
        "census_lag_s": Param(
            1.5,
            "the process census lists a process up to this long after it started: a stall or "
            "burst that began this long or less before one of our own load-generator processes "
            "first showed in the census is that client starting",
        ),
        "max_arrivals_after": Param(
            2.0,
            "arrivals per second from a burst to 2 x arrival_lead_s after it vs the span's "
            "rate, above which the bursts are clients starting (tune split: clumps of a "
            "starting client 2.5-6, periodic jobs 0.7-1.4)",
        ),
        "own_run_margin_s": Param(
            1.0,
            "a stall that begins up to this long after a run of the live loop ended is still "
            "the run's (soak run 2: 110 of 301 decode steps of 5x the median began in the "
            "second after one)",
        ),
        "others_cpu_pct": Param(
            20.0,
            "CPU % used outside the server during the spikes that names a host job first "
            "(host_contention's threshold), and at least twice that between them",
        ),
    },
    detect=detect,
    healthy_baseline="absolute",
    # the periodic job is the more specific diagnosis: its period is how to find it
    # the periodic stall is what also slows a prefill step that meets it (its spikes are
    # decode-only steps: a prefill cannot make them)
    explains=("host_contention", "itl_prefill_interference"),
    evidence_signals=("step_ms_p99", "itl_max"),
    reads=("requests", "steps", "devices"),
    needs={
        "requests": ("first_token_ns", "last_token_ns", "scheduled_ns"),
        # read only where the store has them (the process census, the live loop's runs)
        "device_samples": ("busy_others",),
        "events": ("kind", "time_ns", "attributes"),
    },
)
