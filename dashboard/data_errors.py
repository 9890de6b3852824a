"""The console's error queries (Errors page): errors per time bucket and type, each type's
examples, and the server's warning and error events. Conventions: ``data_store.py``."""

from __future__ import annotations

import pandas as pd

from .data_store import (
    _bucketed,
    _df,
    _time,
)


def errors_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Errors per bucket (by request end) and type: count and rate (errors/s)."""
    df = _bucketed(
        con,
        "SELECT (end_ns - $since) // $w AS b, error_type, count(*) AS errors FROM requests "
        "WHERE end_ns >= $since AND end_ns < $until AND error_type IS NOT NULL "
        "GROUP BY ALL ORDER BY b, error_type",
        since_ns,
        until_ns,
        bucket_s,
    )
    df["rate_per_s"] = df["errors"] / bucket_s
    return df


def error_examples(con, since_ns: int, until_ns: int, per_type: int = 5) -> pd.DataFrame:
    """Per error type (by request end): count, share of requests ended, first/last seen, HTTP
    statuses and up to ``per_type`` example trace ids (latest first)."""
    df = _df(
        con,
        """WITH e AS (SELECT * FROM requests WHERE end_ns >= $since AND end_ns < $until),
                n AS (SELECT count(*) AS ended FROM e)
           SELECT error_type, count(*) AS errors, count(*) / any_value(n.ended) AS share,
               min(end_ns) AS first_ns, max(end_ns) AS last_ns,
               list_sort(list_distinct(list(http_status))) AS http_statuses,
               list(trace_id ORDER BY end_ns DESC)[1:$k] AS example_trace_ids
           FROM e, n WHERE error_type IS NOT NULL GROUP BY error_type ORDER BY errors DESC""",
        since=since_ns,
        until=until_ns,
        k=int(per_type),
    )
    df = _time(df, "first_ns", "first_seen")
    df = _time(df, "last_ns", "last_seen")
    return df.drop(columns=["first_ns", "last_ns"])


def error_events(con, since_ns: int, until_ns: int, limit: int = 200) -> pd.DataFrame:
    """Server and engine events of severity warning or error (crashes, OOM, drops), latest
    first."""
    df = _df(
        con,
        "SELECT time_ns AS t_ns, kind, severity, message, attributes FROM events "
        "WHERE time_ns >= $since AND time_ns < $until AND severity IN ('warning', 'error') "
        "ORDER BY time_ns DESC LIMIT $limit",
        since=since_ns,
        until=until_ns,
        limit=int(limit),
    )
    return _time(df)
