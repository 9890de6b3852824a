"""Bursts of CPU use outside the server: the host's own record of a job that comes and goes.

The host sampler reads ``cpu_others_pct`` (CPU used by processes outside the server, % of all
CPUs) about ten times a second, and the process census ``loadgen_cpu_pct`` (tokenmill's own load
generator among them). A burst is a run of samples where the others, less the load generator,
used at least a threshold share of the CPU, lasting at least ``min_s``; runs less than
``merge_gap_s`` apart are one burst. A periodic job (a cron, a sampler, a backup) leaves bursts
on a grid; a sustained neighbour one long burst; a client process starting one short burst that
the requests it sends follow.

For each burst, the decode-only steps that overlapped it are compared with those of the same
batch size outside every burst: that is what the job cost the streams (:func:`burst_slowdown`);
:func:`quiet_between` says how busy the others were between the bursts (or a rule's stalls).
A store without host samples (a GPU, another engine's store, one recorded before the sampler)
yields no bursts.

Two of the server's own moments are not the host's: a load-generator process starting
(:func:`loadgen_starts`) and a run of the live diagnosis loop (:func:`own_runs`), whose CPU
slices may stretch the steps beside it on a small host, once per period.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

from .scope import store_has
from .window import Signals

_SAMPLES_SQL = """
SELECT time_ns, {outside}
FROM device_samples
WHERE kind = 'host' AND time_ns >= ? AND time_ns < ? AND cpu_others_pct IS NOT NULL
ORDER BY time_ns
"""

# the host samples of a span that fall within ``pad`` of none of the given stretches
_BETWEEN_SQL = """
WITH x AS (SELECT unnest(?::BIGINT[]) AS s, unnest(?::BIGINT[]) AS e)
SELECT avg({outside})
FROM device_samples
WHERE kind = 'host' AND time_ns >= ? AND time_ns <= ? AND cpu_others_pct IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM x WHERE time_ns BETWEEN s - ? AND e + ?)
"""

# decode-only steps inside any burst vs outside all of them, per batch size: the median of
# each batch size's ratio, weighted by its steps inside
_SLOWDOWN_SQL = """
WITH b AS (SELECT unnest(?::BIGINT[]) AS bs, unnest(?::BIGINT[]) AS be),
s AS (SELECT (end_ns - start_ns) / 1e6 AS ms, num_running,
             EXISTS (SELECT 1 FROM b WHERE start_ns < be AND end_ns > bs) AS inside
      FROM engine_steps
      WHERE start_ns >= ? AND start_ns < ? AND num_prefill_tokens = 0 AND num_decode_tokens > 0),
g AS (SELECT num_running,
             quantile_cont(ms, 0.5) FILTER (WHERE inside) AS in_ms,
             quantile_cont(ms, 0.5) FILTER (WHERE NOT inside) AS out_ms,
             count(*) FILTER (WHERE inside) AS n_in, count(*) FILTER (WHERE NOT inside) AS n_out
      FROM s GROUP BY num_running)
SELECT sum(n_in * in_ms / out_ms) / sum(n_in), sum(n_in), sum(n_in * in_ms) / sum(n_in),
       sum(n_in * out_ms) / sum(n_in)
FROM g WHERE n_in > 0 AND n_out >= ? AND out_ms > 0
"""


@dataclass(frozen=True)
class Burst:
    """A stretch of CPU use outside the server."""

    start_ns: int
    end_ns: int
    mean_pct: float  # the others' mean CPU share (% of all CPUs) in it, less the load generator

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True)
class Slowdown:
    """Decode-only steps during bursts against those of the same batch sizes outside them."""

    ratio: float  # weighted per batch size
    steps_inside: int
    inside_ms: float
    outside_ms: float


def _outside_cpu(sig: Signals) -> str | None:
    """The SQL of a host sample's CPU share used outside the server less the load generator's;
    None where the store has no host samples of it."""
    if sig.device_kind != "host" or not store_has(sig.con, "device_samples", "cpu_others_pct"):
        return None
    if store_has(sig.con, "device_samples", "loadgen_cpu_pct"):
        return "greatest(cpu_others_pct - coalesce(loadgen_cpu_pct, 0), 0)"
    return "cpu_others_pct"


def host_bursts(sig: Signals, min_pct: float, min_s: float, merge_gap_s: float) -> list[Burst]:
    """The range's bursts of outside CPU use (module docstring), by start."""
    outside = _outside_cpu(sig)
    if outside is None:
        return []
    rows = sig.con.execute(
        _SAMPLES_SQL.format(outside=outside), [sig.since_ns, sig.until_ns]
    ).fetchall()
    gap = int(merge_gap_s * 1e9)
    runs: list[list[tuple[int, float]]] = []
    for t, v in rows:
        if v < min_pct:
            continue
        # samples below the threshold end a run only when the next one above it comes later
        # than the merge gap
        if runs and t - runs[-1][-1][0] <= gap:
            runs[-1].append((t, v))
        else:
            runs.append([(t, v)])
    out = []
    for run in runs:
        # a run of one sample is a blip, not a burst
        start, end = run[0][0], run[-1][0]
        if len(run) < 2 or (end - start) / 1e9 < min_s:
            continue
        out.append(Burst(start, end, sum(v for _, v in run) / len(run)))
    return out


