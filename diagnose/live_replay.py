"""A recorded store replayed through the live loop, as the loop would have seen it live.

At each tick only the rows that had reached the store by then are visible: a request (and its
spans) once it ended, a step once it ended, a sample or event once taken, a finding once
written (:func:`store_as_of`, which the corpus's time-to-detect uses too). :func:`replay` runs
:meth:`LiveDiagnosis.tick` on it, so that the hysteresis, the window and the reference can be
chosen on recorded runs (the live soak's tune timeline, the corpus) without running them again.
"""

from __future__ import annotations

from collections.abc import Iterator

import duckdb

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
    "stream_samples": "time_ns",
}


def store_as_of(con: duckdb.DuckDBPyConnection, t_ns: int) -> duckdb.DuckDBPyConnection:
    """An in-memory copy of the store as a live server's would have stood at ``t_ns``: the
    requests and steps that had ended, the samples, events and findings taken by then (a request
    still in flight is not in a live store's ``requests`` yet)."""
    out = duckdb.connect(config={"threads": 1})
    for table in ("meta", *VISIBLE_BY):
        col = VISIBLE_BY.get(table)
        where = f"WHERE {col} <= {int(t_ns)}" if col else ""
        try:
            rows = con.sql(f"SELECT * FROM {table} {where}").to_arrow_table()  # noqa: F841
        except duckdb.CatalogException:  # a store written before the table
            continue
        out.execute(f"CREATE TABLE {table} AS SELECT * FROM rows")
    return out


def time_range(src: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """The recording's first arrival and last request end."""
    # fetchall: a half-read result would block the next query on ``src``
    ((lo, hi),) = src.execute("SELECT min(arrival_ns), max(end_ns) FROM requests").fetchall()
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
    loop = LiveDiagnosis(settings)
    step = int(settings.period_s * NS)
    now = start_ns + step
    while now <= end_ns + step:
        con = store_as_of(src, now)
        try:
            yield loop, loop.tick(con, now)
        finally:
            con.close()
        now += step
