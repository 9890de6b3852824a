"""The console's queries of the engine's optional modes (Engine page): speculative decoding
(acceptance, tokens per sequence, acceptance by draft position), tensor parallelism's
collectives, data parallelism's replicas, and prefill/decode disaggregation's pools and KV
transfers. Each is empty for a store without its columns. Conventions: ``data_store.py``."""

from __future__ import annotations

import pandas as pd

from tokenmill.telemetry.schema import (
    DECODE_ONLY_STEP_SQL,
    SPEC_STEP_SQL,
    STEP_DECODE_SEQS_SQL,
    WORKING_STEP_SQL,
    columns,
    spec_agg_sql,
)

from .data_store import (
    _bucketed,
    _df,
    _one,
    _time,
)

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
    return _bucketed(
        con,
        f"SELECT (start_ns - $since) // $w AS b, {spec_agg_sql()}, {_SPEC_TOKENS} "
        "FROM engine_steps WHERE start_ns >= $since AND start_ns < $until "
        f"AND ({DECODE_ONLY_STEP_SQL} OR {SPEC_STEP_SQL}) GROUP BY b ORDER BY b",
        since_ns,
        until_ns,
        bucket_s,
    )


# ----- tensor and data parallelism -----


def collective_series(con, since_ns: int, until_ns: int, bucket_s: float) -> pd.DataFrame:
    """Tensor parallelism per time bucket (by step start): ``decode_share`` and
    ``prefill_share``, the collectives' share of the forward (``collective_ms`` over
    ``forward_ms``, summed) in decode-only and in prefill steps, and ``collective_ms`` (mean a
    working step). Empty without tensor parallelism (no ``collective_ms``) in the window."""
    empty = _time(pd.DataFrame(columns=["b", "t_ns", "decode_share", "prefill_share"]))
    if "collective_ms" not in set(columns(con, "engine_steps")):
        return empty
    decode = "num_prefill_tokens = 0 AND num_decode_tokens > 0"
    df = _bucketed(
        con,
        "SELECT (start_ns - $since) // $w AS b, "
        f"sum(collective_ms) FILTER (WHERE {decode}) "
        f"/ nullif(sum(forward_ms) FILTER (WHERE {decode}), 0) AS decode_share, "
        "sum(collective_ms) FILTER (WHERE num_prefill_tokens > 0) "
        "/ nullif(sum(forward_ms) FILTER (WHERE num_prefill_tokens > 0), 0) AS prefill_share, "
        "avg(collective_ms) AS collective_ms "
        "FROM engine_steps WHERE start_ns >= $since AND start_ns < $until "
        "AND collective_ms IS NOT NULL GROUP BY b ORDER BY b",
        since_ns,
        until_ns,
        bucket_s,
    )
    return empty if df.empty else df


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
    colocated = "role IS NULL" if "role" in step_cols else "TRUE"
    df = _bucketed(
        con,
        "SELECT (start_ns - $since) // $w AS b, replica, avg(num_running) AS running, "
        "avg(num_waiting) AS waiting FROM engine_steps "
        "WHERE start_ns >= $since AND start_ns < $until AND replica IS NOT NULL "
        f"AND {colocated} GROUP BY ALL ORDER BY b, replica",
        since_ns,
        until_ns,
        bucket_s,
    )
    return empty if df["replica"].nunique() < 2 else df


# ----- prefill/decode disaggregation -----


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
    df = _bucketed(
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
        since_ns,
        until_ns,
        bucket_s,
    )
    return df[[*cols, "time"]]


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
