"""Families read from another engine's scraped metrics (``engine_samples``), standing in for
ours where the store has no per-step records: ``steps_from_samples`` and ``kv_from_samples``.

A store that ``tokenmill proxy`` or ``tokenmill collect`` filled from vLLM, SGLang, llama.cpp,
TGI or a tokenmill server in another process has no ``engine_steps``; the engine's ``/metrics``
still says some of the same things, one scrape at a time (``telemetry/engine_metrics.py``):

- ``steps_from_samples`` yields the ``steps`` family's queue and batch keys: ``waiting_mean``
  and ``waiting_max`` (requests waiting, averaged and at most over the window's scrapes),
  ``running_mean`` and ``running_max`` (requests running). A scrape is an instant: these are
  the engine's gauges at the scrape times, where our step records see every step.
- ``kv_from_samples`` yields the ``kv`` family's ``kv_usage_mean``/``kv_usage_max`` (KV-cache
  use 0..1 at the scrapes), ``preemptions`` (the increase of the engine's preemption counter
  over the window, a counter reset read as a restart from 0; per URL and engine, each series'
  own resets undone by the scraper), and ``idle_kv_usage_max`` /
  ``idle_steps``: the KV use at scrapes that found nothing running or waiting, and how many
  did (a leak shows there, as in our idle heartbeats).

A NaN or ±Inf reading (an older store may hold one) is skipped, never a mean or a peak. Every
other key of the family they stand in for stays None (a rule that reads it decides
without it). Samples are bucketed by scrape time; the warm-up is not set apart (a scrape says
nothing about which requests it counted).
"""

from __future__ import annotations

from .family import Family, Yield
from .scope import Scope

# a reading that is not a number (NaN, ±Inf) is no reading: NULL, never a mean or a peak
_FINITE = "CASE WHEN isfinite({c}) THEN {c} END AS {c}"
_SAMPLES = "(SELECT time_ns, url, engine_kind, {cols} FROM engine_samples)"


def _finite(*cols: str) -> str:
    return _SAMPLES.format(cols=", ".join(_FINITE.format(c=c) for c in cols))


# the increase of a cumulative counter between one engine's consecutive scrapes (a reset: from
# 0; a scrape without it is passed over); the scraper sums an engine's series with each one's resets undone (CounterResets), so a
# drop here is the whole engine restarting (or the scraper)
_DELTA = """CASE WHEN {c} IS NULL THEN NULL
    WHEN lag({c} IGNORE NULLS) OVER w IS NULL THEN 0
    WHEN {c} >= lag({c} IGNORE NULLS) OVER w THEN {c} - lag({c} IGNORE NULLS) OVER w
    ELSE {c} END"""

_STEPS_SQL = f"""
SELECT (time_ns - $t0) // $w AS win,
    avg(waiting) AS waiting_mean,
    max(waiting) AS waiting_max,
    avg(running) AS running_mean,
    max(running) AS running_max
FROM {_finite("waiting", "running")} WHERE time_ns >= $since AND time_ns < $until
GROUP BY win
"""

_KV_SQL = f"""
SELECT (time_ns - $t0) // $w AS win,
    avg(kv_usage) AS kv_usage_mean,
    max(kv_usage) AS kv_usage_max,
    sum(preempted) AS preemptions,
    max(kv_usage) FILTER (WHERE running = 0 AND waiting = 0) AS idle_kv_usage_max,
    count(*) FILTER (WHERE running = 0 AND waiting = 0) AS idle_steps
FROM (SELECT time_ns, kv_usage, running, waiting, {_DELTA.format(c="preemptions_total")} AS preempted
      FROM {_finite("kv_usage", "running", "waiting", "preemptions_total")}
      WINDOW w AS (PARTITION BY url, engine_kind ORDER BY time_ns))
WHERE time_ns >= $since AND time_ns < $until
GROUP BY win
"""


_KV_KEYS = ("kv_usage_mean", "kv_usage_max", "preemptions", "idle_kv_usage_max", "idle_steps")


def _compute(sql: str):
    def compute(scope: Scope) -> Yield:
        return Yield(scope.by_window(sql, "time_ns", None), scope.over_range(sql, "time_ns"))

    return compute


STEPS_FROM_SAMPLES = Family(
    name="steps_from_samples",
    needs={"engine_samples": ("time_ns", "url", "waiting", "running")},
    window_keys=("waiting_mean", "waiting_max", "running_mean", "running_max"),
    overall_keys=("waiting_mean", "waiting_max", "running_mean", "running_max"),
    compute=_compute(_STEPS_SQL),
)

KV_FROM_SAMPLES = Family(
    name="kv_from_samples",
    needs={
        "engine_samples": ("time_ns", "url", "kv_usage", "preemptions_total", "running", "waiting")
    },
    window_keys=_KV_KEYS,
    overall_keys=_KV_KEYS,
    compute=_compute(_KV_SQL),
)
