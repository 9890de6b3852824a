"""The console's live-findings queries (Now page): the findings the live diagnosis loop wrote to
the store's ``findings`` table (``diagnose/live.py``; ``telemetry/rows.py``: ``FindingRow``),
each at its current state (its latest row by ``finding_id``), the open ones, the recently
resolved ones, their spans for the timeline, and the latencies and queue beside them.

A finding spans ``opened_ns`` to ``resolved_ns``, or to ``now_ns`` while it is open. "Now" is
the store's newest row (:func:`store_now_ns`), as the sidebar's "Last N minutes" counts: on a
live source's mirror it trails the server's clock by at most the refresh; on a dump or closed
store the still-open findings are those open when its last row was written. A store from before the ``findings`` table, or one whose loop never
ran, holds none: :func:`findings_current` answers None (no table) or an empty frame.
Conventions: ``data_store.py``."""

from __future__ import annotations

import json

import duckdb
import pandas as pd

from .data_requests import latency_series
from .data_store import NS, _df, _time

#: a severity's rank: critical first
_SEVERITY_RANK = {"critical": 0, "warning": 1}

_COLUMNS = (
    "time_ns, finding_id, rule, status, severity, confidence, title, summary, first_seen_ns, "
    "opened_ns, last_seen_ns, resolved_ns, evidence, example_trace_ids, explained_by, "
    "runbook, knob"
)

_CURRENT_SQL = """
SELECT {cols}, coalesce(opened_ns, first_seen_ns) AS start_ns
FROM findings QUALIFY row_number() OVER (PARTITION BY finding_id ORDER BY time_ns DESC) = 1
"""


def _findings_columns(con) -> list[str] | None:
    """The ``findings`` table's columns as this connection sees it (a fleet's source or union),
    None when it has none."""
    try:
        return [d[0] for d in con.execute("SELECT * FROM findings LIMIT 0").description]
    except duckdb.CatalogException:
        return None


def has_findings(con) -> bool:
    """Whether the store has a ``findings`` table (a store written before it has none)."""
    return _findings_columns(con) is not None


def _evidence(text) -> dict:
    try:
        value = json.loads(text) if text else {}
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _ids(value) -> list[str]:
    return [str(v) for v in value] if value is not None and len(value) else []


def findings_current(con) -> pd.DataFrame | None:
    """One row per finding, at its latest state: the ``findings`` columns with ``evidence`` as a
    dict and the id lists as lists, ``start_ns`` (opened, else first seen), and ``source`` on a
    fleet's union. Open findings first (critical before warning, the newest first), then the
    resolved (the latest resolved first). None when the store has no ``findings`` table."""
    have = _findings_columns(con)
    if have is None:
        return None
    cols = _COLUMNS + (", source" if "source" in have else "")
    try:
        df = _df(con, _CURRENT_SQL.format(cols=cols))
    except duckdb.CatalogException:  # the table went away under a reopened snapshot
        return None
    df["evidence"] = [_evidence(e) for e in df["evidence"]]
    df["example_trace_ids"] = [_ids(v) for v in df["example_trace_ids"]]
    df["explained_by"] = [_ids(v) for v in df["explained_by"]]
    df["_open"] = (df["status"] != "open").astype(int)
    df["_sev"] = df["severity"].map(_SEVERITY_RANK).fillna(9)
    df["_when"] = -df["resolved_ns"].fillna(df["start_ns"]).astype("float64")
    df = df.sort_values(["_open", "_sev", "_when"], kind="stable").drop(
        columns=["_open", "_sev", "_when"]
    )
    return df.reset_index(drop=True)


def open_findings(con) -> pd.DataFrame:
    """The findings open now (their latest row says ``open``), critical first, newest first;
    empty when there are none or the store has no ``findings`` table."""
    df = findings_current(con)
    if df is None:
        return pd.DataFrame(columns=[c.strip() for c in _COLUMNS.split(",")] + ["start_ns"])
    return df[df["status"] == "open"].reset_index(drop=True)


