"""What every console query shares, and the store as a whole.

Queries take an open connection (``telemetry.dump.open_dump``) and a half-open time window
``since_ns <= t < until_ns`` (wall-clock Unix ns) and return plain dicts/lists or pandas
DataFrames; nothing here imports Streamlit. User input only ever reaches DuckDB as a bound
parameter; the few SQL fragments chosen by an argument (a sort order, an optional filter) come
from fixed tables in the modules that use them.

Which rows a window holds: requests by ``arrival_ns`` (errors by ``end_ns``), engine steps by
``start_ns``, device samples and events by ``time_ns``. Units: latencies in ms, durations in s,
power in W, energy in J, memory in GiB, rates per s, shares 0..1. Percentiles follow
``tokenmill diagnose``: TTFT over completed requests; ITL p50 is the median of the requests' own
ITL p50, ITL p99 the 99th percentile of their own ITL p99.

Here: the helpers (:func:`_bucketed`: a query grouped into time buckets), the user's
the default goodput bounds (:data:`DEFAULT_SLO`), :func:`pick_bucket_s`, and the store's own facts (:func:`time_range`,
:func:`store_info`, :func:`engine_seen`).
"""

from __future__ import annotations

import duckdb
import pandas as pd

from tokenmill.telemetry.goodput import DEFAULT_GOODPUT
from tokenmill.telemetry.readers import store_engine
from tokenmill.telemetry.schema import COMPLETED_SQL

NS = 1_000_000_000
GIB = float(1 << 30)
OK_SQL = COMPLETED_SQL
_NICE_BUCKETS_S = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


#: the SLOs a query takes when none is given
DEFAULT_SLO = DEFAULT_GOODPUT


def _q(con, sql: str, **params) -> duckdb.DuckDBPyConnection:
    return con.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})


def _one(con, sql: str, **params) -> dict:
    cur = _q(con, sql, **params)
    cols = [d[0] for d in cur.description]
    row = cur.fetchone()
    return dict(zip(cols, row, strict=True)) if row else {c: None for c in cols}


def _df(con, sql: str, **params) -> pd.DataFrame:
    return _q(con, sql, **params).df()


def _time(df: pd.DataFrame, col: str = "t_ns", name: str = "time") -> pd.DataFrame:
    """Add a UTC datetime column ``name`` from a ns column."""
    if not df.empty:
        df[name] = pd.to_datetime(df[col].astype("int64"), unit="ns", utc=True)
    else:
        df[name] = pd.Series(dtype="datetime64[ns, UTC]")
    return df


def _div(a, b):
    return a / b if a is not None and b else None


def _bucketed(
    con, sql: str, since_ns: int, until_ns: int, bucket_s: float, **params
) -> pd.DataFrame:
    """``sql`` (grouped by ``b``: ``(<time> - $since) // $w``) over the window in buckets of
    ``bucket_s``, with each bucket's start as ``t_ns`` and ``time`` (UTC)."""
    w = max(1, int(bucket_s * NS))
    df = _df(con, sql, since=since_ns, until=until_ns, w=w, **params)
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


# ----- the store -----


def engine_seen(con) -> str | None:
    """The engine another engine's store was collected from (``tokenmill proxy`` or
    ``collect``: the kind its scraped metrics name most), None for our own engine's store."""
    return store_engine(con)


def time_range(con) -> tuple[int, int] | None:
    """``(first, last + 1)`` ns over every table's own time, or None for an empty store."""
    lo, hi = con.execute(
        "SELECT min(t0), max(t1) FROM ("
        " SELECT min(arrival_ns) t0, max(end_ns) t1 FROM requests"
        " UNION ALL SELECT min(start_ns), max(end_ns) FROM engine_steps"
        " UNION ALL SELECT min(time_ns), max(time_ns) FROM device_samples"
        " UNION ALL SELECT min(time_ns), max(time_ns) FROM events)"
    ).fetchone()
    return None if lo is None else (int(lo), int(hi) + 1)


def store_info(con) -> dict:
    """Rows per table and the ``meta`` entries."""
    counts = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("requests", "spans", "engine_steps", "device_samples", "events")
    }
    meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    return {"counts": counts, "meta": meta}


def pick_bucket_s(since_ns: int, until_ns: int, points: int = 120) -> float:
    """A round bucket length (s) giving about ``points`` buckets over the window."""
    span_s = max((until_ns - since_ns) / NS, 0.001)
    for b in _NICE_BUCKETS_S:
        if span_s / b <= points:
            return float(b)
    return float(3600 * max(1, round(span_s / points / 3600)))
