"""Every query of the console: parameterized SQL over a trace store or dump (DuckDB).

Functions take an open connection (``telemetry.dump.open_dump``) and a half-open time window
``since_ns <= t < until_ns`` (wall-clock Unix ns) and return plain dicts/lists or pandas
DataFrames; nothing here imports Streamlit. User input only ever reaches DuckDB as a bound
parameter; the few SQL fragments chosen by an argument (a sort order, an optional filter) come
from fixed tables in this module.

Which rows a window holds: requests by ``arrival_ns`` (errors by ``end_ns``), engine steps by
``start_ns``, device samples and events by ``time_ns``. Units: latencies in ms, durations in s,
power in W, energy in J, memory in GiB, rates per s, shares 0..1. Percentiles follow
``tokenmill diagnose``: TTFT over completed requests; ITL p50 is the median of the requests' own
ITL p50, ITL p99 the 99th percentile of their own ITL p99.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import duckdb
import pandas as pd

from tokenmill.telemetry.schema import (
    COMPLETED_SQL,
    DECODE_ONLY_STEP_SQL,
    DEVICE_PEAKS_SQL,
    GOOD_REQUEST_SQL,
    ROOFLINE_STEP_SQL,
    ROW_TYPES,
    SPEC_STEP_SQL,
    STATIONS,
    STEP_BYTES_SQL,
    STEP_DECODE_SEQS_SQL,
    STEP_GBPS_SQL,
    STEP_GFLOPS_SQL,
    STEP_INTENSITY_SQL,
    WORKING_STEP_SQL,
    columns,
    roofline_agg_sql,
    spec_agg_sql,
    sql_type,
)

NS = 1_000_000_000
GIB = float(1 << 30)
# clock-event reasons that mean the GPU is held back (not idle, not an app clock setting)
THROTTLE_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)
OK_SQL = COMPLETED_SQL
STATUS_SQL = (
    f"CASE WHEN {COMPLETED_SQL} THEN 'ok' "
    "WHEN finish_reason = 'abort' THEN 'aborted' "
    "WHEN queued_ns IS NULL THEN 'rejected' ELSE 'error' END"
)
STATUSES = ("ok", "error", "aborted", "rejected")
SORTS = {
    "e2e": "e2e_ms DESC NULLS LAST, arrival_ns",
    "ttft": "ttft_ms DESC NULLS LAST, arrival_ns",
    "itl": "itl_p99_ms DESC NULLS LAST, arrival_ns",
    "latest": "arrival_ns DESC",
}
_NICE_BUCKETS_S = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


@dataclass(frozen=True)
class Slo:
    """The user's service-level objectives (ms). A request is good when it completed and its
    TTFT, its own ITL p99 and its E2E latency are all within them."""

    ttft_ms: float = 2000.0
    itl_ms: float = 200.0
    e2e_ms: float = 60000.0


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


# ----- the store -----


def engine_seen(con) -> str | None:
    """The engine another engine's store was collected from (``tokenmill proxy`` or
    ``collect``: the kind its scraped metrics name most), None for our own engine's store."""
    from tokenmill.diagnose.coverage import store_engine

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


# ----- overview -----

_OVERVIEW_REQ_SQL = f"""
SELECT count(*) AS requests,
    count(*) FILTER (WHERE ok) AS completed,
    count(*) FILTER (WHERE error_type IS NOT NULL) AS errors,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE ok) AS ttft_p50_ms,
    quantile_cont(ttft_ms, 0.99) FILTER (WHERE ok) AS ttft_p99_ms,
    quantile_cont(itl_p50_ms, 0.5) FILTER (WHERE ok) AS itl_p50_ms,
    quantile_cont(itl_p99_ms, 0.99) FILTER (WHERE ok) AS itl_p99_ms,
    quantile_cont(tpot_ms, 0.5) FILTER (WHERE ok) AS tpot_p50_ms,
    quantile_cont(e2e_ms, 0.5) FILTER (WHERE ok) AS e2e_p50_ms,
    quantile_cont(e2e_ms, 0.99) FILTER (WHERE ok) AS e2e_p99_ms,
    count(*) FILTER (WHERE {GOOD_REQUEST_SQL}) AS good,
    sum(output_tokens) FILTER (WHERE ok) AS completed_output_tokens,
    sum(cached_tokens)::DOUBLE / nullif(sum(input_tokens), 0) AS prefix_hit_rate
FROM (SELECT *, {OK_SQL} AS ok FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until)
"""

_OVERVIEW_STEP_SQL = """
SELECT count(*) AS steps,
    sum(num_sampled) AS sampled_tokens,
    avg(num_running) AS running_mean,
    max(num_running) AS running_max,
    avg(num_waiting) AS waiting_mean,
    avg(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_mean,
    max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_max,
    arg_max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0), start_ns) AS kv_usage_last,
    sum(num_preempted) AS preemptions
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until
"""


def overview(con, since_ns: int, until_ns: int, slo: Slo = Slo()) -> dict:
    """The tiles: latency percentiles (ms), throughput (output tokens/s from engine steps),
    goodput (share of requests meeting ``slo`` and good requests/s), error rate, KV usage."""
    r = _one(
        con,
        _OVERVIEW_REQ_SQL,
        since=since_ns,
        until=until_ns,
        ttft=float(slo.ttft_ms),
        itl=float(slo.itl_ms),
        e2e=float(slo.e2e_ms),
    )
    s = _one(con, _OVERVIEW_STEP_SQL, since=since_ns, until=until_ns)
    duration_s = (until_ns - since_ns) / NS
    tokens = s["sampled_tokens"] if s["steps"] else r["completed_output_tokens"]
    out = {**r, **s, "duration_s": duration_s}
    out["throughput_tok_s"] = _div(float(tokens or 0), duration_s)
    out["goodput_share"] = _div(float(r["good"] or 0), r["requests"])
    out["goodput_rate_per_s"] = _div(float(r["good"] or 0), duration_s)
    out["error_rate"] = _div(float(r["errors"] or 0), r["requests"])
    out["request_rate_per_s"] = _div(float(r["requests"] or 0), duration_s)
    return out