def resolved_findings(con, since_ns: int, until_ns: int) -> pd.DataFrame:
    """The findings that resolved in ``[since_ns, until_ns)``, the latest first, with
    ``duration_s`` (opened to resolved) and ``opened``/``resolved`` as UTC datetimes."""
    df = findings_current(con)
    if df is None:
        df = pd.DataFrame(columns=["rule", "status", "start_ns", "resolved_ns"])
    df = df[
        (df["status"] == "resolved")
        & (df["resolved_ns"] >= since_ns)
        & (df["resolved_ns"] < until_ns)
    ].copy()
    df["duration_s"] = (df["resolved_ns"] - df["start_ns"]).astype("float64") / NS
    df = _time(df, "start_ns", "opened")
    df = _time(df, "resolved_ns", "resolved")
    return df.sort_values("resolved_ns", ascending=False).reset_index(drop=True)


def findings_spans(con, since_ns: int, until_ns: int, now_ns: int) -> pd.DataFrame:
    """The timeline's segments: each finding whose open span ``[start_ns, end_ns]`` (opened to
    resolved, or to ``now_ns`` while open) meets ``[since_ns, until_ns)``, oldest first:
    ``finding_id``, ``rule``, ``title``, ``severity``, ``status``, ``start_ns``, ``end_ns``,
    ``duration_s`` and ``start``/``end`` as UTC datetimes."""
    df = findings_current(con)
    keep = ["finding_id", "rule", "title", "severity", "status", "start_ns", "end_ns"]
    if df is None or df.empty:
        df = pd.DataFrame({c: pd.Series(dtype="int64" if c.endswith("_ns") else object)
                           for c in keep})  # fmt: skip
    else:
        df = df.copy()
        df["end_ns"] = df["resolved_ns"].where(df["status"] == "resolved", now_ns)
        df["end_ns"] = df["end_ns"].fillna(now_ns).astype("int64")
        df["start_ns"] = df["start_ns"].astype("int64")
        df = df[(df["end_ns"] >= since_ns) & (df["start_ns"] < until_ns)][keep]
    df["duration_s"] = (df["end_ns"] - df["start_ns"]).astype("float64") / NS
    df = _time(df, "start_ns", "start")
    df = _time(df, "end_ns", "end")
    return df.sort_values("start_ns", kind="stable").reset_index(drop=True)


def store_now_ns(con) -> int | None:
    """The newest time any request, step, sample, event or finding row holds (ns): the page's
    "now", on a live source's mirror (fetched every few seconds; an open finding writes a row
    every period) as on a dump; None for an empty store."""
    parts = [
        "SELECT max(end_ns) FROM requests",
        "SELECT max(end_ns) FROM engine_steps",
        "SELECT max(time_ns) FROM device_samples",
        "SELECT max(time_ns) FROM events",
    ]
    for table in (
        "engine_samples",
        "waiting_samples",
        "findings",
        "stream_samples",
    ):  # added tables: if there
        try:
            con.execute(f"SELECT time_ns FROM {table} LIMIT 0")
        except duckdb.CatalogException:
            continue
        parts.append(f"SELECT max(time_ns) FROM {table}")
    (t,) = con.execute(f"SELECT max(t) FROM ({' UNION ALL '.join(parts)}) x(t)").fetchone()
    return None if t is None else int(t)


_QUEUE_SQL = """
SELECT (arrival_ns - $since) // $w AS b,
    quantile_cont(queue_ms, 0.5) AS queue_p50_ms, quantile_cont(queue_ms, 0.99) AS queue_p99_ms
FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until AND queue_ms IS NOT NULL
GROUP BY b
"""


def now_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Per bucket, what the timeline draws under the findings: ``latency_series`` (TTFT and ITL
    p50/p99 by arrival, mean ``waiting_mean`` and ``running_mean`` from engine steps) and each
    bucket's queue time p50/p99 (ms, ``requests.queue_ms``, by arrival)."""
    df = latency_series(con, since_ns, until_ns, bucket_s)
    w = max(1, int(bucket_s * NS))
    queue = _df(con, _QUEUE_SQL, since=since_ns, until=until_ns, w=w)
    df = df.merge(queue, on="b", how="left") if not df.empty else df
    for c in ("queue_p50_ms", "queue_p99_ms"):
        if c not in df:
            df[c] = pd.Series(dtype="float64")
    return df
