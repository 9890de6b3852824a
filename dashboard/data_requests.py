"""The console's request queries (Overview and Requests pages): the overview tiles and the
latency series, the requests table and its filters, one request's detail (spans, events, token
times, KV transfer) and critical path. Conventions: ``data_store.py``."""

from __future__ import annotations

import json

import duckdb
import pandas as pd

from tokenmill.telemetry.goodput import GOOD_REQUEST_SQL, GoodputSlo
from tokenmill.telemetry.schema import COMPLETED_SQL, STATIONS

from .data_store import (
    DEFAULT_SLO,
    NS,
    OK_SQL,
    _df,
    _div,
    _one,
    _q,
    _time,
)

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


def overview(con, since_ns: int, until_ns: int, slo: GoodputSlo = DEFAULT_SLO) -> dict:
    """The tiles: latency percentiles (ms), throughput (output tokens/s from engine steps),
    goodput (share of requests meeting ``slo`` and good requests/s), error rate, KV usage."""
    r = _one(
        con,
        _OVERVIEW_REQ_SQL,
        since=since_ns,
        until=until_ns,
        **slo.sql_params(),
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
