"""A recorded store replayed through the live loop, as the loop would have seen it live.

At each tick only the rows that had reached the store by then are visible: a request (and its
spans) once it ended, a step once it ended, a sample or event once taken, a finding once
written. :func:`replay` copies those rows into a fresh in-memory store per tick and runs
:meth:`LiveDiagnosis.tick` on it, so that the hysteresis, the window and the reference can be
chosen on recorded runs (the live soak's tune timeline, the corpus) without running them again.
"""

from __future__ import annotations

from collections.abc import Iterator

import duckdb

from tokenmill.telemetry.schema import TABLES, apply_schema

from .live import NS, LiveDiagnosis, LiveSettings, TickResult

#: the column saying when each table's row reached the store
VISIBLE_BY = {
    "requests": "end_ns",
    "spans": "end_ns",
    "engine_steps": "end_ns",
    "device_samples": "time_ns",
    "events": "time_ns",
    "engine_samples": "time_ns",
    "waiting_samples": "time_ns",
    "findings": "time_ns",
}


def _load(src: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """An in-memory copy of ``src``'s tables (``rec``) beside an empty store (``main``)."""
    con = duckdb.connect(config={"threads": 1})
    apply_schema(con)
    con.execute("ATTACH ':memory:' AS rec")
    for table in ("meta", *TABLES):
        try:
            arrow = src.cursor().sql(f"SELECT * FROM {table}").to_arrow_table()
        except duckdb.CatalogException:  # an older store without the table
            continue
        con.from_arrow(arrow).create(f"rec.{table}")
    return con


def _show(con: duckdb.DuckDBPyConnection, now_ns: int) -> None:
    """Make ``main`` hold the recorded rows visible at ``now_ns``."""
    con.execute("DELETE FROM main.meta WHERE key <> 'schema_version'")
    con.execute("INSERT INTO main.meta SELECT * FROM rec.meta WHERE key <> 'schema_version'")
    have = {r[0] for r in con.execute("SHOW TABLES FROM rec").fetchall()}
    for table in TABLES:
        con.execute(f"DELETE FROM main.{table}")
        if table in have:
            col = VISIBLE_BY[table]
            con.execute(
                f"INSERT INTO main.{table} BY NAME SELECT * FROM rec.{table} WHERE {col} <= ?",
                [now_ns],
            )


def time_range(src: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """The recording's first arrival and last request end."""
    lo, hi = src.execute("SELECT min(arrival_ns), max(end_ns) FROM requests").fetchone()
    if lo is None:
        raise ValueError("the store holds no requests")
    return int(lo), int(hi)


def replay(
    src: duckdb.DuckDBPyConnection,
    settings: LiveSettings | None = None,
    *,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> Iterator[tuple[LiveDiagnosis, TickResult]]:
    """Tick a fresh :class:`LiveDiagnosis` every ``period_s`` over ``src``'s recording, from
    ``start_ns`` (default: its first arrival) to ``end_ns`` (default: its last request end),
    yielding the loop and each tick's result."""
    settings = settings or LiveSettings()
    lo, hi = time_range(src)
    start_ns = lo if start_ns is None else start_ns
    end_ns = hi if end_ns is None else end_ns
    con = _load(src)
    loop = LiveDiagnosis(settings)
    step = int(settings.period_s * NS)
    now = start_ns + step
    try:
        while now <= end_ns + step:
            _show(con, now)
            yield loop, loop.tick(con, now)
            now += step
    finally:
        con.close()
