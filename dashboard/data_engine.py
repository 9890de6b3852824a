"""The console's engine-step queries (Engine page): the steps per step or per time bucket, any
step field, the window's totals, the steps on the roofline with the device's ceilings, and the
prefix-cache hit rate. Conventions: ``data_store.py``."""

from __future__ import annotations

import pandas as pd

from tokenmill.telemetry.recorded_config import read_recorded_config
from tokenmill.telemetry.schema import (
    ROOFLINE_STEP_SQL,
    ROW_TYPES,
    STEP_BYTES_SQL,
    STEP_GBPS_SQL,
    STEP_GFLOPS_SQL,
    STEP_INTENSITY_SQL,
    WORKING_STEP_SQL,
    columns,
    roofline_agg_sql,
    sql_type,
)

from .data_store import (
    NS,
    _bucketed,
    _df,
    _one,
    _q,
    _time,
    pick_bucket_s,
)

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
    return _bucketed(con, _STEP_BUCKET_SQL, since_ns, until_ns, bucket_s), bucket_s


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
    """The roofline's ceilings from the recorded config (``telemetry/recorded_config.py``):
    ``peak_gbps`` (GB/s), ``peak_gflops`` (GFLOP/s), their sources (``flag``, ``table:<GPU>``,
    ``probe``), ``device_name`` and ``ridge`` (FLOP/byte: where the two ceilings meet); with
    int8 compute on, ``peak_int8_gops`` (its GEMM peak, GOP/s) and ``int8_ridge`` (where it
    meets the bandwidth ceiling); the figures None when the store has none."""
    cfg = read_recorded_config(con)
    peaks = cfg.roofline_peaks()
    return {
        "peak_gbps": cfg.device_peak_gbps,
        "peak_gflops": cfg.device_peak_gflops,
        "peak_gbps_source": cfg.device_peak_gbps_source,
        "peak_gflops_source": cfg.device_peak_gflops_source,
        "device_name": cfg.device_name,
        "ridge": peaks[2] if peaks else None,
        "peak_int8_gops": cfg.device_peak_int8_gops,
        "int8_ridge": cfg.device_peak_int8_gops / cfg.device_peak_gbps
        if peaks and cfg.device_peak_int8_gops
        else None,
    }


def prefix_hit_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Per bucket (by arrival): prefix-cache hit rate = cached prompt tokens / prompt tokens."""
    return _bucketed(
        con,
        "SELECT (arrival_ns - $since) // $w AS b, sum(cached_tokens)::DOUBLE "
        "/ nullif(sum(input_tokens), 0) AS prefix_hit_rate, sum(input_tokens) AS input_tokens "
        "FROM requests WHERE arrival_ns >= $since AND arrival_ns < $until GROUP BY b ORDER BY b",
        since_ns,
        until_ns,
        bucket_s,
    )
