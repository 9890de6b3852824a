"""Store readers shared by the diagnoser, the console and the planner: the one request summary
(:data:`REQUEST_SUMMARY_SQL`, over a store's requests or a replay's) and which engine another
engine's store came from (:func:`store_engine`). The recorded config is
``telemetry/recorded_config.py``'s."""

from __future__ import annotations

import duckdb

from .goodput import GOOD_REQUEST_SQL
from .schema import COMPLETED_SQL

#: the request latencies :data:`REQUEST_SUMMARY_SQL` yields (ms)
LATENCY_KEYS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
)

#: one run's request numbers (TTFT, ITL, TPOT, E2E percentiles, goodput's count) over the
#: ``requests`` rows that arrived in ``[$since, $until)``; ``tokenmill plan`` runs it over its
#: replayed requests too, so a prediction and a measurement use the same definitions
REQUEST_SUMMARY_SQL = f"""
SELECT count(*) AS requests,
    count(*) FILTER (WHERE ok) AS completed,
    count(*) FILTER (WHERE error_type IS NOT NULL) AS errors,
    min(arrival_ns) AS first_arrival_ns, max(arrival_ns) AS last_arrival_ns,
    max(end_ns) AS last_end_ns,
    quantile_cont(input_tokens, 0.5) AS prompt_tokens_p50,
    quantile_cont(input_tokens, 0.99) AS prompt_tokens_p99,
    quantile_cont(output_tokens, 0.5) FILTER (WHERE ok) AS output_tokens_p50,
    quantile_cont(output_tokens, 0.99) FILTER (WHERE ok) AS output_tokens_p99,
    quantile_cont(ttft_ms, 0.5) FILTER (WHERE ok) AS ttft_p50_ms,
    quantile_cont(ttft_ms, 0.99) FILTER (WHERE ok) AS ttft_p99_ms,
    quantile_cont(itl_p50_ms, 0.5) FILTER (WHERE ok) AS itl_p50_ms,
    quantile_cont(itl_p99_ms, 0.99) FILTER (WHERE ok) AS itl_p99_ms,
    quantile_cont(tpot_ms, 0.5) FILTER (WHERE ok) AS tpot_p50_ms,
    quantile_cont(tpot_ms, 0.99) FILTER (WHERE ok) AS tpot_p99_ms,
    quantile_cont(e2e_ms, 0.5) FILTER (WHERE ok) AS e2e_p50_ms,
    quantile_cont(e2e_ms, 0.99) FILTER (WHERE ok) AS e2e_p99_ms,
    coalesce(sum(output_tokens) FILTER (WHERE ok), 0) AS output_tokens,
    count(*) FILTER (WHERE {GOOD_REQUEST_SQL}) AS good
FROM (SELECT *, {COMPLETED_SQL} AS ok FROM requests
      WHERE arrival_ns >= $since AND arrival_ns < $until)
"""


def store_engine(con: duckdb.DuckDBPyConnection) -> str | None:
    """The engine another engine's store was collected from (the kind its metric samples
    name most often), or None for tokenmill's own store."""
    try:
        row = con.execute(
            "SELECT engine_kind FROM engine_samples WHERE engine_kind <> 'tokenmill' "
            "GROUP BY engine_kind ORDER BY count(*) DESC LIMIT 1"
        ).fetchone()
    except duckdb.Error:
        return None
    return row[0] if row else None


__all__ = ["LATENCY_KEYS", "REQUEST_SUMMARY_SQL", "store_engine"]