_LAT_SERIES_SQL = f"""
SELECT (arrival_ns - $since) // $w AS b, count(*) AS requests,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE ok) AS ttft_p50_ms,
    quantile_cont(ttft_ms, 0.99) FILTER (WHERE ok) AS ttft_p99_ms,
    quantile_cont(itl_p50_ms, 0.5) FILTER (WHERE ok) AS itl_p50_ms,
    quantile_cont(itl_p99_ms, 0.99) FILTER (WHERE ok) AS itl_p99_ms,
    count(*) FILTER (WHERE error_type IS NOT NULL) AS errors
FROM (SELECT *, {OK_SQL} AS ok FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until)
GROUP BY b
"""

_CONC_SERIES_SQL = """
SELECT (start_ns - $since) // $w AS b, avg(num_running) AS running_mean,
    max(num_running) AS running_max, avg(num_waiting) AS waiting_mean,
    sum(num_sampled) AS sampled_tokens
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until GROUP BY b
"""


def latency_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Per bucket: requests, TTFT and ITL p50/p99 (ms, by arrival), concurrency (mean and max
    running, mean waiting, from engine steps) and output tokens/s. Column ``time``: the
    bucket start (UTC)."""
    w = max(1, int(bucket_s * NS))
    lat = _df(con, _LAT_SERIES_SQL, since=since_ns, until=until_ns, w=w)
    conc = _df(con, _CONC_SERIES_SQL, since=since_ns, until=until_ns, w=w)
    df = lat.merge(conc, on="b", how="outer").sort_values("b").reset_index(drop=True)
    df["throughput_tok_s"] = df["sampled_tokens"] / bucket_s
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


# ----- requests -----


def filter_options(con, since_ns: int, until_ns: int) -> dict:
    """Distinct tenants and finish reasons in the window (for the filters)."""
    tenants = _q(
        con,
        "SELECT DISTINCT tenant FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until "
        "AND tenant IS NOT NULL ORDER BY 1",
        since=since_ns,
        until=until_ns,
    ).fetchall()
    reasons = _q(
        con,
        "SELECT DISTINCT finish_reason FROM requests WHERE arrival_ns >= $since "
        "AND arrival_ns < $until AND finish_reason IS NOT NULL ORDER BY 1",
        since=since_ns,
        until=until_ns,
    ).fetchall()
    return {
        "tenants": [t for (t,) in tenants],
        "finish_reasons": [r for (r,) in reasons],
        "statuses": list(STATUSES),
    }


def requests_table(
    con,
    since_ns: int,
    until_ns: int,
    *,
    tenant: str | None = None,
    status: str | None = None,
    finish_reason: str | None = None,
    search: str | None = None,
    sort: str = "e2e",
    limit: int = 500,
) -> tuple[pd.DataFrame, int]:
    """Requests in the window, filtered and sorted (``sort``: e2e | ttft | itl | latest; the
    first three slowest first), at most ``limit`` rows; also the number matching.

    ``search`` matches the start of a trace id, request id or client request id.
    ``status``: ok | error | aborted | rejected.
    """
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(SORTS)}, not {sort!r}")
    conds = ["arrival_ns >= $since", "arrival_ns < $until"]
    params: dict = {"since": since_ns, "until": until_ns, "limit": int(limit)}
    if tenant:
        conds.append("tenant = $tenant")
        params["tenant"] = tenant
    if status:
        conds.append(f"({STATUS_SQL}) = $status")
        params["status"] = status
    if finish_reason:
        conds.append("finish_reason = $finish_reason")
        params["finish_reason"] = finish_reason
    if search and search.strip():
        conds.append(
            "(starts_with(trace_id, $search) OR starts_with(request_id, $search) "
            "OR starts_with(coalesce(client_request_id, ''), $search))"
        )
        params["search"] = search.strip()
    where = " AND ".join(conds)
    (total,) = _q(con, f"SELECT count(*) FROM requests WHERE {where}", **params).fetchone()
    df = _df(
        con,
        f"""SELECT arrival_ns AS t_ns, trace_id, request_id, client_request_id, tenant,
                   {STATUS_SQL} AS status, http_status, finish_reason, error_type,
                   ttft_ms, itl_p99_ms, e2e_ms, queue_ms, prefill_ms, decode_ms,
                   input_tokens, output_tokens, cached_tokens, preemptions, prefill_chunks
            FROM requests WHERE {where} ORDER BY {SORTS[sort]} LIMIT $limit""",
        **params,
    )
    df = _time(df, name="arrival")
    cols = ["arrival"] + [c for c in df.columns if c not in ("arrival", "t_ns")]
    return df[cols], int(total)


def request_detail(con, trace_id: str) -> dict | None:
    """One request: its ``requests`` row, its spans (ms from arrival; a ``kv_transfer`` span
    right after ``prefill``), its span events, its per-token times (ms from arrival: the first
    token, then the decode span's ITL list; one time per arrival, so the tokens of one
    speculative step share one tick) and its KV transfer (``kv_transfer``: :func:`_kv_transfer`,
    None when colocated).

    Returns None when no span or row has this trace id.
    """
    req = _q(con, "SELECT * FROM requests WHERE trace_id = $t LIMIT 1", t=trace_id)
    cols = [d[0] for d in req.description]
    row = req.fetchone()
    request = dict(zip(cols, row, strict=True)) if row else None
    spans = _df(
        con,
        "SELECT name, kind, span_id, parent_span_id, start_ns, end_ns, duration_ns, status_code, "
        "status_message, error_type, attributes, events FROM spans WHERE trace_id = $t "
        "ORDER BY start_ns",
        t=trace_id,
    )
    if request is None and spans.empty:
        return None
    roots = spans[spans["kind"] == "SERVER"]  # named `chat {model}` (`request` in older stores)
    if request is not None:
        t0 = int(request["arrival_ns"])
    elif not roots.empty:
        t0 = int(roots["start_ns"].iloc[0])
    else:
        t0 = int(spans["start_ns"].min())
    spans["start_ms"] = (spans["start_ns"] - t0) / 1e6
    spans["end_ms"] = (spans["end_ns"] - t0) / 1e6
    spans["duration_ms"] = spans["duration_ns"] / 1e6
    events: list[dict] = []
    tokens_ms: list[float] = []
    for s in spans.itertuples():
        for e in json.loads(s.events or "[]"):
            events.append(
                {
                    "span": s.name,
                    "name": e.get("name"),
                    "time_ms": (int(e.get("time_ns") or s.start_ns) - t0) / 1e6,
                    "attributes": e.get("attributes") or {},
                }
            )
        if s.name == "decode":
            attrs = json.loads(s.attributes or "{}")
            first = request.get("first_token_ns") if request else None
            t = ((int(first) if first else int(s.start_ns)) - t0) / 1e6
            tokens_ms = [t]
            for gap in attrs.get("tokenmill.decode.itl_ms") or []:
                t += float(gap)
                tokens_ms.append(t)
    if not tokens_ms and request and request.get("first_token_ns"):
        tokens_ms = [(int(request["first_token_ns"]) - t0) / 1e6]
    rows = (*STATIONS[: STATIONS.index("prefill") + 1], "kv_transfer")
    rows += STATIONS[STATIONS.index("prefill") + 1 :]
    order = {n: i for i, n in enumerate(rows)}
    spans["order"] = [
        -1 if kind == "SERVER" else order.get(n, len(order))
        for n, kind in zip(spans["name"], spans["kind"], strict=True)
    ]
    spans = spans.sort_values(["order", "start_ns"]).drop(columns=["order"])
    return {
        "trace_id": trace_id,
        "arrival_ns": t0,
        "request": request,
        "spans": spans.reset_index(drop=True),
        "events": sorted(events, key=lambda e: e["time_ms"]),
        "token_times_ms": tokens_ms,
        "kv_transfer": _kv_transfer(spans),
    }


def request_explanation(con, trace_id: str) -> dict | None:
    """One request's critical path (``tokenmill explain``'s JSON contract,
    :func:`tokenmill.diagnose.explain.explain`): parts that add up to its E2E, what it waited
    behind, its prompt blocks' cache misses. None when the store has no such request or
    cannot say (a fleet's union without the step columns)."""
    from tokenmill.diagnose.explain import ExplainError, explain

    try:
        return explain(con, trace_id)
    except (ExplainError, duckdb.Error):
        return None


def _kv_transfer(spans: pd.DataFrame) -> dict | None:
    """The request's ``kv_transfer`` span (prefill/decode disaggregation) in ms from arrival:
    ``start_ms``/``end_ms`` of the transfer, then ``wait_end_ms`` (the decode side adopted it
    after ``waited_ms`` more), ``ms``, ``bytes``; None for a colocated request."""
    moved = spans[spans["name"] == "kv_transfer"]
    if moved.empty:
        return None
    s = moved.iloc[0]
    attrs = json.loads(s["attributes"] or "{}")
    waited = float(attrs.get("tokenmill.kv_transfer.waited_ms") or 0.0)
    return {
        "start_ms": float(s["start_ms"]),
        "end_ms": float(s["end_ms"]),
        "wait_end_ms": float(s["end_ms"]) + waited,
        "ms": attrs.get("tokenmill.kv_transfer.ms"),
        "waited_ms": waited,
        "bytes": attrs.get("tokenmill.kv_transfer.bytes"),
    }


# ----- engine -----

# idle heartbeats (rows without tokens) keep their KV and queue columns but no step times
_STEP_COLS = f"""num_prefill_tokens AS prefill_tokens, num_decode_tokens AS decode_tokens,
    CASE WHEN {WORKING_STEP_SQL} THEN schedule_ms END AS schedule_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN forward_ms END AS forward_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN sample_ms END AS sample_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN prepare_ms END AS prepare_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN detokenize_ms END AS detokenize_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN output_send_ms END AS send_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN stream_write_ms END AS write_ms,
    CASE WHEN {WORKING_STEP_SQL} THEN (end_ns - start_ns) / 1e6 END AS step_ms,
    num_running AS running, num_waiting AS waiting, kv_blocks_used AS kv_used,
    kv_blocks_free AS kv_free, kv_blocks_cached AS kv_cached, kv_blocks_total AS kv_total,
    num_preempted AS preempted, prefix_hit_tokens, allocation_failures, num_sampled AS sampled"""

_STEP_BUCKET_SQL = f"""
SELECT (start_ns - $since) // $w AS b, count(*) FILTER (WHERE {WORKING_STEP_SQL}) AS steps,
    avg(num_prefill_tokens) FILTER (WHERE {WORKING_STEP_SQL}) AS prefill_tokens,
    avg(num_decode_tokens) FILTER (WHERE {WORKING_STEP_SQL}) AS decode_tokens,
    avg(schedule_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS schedule_ms,
    avg(forward_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS forward_ms,
    avg(sample_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS sample_ms,
    avg(prepare_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS prepare_ms,
    avg(detokenize_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS detokenize_ms,
    avg(output_send_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS send_ms,
    avg(stream_write_ms) FILTER (WHERE {WORKING_STEP_SQL}) AS write_ms,
    avg((end_ns - start_ns) / 1e6) FILTER (WHERE {WORKING_STEP_SQL}) AS step_ms, avg(num_running) AS running,
    avg(num_waiting) AS waiting, avg(kv_blocks_used) AS kv_used, avg(kv_blocks_free) AS kv_free,
    avg(kv_blocks_cached) AS kv_cached, max(kv_blocks_total) AS kv_total,
    sum(num_preempted) AS preempted, sum(prefix_hit_tokens) AS prefix_hit_tokens,
    sum(allocation_failures) AS allocation_failures, sum(num_sampled) AS sampled
FROM engine_steps WHERE start_ns >= $since AND start_ns < $until GROUP BY b ORDER BY b
"""


def _step_bucket_s(
    con, since_ns: int, until_ns: int, max_points: int, where: str = "TRUE"
) -> float | None:
    """None when the window holds at most ``max_points`` matching steps (draw each one), else the
    time bucket (s) to average them in."""
    (n,) = _q(
        con,
        f"SELECT count(*) FROM engine_steps WHERE start_ns >= $since AND start_ns < $until "
        f"AND {where}",
        since=since_ns,
        until=until_ns,
    ).fetchone()
    return None if n <= max_points else pick_bucket_s(since_ns, until_ns, points=max_points // 2)


def engine_steps(
    con, since_ns: int, until_ns: int, max_points: int = 2000
) -> tuple[pd.DataFrame, float | None]:
    """Engine steps in the window: one row per step when there are at most ``max_points``,
    else per time bucket (means per step; preemptions, prefix hits, allocation failures and
    sampled tokens summed). Returns the frame and the bucket length in s (None: per step)."""
    bucket_s = _step_bucket_s(con, since_ns, until_ns, max_points)
    if bucket_s is None:
        df = _df(
            con,
            f"SELECT start_ns AS t_ns, step_id, 1 AS steps, {_STEP_COLS} FROM engine_steps "
            "WHERE start_ns >= $since AND start_ns < $until ORDER BY start_ns",
            since=since_ns,
            until=until_ns,
        )
        return _time(df), None
    w = max(1, int(bucket_s * NS))
    df = _df(con, _STEP_BUCKET_SQL, since=since_ns, until=until_ns, w=w)
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df), bucket_s


def _step_fields() -> tuple[str, ...]:
    """The numeric fields of the step record (``engine_steps`` columns), ids and times left out;
    a boolean one (``compiled``) charts as 0/1, its bucket mean the share of steps."""
    import msgspec.inspect as mi

    skip = {"step_id", "engine_pid", "start_ns", "end_ns"}
    return tuple(
        f.name
        for f in mi.type_info(ROW_TYPES["engine_steps"]).fields
        if f.name not in skip and sql_type(f.type) in ("INTEGER", "BIGINT", "DOUBLE", "BOOLEAN")
    )


#: Every numeric field of the engine's step record, in record order: the Engine page's "any step
#: field" chart lists them, so a field added to ``StepRecord`` shows there with no console edit.
STEP_FIELDS = _step_fields()


def step_field_series(
    con, since_ns: int, until_ns: int, field: str, max_points: int = 2000
) -> tuple[pd.DataFrame, float | None]:
    """One step field over the window: ``time``, ``value`` per working step when there are at most
    ``max_points``, else the mean per time bucket; idle heartbeats count only for fields that
    describe the engine's state (queue and KV columns), not for per-step work and times.
    Returns the frame and the bucket length in s (None: per step).

    Raises:
        ValueError: ``field`` is not one of :data:`STEP_FIELDS`.
    """
    if field not in STEP_FIELDS:
        raise ValueError(f"unknown step field {field!r}; one of {', '.join(STEP_FIELDS)}")
    state = field.startswith(("num_running", "num_waiting", "kv_blocks"))
    where = "TRUE" if state else WORKING_STEP_SQL
    bucket_s = _step_bucket_s(con, since_ns, until_ns, max_points, where)
    if bucket_s is None:
        df = _df(
            con,
            f"SELECT start_ns AS t_ns, {field}::DOUBLE AS value FROM engine_steps "
            f"WHERE start_ns >= $since AND start_ns < $until AND {where} ORDER BY start_ns",
            since=since_ns,
            until=until_ns,
        )
        return _time(df), None
    w = max(1, int(bucket_s * NS))
    df = _df(
        con,
        f"SELECT $since + (start_ns - $since) // $w * $w AS t_ns, avg({field}::DOUBLE) AS value "
        f"FROM engine_steps WHERE start_ns >= $since AND start_ns < $until AND {where} "
        "GROUP BY 1 ORDER BY 1",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    return _time(df), bucket_s


def engine_summary(con, since_ns: int, until_ns: int) -> dict:
    """Totals over the window's steps: steps, step time (ms), prefill token share, preemptions,
    allocation failures, peak running/waiting, KV use; prefix-cache hit rate from requests.
    Idle heartbeats (rows without tokens) count for KV use only."""
    s = _one(
        con,
        f"""SELECT count(*) FILTER (WHERE working) AS steps,
               avg((end_ns - start_ns) / 1e6) FILTER (WHERE working) AS step_ms_mean,
               quantile_cont((end_ns - start_ns) / 1e6, 0.99) FILTER (WHERE working) AS step_ms_p99,
               sum(num_prefill_tokens)::DOUBLE
                   / nullif(sum(num_prefill_tokens + num_decode_tokens), 0) AS prefill_token_share,
               sum(num_preempted) AS preemptions, sum(allocation_failures) AS allocation_failures,
               max(num_running) AS running_max, max(num_waiting) AS waiting_max,
               max(kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0)) AS kv_usage_max,
               max(kv_blocks_total) AS kv_blocks_total
           FROM (SELECT *, {WORKING_STEP_SQL} AS working
                 FROM engine_steps WHERE start_ns >= $since AND start_ns < $until)""",
        since=since_ns,
        until=until_ns,
    )
    s.update(
        _one(
            con,
            "SELECT sum(cached_tokens)::DOUBLE / nullif(sum(input_tokens), 0) AS prefix_hit_rate "
            "FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until",
            since=since_ns,
            until=until_ns,
        )
    )
    return s


_ROOFLINE_KIND = "CASE WHEN num_prefill_tokens > 0 THEN 'prefill' ELSE 'decode' END"
_ROOFLINE_COLS = (
    "kind",
    "steps",
    "step_bytes",
    "flops_sum",
    "arith_intensity",
    "achieved_gbps",
    "achieved_gflops",
)


def roofline_steps(
    con, since_ns: int, until_ns: int, max_points: int = 2000
) -> tuple[pd.DataFrame, float | None]:
    """The window's steps on the roofline: ``kind`` (``prefill`` for a step with prefill
    tokens, ``decode`` for a decode-only one), ``steps``, ``step_bytes`` (bytes moved: weights +
    KV read + KV written), ``flops_sum`` (FLOP), ``arith_intensity`` (FLOP/byte),
    ``achieved_gbps`` (GB/s) and ``achieved_gflops`` (GFLOP/s) over ``forward_ms`` — one row per
    step when there are at most ``max_points``, else per time bucket and kind (sums over the
    bucket's forward time). The derivations are the store's (``telemetry.schema``: the
    ``STEP_*_SQL`` expressions and ``roofline_agg_sql``). Empty for a store from before the
    roofline fields. Returns the frame and the bucket length in s (None: per step)."""
    if "flops" not in columns(con, "engine_steps"):
        return pd.DataFrame(columns=["t_ns", *_ROOFLINE_COLS, "time"]), None
    bucket_s = _step_bucket_s(con, since_ns, until_ns, max_points, ROOFLINE_STEP_SQL)
    if bucket_s is None:
        df = _df(
            con,
            f"""SELECT start_ns AS t_ns, step_id, {_ROOFLINE_KIND} AS kind, 1 AS steps,
                   {STEP_BYTES_SQL} AS step_bytes, flops AS flops_sum,
                   {STEP_INTENSITY_SQL} AS arith_intensity, {STEP_GBPS_SQL} AS achieved_gbps,
                   {STEP_GFLOPS_SQL} AS achieved_gflops,
                   num_prefill_tokens AS prefill_tokens, num_decode_tokens AS decode_tokens,
                   forward_ms
                FROM engine_steps
                WHERE start_ns >= $since AND start_ns < $until AND {ROOFLINE_STEP_SQL}
                ORDER BY start_ns""",
            since=since_ns,
            until=until_ns,
        )
        return _time(df), None
    w = max(1, int(bucket_s * NS))
    df = _df(
        con,
        f"""SELECT $since + (start_ns - $since) // $w * $w AS t_ns, {_ROOFLINE_KIND} AS kind,
               {roofline_agg_sql()}
            FROM engine_steps
            WHERE start_ns >= $since AND start_ns < $until AND {ROOFLINE_STEP_SQL}
            GROUP BY ALL ORDER BY 1""",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df = df.rename(columns={"roofline_steps": "steps"})
    return _time(df), bucket_s


def device_peaks(con) -> dict:
    """The roofline's ceilings from the latest ``config`` event (``telemetry.schema.
    DEVICE_PEAKS_SQL``): ``peak_gbps`` (GB/s), ``peak_gflops`` (GFLOP/s), their sources
    (``flag``, ``table:<GPU>``, ``probe``), ``device_name`` and ``ridge`` (FLOP/byte: where the
    two ceilings meet); the figures None when the store has none."""
    peaks = _one(con, DEVICE_PEAKS_SQL)
    gbps, gflops = peaks.get("peak_gbps"), peaks.get("peak_gflops")
    peaks["ridge"] = gflops / gbps if gbps and gflops and gbps > 0 and gflops > 0 else None
    return peaks


def prefix_hit_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Per bucket (by arrival): prefix-cache hit rate = cached prompt tokens / prompt tokens."""
    w = max(1, int(bucket_s * NS))
    df = _df(
        con,
        "SELECT (arrival_ns - $since) // $w AS b, sum(cached_tokens)::DOUBLE "
        "/ nullif(sum(input_tokens), 0) AS prefix_hit_rate, sum(input_tokens) AS input_tokens "
        "FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until GROUP BY b ORDER BY b",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


# ----- speculative decoding -----

# output tokens per decode sequence: decode-only steps with drafts vs those without
_SPEC_TOKENS = f"""
    sum(num_sampled::DOUBLE) FILTER (WHERE {DECODE_ONLY_STEP_SQL} AND {SPEC_STEP_SQL})
        / nullif(sum({STEP_DECODE_SEQS_SQL})
                 FILTER (WHERE {DECODE_ONLY_STEP_SQL} AND {SPEC_STEP_SQL}), 0)
        AS tokens_per_seq_draft_steps,
    sum(num_sampled::DOUBLE) FILTER (WHERE {DECODE_ONLY_STEP_SQL} AND NOT {SPEC_STEP_SQL})
        / nullif(sum({STEP_DECODE_SEQS_SQL})
                 FILTER (WHERE {DECODE_ONLY_STEP_SQL} AND NOT {SPEC_STEP_SQL}), 0)
        AS tokens_per_seq_plain_steps,
    avg(forward_ms) FILTER (WHERE {DECODE_ONLY_STEP_SQL} AND {SPEC_STEP_SQL})
        AS forward_ms_draft_steps,
    avg(forward_ms) FILTER (WHERE {DECODE_ONLY_STEP_SQL} AND NOT {SPEC_STEP_SQL})
        AS forward_ms_plain_steps"""
_SPEC_COLS = (
    "spec_steps",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_accepted_per_draft",
    "tokens_per_seq_draft_steps",
    "tokens_per_seq_plain_steps",
    "forward_ms_draft_steps",
    "forward_ms_plain_steps",
)


def _has_spec(con) -> bool:
    """Whether the store's steps carry the speculative-decoding columns (a store written before
    them does not)."""
    cols = set(columns(con, "engine_steps"))
    return {"num_draft_tokens", "num_accepted_tokens_per_pos"} <= cols


def spec_decode_summary(con, since_ns: int, until_ns: int) -> dict:
    """Speculative decoding over the window's steps (``telemetry.schema.spec_agg_sql``):
    ``spec_steps`` (steps that verified drafts; 0 or None: speculation off in this window or
    store), drafts, draft and accepted tokens, ``spec_acceptance_rate`` (accepted / draft
    tokens), ``spec_accepted_per_draft``; and over decode-only steps, with drafts vs without,
    output tokens per decode sequence (``tokens_per_seq_*``: 1 + accepted tokens per sequence in
    a step with drafts; ``num_sampled`` counts every token a step produced) and the mean
    ``forward_ms_*``."""
    if not _has_spec(con):
        return {c: None for c in _SPEC_COLS}
    return _one(
        con,
        f"SELECT {spec_agg_sql()}, {_SPEC_TOKENS} FROM engine_steps "
        "WHERE start_ns >= $since AND start_ns < $until",
        since=since_ns,
        until=until_ns,
    )


def spec_decode_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Per time bucket (by step start) with steps that verified drafts or decode-only steps:
    the columns of :func:`spec_decode_summary` (acceptance rate = accepted / draft tokens in the
    bucket; tokens per decode sequence with and without drafts). Empty without the columns."""
    if not _has_spec(con):
        return _time(pd.DataFrame(columns=["b", "t_ns", *_SPEC_COLS]))
    w = max(1, int(bucket_s * NS))
    df = _df(
        con,
        f"SELECT (start_ns - $since) // $w AS b, {spec_agg_sql()}, {_SPEC_TOKENS} "
        "FROM engine_steps WHERE start_ns >= $since AND start_ns < $until "
        f"AND ({DECODE_ONLY_STEP_SQL} OR {SPEC_STEP_SQL}) GROUP BY b ORDER BY b",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


def collective_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Tensor parallelism per time bucket (by step start): ``decode_share`` and
    ``prefill_share``, the collectives' share of the forward (``collective_ms`` over
    ``forward_ms``, summed) in decode-only and in prefill steps, and ``collective_ms`` (mean a
    working step). Empty without tensor parallelism (no ``collective_ms``) in the window."""
    empty = _time(pd.DataFrame(columns=["b", "t_ns", "decode_share", "prefill_share"]))
    if "collective_ms" not in set(columns(con, "engine_steps")):
        return empty
    w = max(1, int(bucket_s * NS))
    decode = "num_prefill_tokens = 0 AND num_decode_tokens > 0"
    df = _df(
        con,
        "SELECT (start_ns - $since) // $w AS b, "
        f"sum(collective_ms) FILTER (WHERE {decode}) "
        f"/ nullif(sum(forward_ms) FILTER (WHERE {decode}), 0) AS decode_share, "
        "sum(collective_ms) FILTER (WHERE num_prefill_tokens > 0) "
        "/ nullif(sum(forward_ms) FILTER (WHERE num_prefill_tokens > 0), 0) AS prefill_share, "
        "avg(collective_ms) AS collective_ms "
        "FROM engine_steps WHERE start_ns >= $since AND start_ns < $until "
        "AND collective_ms IS NOT NULL GROUP BY b ORDER BY b",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    if df.empty:
        return empty
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


def replica_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Data parallelism per time bucket and replica (``engine_steps.replica``, idle heartbeats
    included): mean ``running`` and ``waiting`` requests, long format (``time``, ``replica``).
    Empty with fewer than two replicas in the window or in a store without the column. The
    prefill and decode cores of disaggregation (steps with a ``role``) are not replicas:
    :func:`pd_pool_series` shows them."""
    empty = _time(pd.DataFrame(columns=["b", "t_ns", "replica", "running", "waiting"]))
    step_cols = set(columns(con, "engine_steps"))
    if "replica" not in step_cols:
        return empty
    w = max(1, int(bucket_s * NS))
    colocated = "role IS NULL" if "role" in step_cols else "TRUE"
    df = _df(
        con,
        "SELECT (start_ns - $since) // $w AS b, replica, avg(num_running) AS running, "
        "avg(num_waiting) AS waiting FROM engine_steps "
        "WHERE start_ns >= $since AND start_ns < $until AND replica IS NOT NULL "
        f"AND {colocated} GROUP BY ALL ORDER BY b, replica",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    if df["replica"].nunique() < 2:
        return empty
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


def pd_pool_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Prefill/decode disaggregation per time bucket (by step start) and side
    (``engine_steps.role``, idle heartbeats included), long format (``time``, ``role``): mean
    ``waiting`` and ``running`` requests, ``held`` (the decode side's hand-offs whose KV arrived
    but wait for room, ``num_kv_waiting``; NULL on the prefill side and in stores without the
    field), ``busy`` (the share 0..1 of the bucket's wall time
    in working steps; a step counts in the bucket it starts in, capped at 1) and ``kv_use``
    (mean ``kv_blocks_used / kv_blocks_total``, 0..1). Empty when no step in the window has a
    role (colocated) or the store has no ``role`` column."""
    cols = ["b", "t_ns", "role", "waiting", "held", "running", "busy", "kv_use"]
    step_cols = set(columns(con, "engine_steps"))
    if "role" not in step_cols:
        return _time(pd.DataFrame(columns=cols))
    held = "num_kv_waiting" if "num_kv_waiting" in step_cols else "NULL::INTEGER"
    w = max(1, int(bucket_s * NS))
    df = _df(
        con,
        f"""WITH s AS (
                SELECT (start_ns - $since) // $w AS b, role, num_waiting, num_running,
                       {held} AS held,
                       CASE WHEN {WORKING_STEP_SQL} THEN end_ns - start_ns ELSE 0 END AS busy_ns,
                       kv_blocks_used::DOUBLE / nullif(kv_blocks_total, 0) AS kv
                FROM engine_steps
                WHERE start_ns >= $since AND start_ns < $until AND role IS NOT NULL)
            SELECT b, role, avg(num_waiting) AS waiting, avg(held) AS held,
                   avg(num_running) AS running,
                   least(1.0, sum(busy_ns) / least($w, $until - ($since + b * $w))) AS busy,
                   avg(kv) AS kv_use
            FROM s GROUP BY b, role ORDER BY b, role""",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)[[*cols, "time"]]


_PD_SUMMARY_COLS = (
    "transfers",
    "transfer_ms_p50",
    "transfer_ms_p99",
    "wait_ms_p50",
    "wait_ms_p99",
    "transfer_bytes_mean",
)


def pd_transfer_summary(con, since_ns: int, until_ns: int) -> dict:
    """The KV transfers of the requests that arrived in the window (prefill/decode
    disaggregation): ``transfers`` (requests with one), ``transfer_ms_p50``/``_p99``
    (``requests.kv_transfer_ms``), ``wait_ms_p50``/``_p99`` (``kv_wait_ms``: held on the
    decode side until it had room) and ``transfer_bytes_mean``. ``transfers`` 0 or None: none
    (colocated, or a store without the columns)."""
    if "kv_transfer_ms" not in set(columns(con, "requests")):
        return {c: None for c in _PD_SUMMARY_COLS}
    return _one(
        con,
        "SELECT count(kv_transfer_ms) AS transfers, "
        "quantile_cont(kv_transfer_ms, 0.5) AS transfer_ms_p50, "
        "quantile_cont(kv_transfer_ms, 0.99) AS transfer_ms_p99, "
        "quantile_cont(kv_wait_ms, 0.5) AS wait_ms_p50, "
        "quantile_cont(kv_wait_ms, 0.99) AS wait_ms_p99, "
        "avg(kv_transfer_bytes) AS transfer_bytes_mean "
        "FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until",
        since=since_ns,
        until=until_ns,
    )


def spec_acceptance_by_position(con, since_ns: int, until_ns: int) -> pd.DataFrame:
    """Accepted draft tokens by draft position (``position`` 0 = the first draft token) over the
    window's steps, from ``num_accepted_tokens_per_pos``: ``accepted`` and ``rate`` = accepted
    / drafts verified (vLLM's per-position acceptance rate: the share of drafts whose token at
    that position was accepted; a draft shorter than the position counts as not accepted).
    Empty when no step verified drafts."""
    cols = ["position", "accepted", "rate"]
    if not _has_spec(con):
        return pd.DataFrame(columns=cols)
    return _df(
        con,
        f"""WITH s AS (
                SELECT num_drafts, num_accepted_tokens_per_pos AS per_pos FROM engine_steps
                WHERE start_ns >= $since AND start_ns < $until AND {SPEC_STEP_SQL}),
            p AS (SELECT unnest(per_pos) AS n, generate_subscripts(per_pos, 1) - 1 AS position
                  FROM s)
            SELECT position, sum(n) AS accepted,
                   sum(n)::DOUBLE / nullif((SELECT sum(num_drafts) FROM s), 0) AS rate
            FROM p GROUP BY position ORDER BY position""",
        since=since_ns,
        until=until_ns,
    )


# ----- devices -----


def device_kind(con, since_ns: int, until_ns: int) -> str | None:
    """'gpu' when the window has GPU samples, else 'host' when it has host samples, else None."""
    kinds = {
        k
        for (k,) in _q(
            con,
            "SELECT DISTINCT kind FROM device_samples WHERE time_ns >= $since AND time_ns < $until",
            since=since_ns,
            until=until_ns,
        ).fetchall()
    }
    return "gpu" if "gpu" in kinds else ("host" if "host" in kinds else None)


_GPU_SQL = """
SELECT (time_ns - $since) // $w AS b, device_index, any_value(device_name) AS device_name,
    min(time_ns) AS t_ns, avg(power_w) AS power_w, max(energy_j) AS energy_j,
    avg(gpu_util_pct) AS sm_util_pct, avg(mem_util_pct) AS mem_util_pct,
    avg(dram_bw_util_pct) AS dram_bw_util_pct, avg(mem_used_bytes) / $gib AS mem_used_gib,
    max(mem_total_bytes) / $gib AS mem_total_gib, avg(sm_clock_mhz) AS sm_clock_mhz,
    avg(mem_clock_mhz) AS mem_clock_mhz, max(temperature_c) AS temperature_c,
    bool_or(list_has_any(coalesce(clock_event_reasons, []::VARCHAR[]), $throttle)) AS throttled,
    list_sort(list_distinct(flatten(list(coalesce(clock_event_reasons, []::VARCHAR[]))))) AS reasons,
    avg(pcie_rx_bytes_s) AS pcie_rx_bytes_s, avg(pcie_tx_bytes_s) AS pcie_tx_bytes_s
FROM device_samples WHERE kind = 'gpu' AND time_ns >= $since AND time_ns < $until
GROUP BY b, device_index ORDER BY device_index, b
"""

_HOST_SQL = """
SELECT (time_ns - $since) // $w AS b, any_value(device_name) AS device_name, min(time_ns) AS t_ns,
    avg(cpu_pct) AS cpu_pct, avg(load_1m) AS load_1m, avg(rss_bytes) / $gib AS rss_gib,
    avg(mem_used_bytes) / $gib AS mem_used_gib, max(mem_total_bytes) / $gib AS mem_total_gib
FROM device_samples WHERE kind = 'host' AND time_ns >= $since AND time_ns < $until
GROUP BY b ORDER BY b
"""


def device_series(con, since_ns: int, until_ns: int, max_points: int = 1500) -> dict:
    """Device samples in the window, averaged into at most about ``max_points`` buckets.

    Returns ``{"kind": 'gpu' | 'host' | None, "bucket_s", "df"}``. GPU rows per device: power
    (W), SM and memory-controller util and DRAM bandwidth util (%), memory (GiB), SM/memory
    clocks (MHz), temperature (°C, max), ``throttled`` (a power/thermal reason seen) and the
    reasons. Host rows (no GPU): CPU % (all cores), load, process RSS and host memory (GiB).
    """
    kind = device_kind(con, since_ns, until_ns)
    bucket_s = pick_bucket_s(since_ns, until_ns, points=max_points)
    w = max(1, int(bucket_s * NS))
    if kind == "gpu":
        df = _df(
            con,
            _GPU_SQL,
            since=since_ns,
            until=until_ns,
            w=w,
            gib=GIB,
            throttle=list(THROTTLE_REASONS),
        )
        df["reasons"] = df["reasons"].map(lambda r: ", ".join(r) if r is not None else "")
    elif kind == "host":
        df = _df(con, _HOST_SQL, since=since_ns, until=until_ns, w=w, gib=GIB)
    else:
        df = pd.DataFrame({"t_ns": pd.Series(dtype="int64")})
    return {"kind": kind, "bucket_s": bucket_s, "df": _time(df)}


_ENERGY_SQL = """
WITH d AS (
    SELECT time_ns,
        CASE WHEN energy_j IS NOT NULL AND lag(energy_j) OVER w IS NOT NULL
                  AND energy_j >= lag(energy_j) OVER w
             THEN energy_j - lag(energy_j) OVER w
             ELSE power_w * (time_ns - lag(time_ns) OVER w) / 1e9 END AS de
    FROM device_samples WHERE kind = 'gpu' AND time_ns >= $since AND time_ns < $until
    WINDOW w AS (PARTITION BY device_index ORDER BY time_ns))
SELECT (time_ns - $since) // $w AS b, sum(de) AS energy_j FROM d GROUP BY b
"""


def energy_per_token(con, since_ns: int, until_ns: int, bucket_s: float) -> dict:
    """Energy per output token (J/token) per bucket and overall: the GPUs' energy over the
    bucket (the NVML energy counter's increase, or power × time between samples where the
    counter is missing) / output tokens sampled by the engine in it. Empty without GPU rows."""
    w = max(1, int(bucket_s * NS))
    e = _df(con, _ENERGY_SQL, since=since_ns, until=until_ns, w=w)
    t = _df(
        con,
        "SELECT (start_ns - $since) // $w AS b, sum(num_sampled) AS output_tokens "
        "FROM engine_steps WHERE start_ns >= $since AND start_ns < $until GROUP BY b",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df = e.merge(t, on="b", how="left").sort_values("b").reset_index(drop=True)
    df["j_per_token"] = df["energy_j"] / df["output_tokens"].where(df["output_tokens"] > 0)
    df["t_ns"] = since_ns + df["b"] * w
    energy = float(df["energy_j"].sum()) if not df.empty else None
    (tokens,) = _q(
        con,
        "SELECT sum(num_sampled) FROM engine_steps WHERE start_ns >= $since AND start_ns < $until",
        since=since_ns,
        until=until_ns,
    ).fetchone()
    return {
        "df": _time(df),
        "energy_j": energy,
        "output_tokens": tokens,
        "j_per_token": _div(energy, tokens) if energy is not None else None,
    }


# ----- errors -----


def errors_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Errors per bucket (by request end) and type: count and rate (errors/s)."""
    w = max(1, int(bucket_s * NS))
    df = _df(
        con,
        "SELECT (end_ns - $since) // $w AS b, error_type, count(*) AS errors FROM requests "
        "WHERE end_ns >= $since AND end_ns < $until AND error_type IS NOT NULL "
        "GROUP BY ALL ORDER BY b, error_type",
        since=since_ns,
        until=until_ns,
        w=w,
    )
    df["rate_per_s"] = df["errors"] / bucket_s
    df["t_ns"] = since_ns + df["b"] * w
    return _time(df)


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


# ----- diagnosis -----


def diagnosis(con, since_ns: int, until_ns: int, window_s: float):
    """``tokenmill diagnose`` over the window (a :class:`~tokenmill.diagnose.findings.Report`),
    or None when no request arrived in it."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.diagnose.signals import NoTraffic

    try:
        return diagnose(con, since_ns=since_ns, until_ns=until_ns, window_s=window_s)
    except NoTraffic:
        return None


def signal_windows(con, since_ns: int, until_ns: int, window_s: float) -> pd.DataFrame:
    """The diagnoser's per-window signals (one row per window; ``time`` = window start) and the
    baseline of each latency signal as ``<name>__baseline`` columns."""
    from tokenmill.diagnose.signals import NoTraffic, load

    try:
        sig = load(con, since_ns=since_ns, until_ns=until_ns, window_s=window_s)
    except NoTraffic:
        return _time(pd.DataFrame({"t_ns": pd.Series(dtype="int64")}))
    rows = [{"t_ns": w.start_ns, "end_ns": w.end_ns, **w.values} for w in sig.windows]
    df = pd.DataFrame(rows)
    for k, v in sig.baseline.items():
        df[f"{k}__baseline"] = v
    return _time(df)


_DEFAULT_EVIDENCE = ("ttft_p99", "itl_p99", "throughput_tok_s")


def evidence_signals(rule_id: str, windows: pd.DataFrame) -> list[str]:
    """The per-window signals that show a rule's evidence (those with any value): the rule's own
    ``evidence_signals`` (``tokenmill.diagnose.rules``), else TTFT, ITL and throughput."""
    from tokenmill.diagnose.rules import RULES_BY_ID

    rule = RULES_BY_ID.get(rule_id)
    names = (rule.evidence_signals if rule else ()) or _DEFAULT_EVIDENCE
    return [n for n in names if n in windows and windows[n].notna().any()]


def runbook(rule_id: str) -> str | None:
    """The runbook Markdown of a rule (package data ``tokenmill.runbooks``), or None."""
    if not rule_id.replace("_", "").isalnum():
        return None
    try:
        return resources.files("tokenmill.runbooks").joinpath(f"{rule_id}.md").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return None


# ----- compare (views/compare.py) -----


def comparison(
    before_con,
    after_con,
    *,
    before_label: str,
    after_label: str,
    since_ns: int | None,
    until_ns: int | None,
    slo: Slo,
    threshold_pct: float,
    window_s: float = 10.0,
):
    """The baseline (BEFORE, all of it) against the source (AFTER, its requests arrived in
    ``[since_ns, until_ns)``) as a :class:`tokenmill.diagnose.compare.Comparison`, goodput
    against ``slo``; None when either holds no request there."""
    from tokenmill.diagnose.compare import CompareError, GoodputSlo, compare, measure
    from tokenmill.diagnose.signals import NoTraffic

    goodput = GoodputSlo(float(slo.ttft_ms), float(slo.itl_ms), float(slo.e2e_ms))
    try:
        before = measure(before_con, label=before_label, slo=goodput, window_s=window_s)
        after = measure(
            after_con,
            label=after_label,
            since_ns=since_ns,
            until_ns=until_ns,
            slo=goodput,
            window_s=window_s,
        )
    except (CompareError, NoTraffic):
        return None
    return compare(before, after, threshold_pct=threshold_pct)


_SAMPLES_SQL = f"""
WITH r AS (SELECT * FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until AND {OK_SQL})
SELECT s.name AS metric, s.duration_ns / 1e6 AS ms
FROM spans s JOIN r USING (trace_id) WHERE s.name IN ({", ".join(repr(n) for n in STATIONS)})
UNION ALL SELECT 'TTFT', ttft_ms FROM r WHERE ttft_ms IS NOT NULL
UNION ALL SELECT 'ITL p99', itl_p99_ms FROM r WHERE itl_p99_ms IS NOT NULL
UNION ALL SELECT 'TPOT', tpot_ms FROM r WHERE tpot_ms IS NOT NULL
UNION ALL SELECT 'E2E', e2e_ms FROM r WHERE e2e_ms IS NOT NULL
"""


def latency_samples(con, since_ns: int | None = None, until_ns: int | None = None) -> pd.DataFrame:
    """The distributions the Compare page overlays, one row per value (``metric``, ``ms``):
    each station span's duration (``metric`` = the station) and each request's TTFT, ITL p99,
    TPOT and E2E, over the requests that completed and arrived in the range (default: all)."""
    return _df(
        con,
        _SAMPLES_SQL,
        since=since_ns if since_ns is not None else -(2**62),
        until=until_ns if until_ns is not None else 2**62,
    )
