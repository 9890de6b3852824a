"""A proxy's request rows completed from the upstream engine's own spans of the same trace.

``tokenmill proxy`` records what the client saw (arrival, TTFT, ITL, E2E, usage); how long the
request queued and prefilled inside the upstream, only the upstream knows. When the upstream
exports its spans to the proxy's OTLP receiver (or ``tokenmill collect``), they land in the same
store under the proxy's trace id: a tokenmill server's ``schedule`` and ``prefill`` stations, or
the stations mapped from vLLM's and SGLang's spans (``telemetry/otlp_receiver.py``).

:func:`fill_from_upstream_spans` lays them over the rows that lack them, on a connection of
its own (a cursor of the caller's, so a writer's connection keeps writing to the stored table):
a temporary ``requests`` view over the stored table, with ``queue_ms`` the ``schedule``
station's duration, ``prefill_ms`` the ``prefill`` station's, and a prompt size of 0 (a stream
whose usage never came) taken from the upstream's spans. Stored rows are never changed, and a
store whose rows all carry their queue time (our own engine's) is left as it is.
"""

from __future__ import annotations

import duckdb

#: the proxy's own spans, which are not the upstream's stations
PROXY_SERVICE = "tokenmill-proxy"

# first the cheap half (our own engine's rows all carry their queue time), then the join
_LACKING_SQL = (
    "SELECT EXISTS (SELECT 1 FROM requests WHERE queue_ms IS NULL AND ttft_ms IS NOT NULL)"
)
_NEEDS_FILL_SQL = """
SELECT EXISTS (
    SELECT 1 FROM requests
    WHERE queue_ms IS NULL AND ttft_ms IS NOT NULL
      AND trace_id IN (SELECT trace_id FROM spans
                       WHERE name = 'schedule' AND service_name IS DISTINCT FROM $proxy))
"""

_TIMES_SQL = """
CREATE OR REPLACE TEMP TABLE upstream_station_times AS
SELECT trace_id,
    sum(duration_ns) FILTER (WHERE name = 'schedule') / 1e6 AS queue_ms,
    sum(duration_ns) FILTER (WHERE name = 'prefill') / 1e6 AS prefill_ms,
    max(input_tokens) AS input_tokens
FROM {db}.main.spans
WHERE service_name IS DISTINCT FROM $proxy
  AND trace_id IN (SELECT trace_id FROM {db}.main.requests WHERE queue_ms IS NULL)
GROUP BY trace_id
"""

_VIEW_SQL = """
CREATE OR REPLACE TEMP VIEW requests AS
SELECT r.* REPLACE (
    coalesce(r.queue_ms, u.queue_ms) AS queue_ms,
    coalesce(r.prefill_ms, u.prefill_ms) AS prefill_ms,
    CASE WHEN coalesce(r.input_tokens, 0) = 0 AND u.input_tokens > 0 THEN u.input_tokens
         ELSE r.input_tokens END AS input_tokens)
FROM {db}.main.requests r LEFT JOIN upstream_station_times u USING (trace_id)
"""


def _has(con: duckdb.DuckDBPyConnection, table: str, *cols: str) -> bool:
    have = {
        c.lower()
        for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "AND table_schema = 'main' AND table_catalog = current_database()",
            [table],
        ).fetchall()
    }
    return all(c in have for c in cols)


def fill_from_upstream_spans(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """The connection to read the store's requests through: ``con`` itself where nothing needs
    filling (our own engine's store, a store without the columns, one already filled), else a
    cursor of it whose ``requests`` carry the upstream's station times (module docstring)."""
    if not (
        _has(con, "requests", "trace_id", "queue_ms", "prefill_ms", "ttft_ms", "input_tokens")
        and _has(con, "spans", "trace_id", "name", "service_name", "duration_ns", "input_tokens")
    ):
        return con
    (lacking,) = con.execute(_LACKING_SQL).fetchone()
    if not lacking:
        return con
    (needed,) = con.execute(_NEEDS_FILL_SQL, {"proxy": PROXY_SERVICE}).fetchone()
    if not needed:
        return con
    (db,) = con.execute("SELECT current_database()").fetchone()
    quoted = '"' + db.replace('"', '""') + '"'
    filled = con.cursor()
    filled.execute(_TIMES_SQL.format(db=quoted), {"proxy": PROXY_SERVICE})
    filled.execute(_VIEW_SQL.format(db=quoted))
    return filled
