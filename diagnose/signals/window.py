"""What rules read: :class:`Window` (one time window's signals), :class:`Signals` (all of one
dump or time range) and :class:`NoTraffic`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import duckdb

from tokenmill.telemetry.recorded_config import RecordedConfig


class NoTraffic(Exception):
    """The store (or the chosen window) holds no requests."""


@dataclass
class Window:
    """One time window's signals. Latencies in ms, rates per second, ratios 0..1."""

    index: int
    start_ns: int
    end_ns: int
    values: dict[str, float | None] = field(default_factory=dict)

    def get(self, name: str, default=None):
        v = self.values.get(name)
        return default if v is None or (isinstance(v, float) and math.isnan(v)) else v


@dataclass
class Signals:
    """All signals of one dump (or one time range of it)."""

    start_ns: int
    end_ns: int
    window_s: float
    windows: list[Window]
    overall: dict[str, float | None]
    baseline: dict[str, float | None]
    config: RecordedConfig
    errors_by_type: dict[str, int]
    errors_by_window: dict[int, dict[str, int]]
    device_kind: str | None  # 'gpu', 'host' or None
    con: duckdb.DuckDBPyConnection
    since_ns: int
    until_ns: int
    # whether the dump's healthiest windows are healthy enough to be a baseline, and why not
    healthy_baseline: bool = True
    healthy_baseline_reason: str = ""
    healthy_windows: int = 0
    # the healthy windows' [start_ns, end_ns): the reference a finding's requests are tested
    # against (diagnose/stats.py)
    healthy_ranges: list[tuple[int, int]] = field(default_factory=list)
    busy_windows: int = 0
    # warm-up set apart: {"requests": n, "intervals": [[start_ns, end_ns], ...]}
    warmup: dict = field(default_factory=lambda: {"requests": 0, "intervals": []})
    # SQL for the sequences an engine_steps row decoded (its decode tokens less draft tokens)
    decode_seqs_sql: str = "num_decode_tokens"
    # the live loop's reference windows before the range as [start_ns, end_ns) spans
    reference_spans: tuple[tuple[int, int], ...] = ()
    # families the store could not feed: name -> the ``table.column`` names it lacks (their
    # keys are None)
    unavailable: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # families that ran from their fallback (another table saying the same thing): name -> the
    # fallback family's name (signals/samples.py)
    sources: dict[str, str] = field(default_factory=dict)
    # what a reader derived once from this range for the several rules that ask for it (by the
    # reader's name: ``queue_now.waiting_now``)
    memo: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def busy(self, min_arrivals: int = 1) -> list[Window]:
        """Windows with at least ``min_arrivals`` arrivals or completions."""
        return [
            w
            for w in self.windows
            if (w.get("arrivals", 0) or 0) >= min_arrivals
            or (w.get("completions", 0) or 0) >= min_arrivals
        ]

    def examples(self, where: str, params: list | None = None, limit: int = 5) -> list[str]:
        """Up to ``limit`` trace ids of requests matching ``where`` (SQL over ``requests``)."""
        rows = self.con.execute(
            f"SELECT trace_id FROM requests WHERE arrival_ns >= ? AND arrival_ns < ? AND ({where}) "
            f"ORDER BY arrival_ns LIMIT {int(limit)}",
            [self.since_ns, self.until_ns, *(params or [])],
        ).fetchall()
        return [r[0] for r in rows]