def quiet_between(sig: Signals, starts: list[int], ends: list[int], pad_s: float) -> float | None:
    """Mean CPU share used outside the server, less the load generator, between the stretches
    (``starts``/``ends``, ns, at least one) over their span: a periodic job leaves the host
    quiet between its bursts, a sustained neighbour does not. None without host samples."""
    outside = _outside_cpu(sig)
    if outside is None:
        return None
    pad = int(pad_s * 1e9)
    (v,) = sig.con.execute(
        _BETWEEN_SQL.format(outside=outside), [starts, ends, starts[0], ends[-1], pad, pad]
    ).fetchone()
    return v


def burst_slowdown(sig: Signals, bursts: list[Burst], min_outside: int) -> Slowdown | None:
    """How much slower the decode-only steps that overlapped a burst ran than those of the same
    batch size outside every burst (batch sizes with fewer than ``min_outside`` steps outside
    are left out); None when no step overlapped a burst."""
    if not bursts:
        return None
    row = sig.con.execute(
        _SLOWDOWN_SQL,
        [
            [b.start_ns for b in bursts],
            [b.end_ns for b in bursts],
            sig.since_ns,
            sig.until_ns,
            min_outside,
        ],
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return Slowdown(float(row[0]), int(row[1]), float(row[2]), float(row[3]))


def loadgen_starts(sig: Signals) -> list[int]:
    """When each load-generator process (tokenmill's own client, named by the process census)
    first shows in the census's busy list, by time: a client process starting takes the CPU
    for a moment, and the stall it makes is the benchmark's, not the host's."""
    if not store_has(sig.con, "device_samples", "busy_others"):
        return []
    rows = sig.con.execute(
        "SELECT time_ns, busy_others FROM device_samples WHERE kind = 'host' "
        "AND time_ns < ? AND busy_others LIKE '%\"load_generator\": true%' ORDER BY time_ns",
        [sig.until_ns],
    ).fetchall()
    seen: set[int] = set()
    out = []
    for t, text in rows:
        try:
            procs = json.loads(text)
        except ValueError:
            continue
        for proc in procs:
            if proc.get("load_generator") and proc.get("pid") not in seen:
                seen.add(proc.get("pid"))
                out.append(t)
    return out


#: the event a run of the live diagnosis loop leaves in the store (``diagnose/live_service.py``)
LIVE_RUN_EVENT = "live_diagnosis_run"


def own_runs(sig: Signals) -> list[tuple[int, int]]:
    """The live loop's own runs in the range, ``(start_ns, end_ns)`` by start: the moments a
    periodic stall may be the observer's own (it runs on a fixed period by design)."""
    if not store_has(sig.con, "events", "kind", "time_ns", "attributes"):
        return []
    rows = sig.con.execute(
        "SELECT time_ns, CAST(attributes->>'end_ns' AS BIGINT) FROM events "
        "WHERE kind = ? AND time_ns < ? AND coalesce(CAST(attributes->>'end_ns' AS BIGINT), "
        "time_ns) >= ? ORDER BY time_ns",
        [LIVE_RUN_EVENT, sig.until_ns, sig.since_ns],
    ).fetchall()
    return [(int(t), int(e if e is not None else t)) for t, e in rows]


def overlaps_any(runs: list[tuple[int, int]], start_ns: int, end_ns: int) -> bool:
    """Whether ``[start_ns, end_ns]`` meets one of the sorted, disjoint intervals ``runs``."""
    k = bisect.bisect_right(runs, (end_ns, float("inf")))
    return k > 0 and runs[k - 1][1] >= start_ns


def near_any(times: list[int], start_ns: int, end_ns: int) -> bool:
    """Whether one of the sorted ``times`` falls in ``[start_ns, end_ns]``."""
    k = bisect.bisect_left(times, start_ns)
    return k < len(times) and times[k] <= end_ns
