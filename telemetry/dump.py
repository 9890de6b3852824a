"""Trace dumps: a self-contained DuckDB file holding one time window of the trace store.

A dump has the store's schema (same version, same tables) plus ``meta`` rows saying what it
holds: ``dumped_at_ns``, ``window_start_ns``, ``window_end_ns`` and ``source``. It is written by
:func:`write_dump` (``tokenmill dump``, and ``GET /admin/dump`` on a live server) and read by
:func:`open_dump` (``diagnose``, the dashboard), which refuses anything that is not a readable
dump of this schema version with a one-line :class:`DumpError`.

Windows are half-open, ``since_ns <= t < until_ns``, on each table's own time: spans by
``start_ns``, requests by ``arrival_ns``, engine steps by ``start_ns``, device samples and events
by ``time_ns``. Traces are kept whole: a trace is in the window when its request started there
(its ``requests.arrival_ns``, or, for a request still in flight or without a ``requests`` row,
its earliest span), and then every span of it and its ``requests`` row are copied, even the parts
after ``until_ns``; a trace whose request started before the window is left out entirely.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

import duckdb

# the one duration grammar (engine/durations.py), here for the store's readers (diagnose)
from tokenmill.engine.durations import duration_ns, parse_duration  # noqa: F401

from .parquet_dump import ParquetDumpError, is_parquet_dump, load_parquet, not_a_parquet_dump
from .schema import TABLES, SchemaError, apply_schema, check_schema, expose_missing_columns

DUCKDB_MAGIC = b"DUCK"  # bytes 8..12 of every DuckDB database file
# the time column of each table that is not kept whole by trace
TIME_COLUMN = {
    "engine_steps": "start_ns",
    "device_samples": "time_ns",
    "events": "time_ns",
    "engine_samples": "time_ns",
    "waiting_samples": "time_ns",
    "findings": "time_ns",
    "stream_samples": "time_ns",
}


class DumpError(Exception):
    """A dump cannot be written or read (one-line reason)."""


def latest_ns(con: duckdb.DuckDBPyConnection) -> int:
    """The store's latest row (ns): what ``--since``/``--until`` count back from, in ``tokenmill
    dump`` and ``tokenmill diagnose`` alike (0 for an empty store)."""
    (t,) = con.execute(
        "SELECT max(t) FROM (SELECT max(end_ns) t FROM requests "
        "UNION ALL SELECT max(end_ns) FROM engine_steps)"
    ).fetchone()
    return t or 0


def _window(column: str, since_ns: int | None, until_ns: int | None) -> str:
    conds = []
    if since_ns is not None:
        conds.append(f"{column} >= {int(since_ns)}")
    if until_ns is not None:
        conds.append(f"{column} < {int(until_ns)}")
    return " AND ".join(conds) or "TRUE"


def _traces_sql(request_cond: str, span_cond: str, db: str | None) -> str:
    """The traces of the requests rows meeting ``request_cond``, and the traces without a
    request row (a request cut before its row) whose spans' aggregate meets ``span_cond``."""
    s = f'"{db}".main.' if db else ""
    return (
        f"SELECT trace_id FROM {s}requests WHERE {request_cond} "
        f"UNION SELECT trace_id FROM {s}spans "
        f"WHERE trace_id NOT IN (SELECT trace_id FROM {s}requests) "
        f"GROUP BY trace_id HAVING {span_cond}"
    )


def trace_ids_sql(since_ns: int | None, until_ns: int | None, db: str | None = None) -> str:
    """SQL of the trace ids a window holds: the traces of the requests that arrived in it, and
    the traces without a request row whose first span started in it. ``db``: the attached
    database to read (None: the current one)."""
    return _traces_sql(
        _window("arrival_ns", since_ns, until_ns), _window("min(start_ns)", since_ns, until_ns), db
    )


#: the time a row reached the store by (it is written when it ends or is taken): what an
#: incremental dump (``ended_since_ns``) selects on
ENDED_COLUMN = {
    "engine_steps": "end_ns",
    "device_samples": "time_ns",
    "events": "time_ns",
    "engine_samples": "time_ns",
    "waiting_samples": "time_ns",
    "findings": "time_ns",
    "stream_samples": "time_ns",
}


def ended_trace_ids_sql(ended_since_ns: int, db: str | None = None) -> str:
    """SQL of the traces that ended at or after ``ended_since_ns``: the requests that ended
    then, and the traces without a request row whose last span did."""
    t = int(ended_since_ns)
    return _traces_sql(f"end_ns >= {t}", f"max(end_ns) >= {t}", db)


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def write_dump(
    con: duckdb.DuckDBPyConnection,
    out_path: str | Path,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    source: str = "",
    overwrite: bool = False,
    ended_since_ns: int | None = None,
) -> dict[str, int]:
    """Write the rows of ``con`` (a trace store, live or read-only) in a window to a new DuckDB
    file at ``out_path``.

    The copy runs inside DuckDB (the output is ATTACHed to ``con``, one ``INSERT ... SELECT``
    per table) into a temporary file next to ``out_path``, renamed at the end: a failed dump
    leaves no file behind. For a live store, hold ``store.connection_locked()`` meanwhile.

    Args:
        since_ns, until_ns: the window (Unix ns, half-open); None = unbounded on that side.
        source: where the rows come from (a path or a server), kept in ``meta``.
        overwrite: replace an existing ``out_path`` instead of refusing.
        ended_since_ns: instead of a window, what reached the store from this time on (an
            incremental dump, for a live console that holds the rest): every trace that ended
            then (all of its spans, and its request row), the steps that ended and the samples
            and events taken then (:data:`ENDED_COLUMN`).

    Returns:
        Rows written per table.

    Raises:
        DumpError: ``out_path`` exists, the window is empty-by-construction, the source is not
            a store of this schema version, or DuckDB/the file system failed (one line).
    """
    out = Path(out_path)
    _check_dump_target(con, out, since_ns, until_ns, overwrite, ended_since_ns)
    dumped_at_ns = time.time_ns()
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    alias = f"tokenmill_dump_{secrets.token_hex(4)}"
    src = con.execute("SELECT current_database()").fetchone()[0]
    attached = False
    try:
        # create the file and its tables through a connection of its own (apply_schema's own
        # statements), then close it and attach it to the source connection to copy the rows.
        with duckdb.connect(str(tmp)) as new:
            apply_schema(new)
        con.execute(f"ATTACH {_sql_string(str(tmp))} AS {alias} (READ_WRITE)")
        attached = True
        con.execute("BEGIN TRANSACTION")
        _copy_rows(con, src, alias, since_ns, until_ns, ended_since_ns)
        counts = {
            t: con.execute(f"SELECT count(*) FROM {alias}.main.{t}").fetchone()[0] for t in TABLES
        }
        start = _window_start(con, alias, dumped_at_ns, since_ns, ended_since_ns)
        meta = {
            "dumped_at_ns": dumped_at_ns,
            "window_start_ns": start,
            "window_end_ns": until_ns if until_ns is not None else dumped_at_ns,
            "source": source,
        }
        if ended_since_ns is not None:
            meta["ended_since_ns"] = int(ended_since_ns)
        con.executemany(
            f"INSERT INTO {alias}.main.meta VALUES (?, ?)", [[k, str(v)] for k, v in meta.items()]
        )
        con.execute("COMMIT")
        con.execute(f"CHECKPOINT {alias}")
        con.execute(f"DETACH {alias}")
        attached = False
        _publish(tmp, out, overwrite)
    except BaseException as exc:
        _discard(con, alias if attached else None, tmp)
        if isinstance(exc, DumpError):
            raise
        if isinstance(exc, duckdb.Error | OSError | SchemaError):
            raise DumpError(f"writing {out} failed: {_one_line(exc)}") from None
        raise
    return counts


def _check_dump_target(
    con: duckdb.DuckDBPyConnection,
    out: Path,
    since_ns: int | None,
    until_ns: int | None,
    overwrite: bool,
    ended_since_ns: int | None,
) -> None:
    """:func:`write_dump`'s arguments checked before anything is written: the window, the
    output path, and the source's schema (a :class:`DumpError` each)."""
    if ended_since_ns is not None and (since_ns is not None or until_ns is not None):
        raise DumpError("an incremental dump (ended since) takes no since/until window")
    if since_ns is not None and until_ns is not None and until_ns <= since_ns:
        raise DumpError("the window ends before it starts (until must be after since)")
    if out.is_dir():
        raise DumpError(f"{out} is a folder")
    if out.exists() and not overwrite:
        raise DumpError(f"{out} already exists (choose another name or allow overwriting)")
    if not out.parent.is_dir():
        raise DumpError(f"folder {out.parent} does not exist")
    try:
        check_schema(con)
    except SchemaError as exc:
        raise DumpError(f"source: {exc}") from None


def _copy_rows(
    con: duckdb.DuckDBPyConnection,
    src: str,
    alias: str,
    since_ns: int | None,
    until_ns: int | None,
    ended_since_ns: int | None,
) -> None:
    """Every table's rows of the window (or, incremental, those that ended since
    ``ended_since_ns``) from the database ``src`` into the attached dump ``alias``: whole
    traces for spans and requests, each row's own time for the other tables."""
    s = f'"{src}"'
    traces = (
        trace_ids_sql(since_ns, until_ns, src)
        if ended_since_ns is None
        else ended_trace_ids_sql(ended_since_ns, src)
    )
    con.execute(
        f"INSERT INTO {alias}.main.spans BY NAME SELECT * FROM {s}.main.spans "
        f"WHERE trace_id IN ({traces})"
    )
    con.execute(
        f"INSERT INTO {alias}.main.requests BY NAME SELECT * FROM {s}.main.requests "
        f"WHERE trace_id IN ({traces})"
    )
    for table, column in TIME_COLUMN.items():
        where = (
            _window(column, since_ns, until_ns)
            if ended_since_ns is None
            else f"{ENDED_COLUMN[table]} >= {int(ended_since_ns)}"
        )
        con.execute(
            f"INSERT INTO {alias}.main.{table} BY NAME SELECT * FROM {s}.main.{table} WHERE {where}"
        )
    # the engine's config in force: a window that began after the server started holds no
    # ``config`` event of its own, and without one its steps are read with the defaults (an
    # incremental dump's reader keeps the config it has)
    if ended_since_ns is not None:
        return
    (held,) = con.execute(
        f"SELECT count(*) FROM {alias}.main.events WHERE kind = 'config'"
    ).fetchone()
    if not held:
        until = "" if until_ns is None else f"AND time_ns < {int(until_ns)}"
        con.execute(
            f"INSERT INTO {alias}.main.events BY NAME SELECT * FROM {s}.main.events "
            f"WHERE kind = 'config' {until} ORDER BY time_ns DESC LIMIT 1"
        )


def _window_start(
    con: duckdb.DuckDBPyConnection,
    alias: str,
    dumped_at_ns: int,
    since_ns: int | None,
    ended_since_ns: int | None,
) -> int:
    """The dump's ``window_start_ns``: the window's start where one was asked, else the
    earliest time copied, or the dump time for an empty dump."""
    if since_ns is not None or ended_since_ns is not None:
        return since_ns if since_ns is not None else ended_since_ns
    parts = " UNION ALL ".join(
        [f"SELECT min(start_ns) FROM {alias}.main.spans"]
        + [f"SELECT min(arrival_ns) FROM {alias}.main.requests"]
        + [f"SELECT min({c}) FROM {alias}.main.{t}" for t, c in TIME_COLUMN.items()]
    )
    start = con.execute(f"SELECT min(m) FROM ({parts}) AS x(m)").fetchone()[0]
    return dumped_at_ns if start is None else start


def _discard(con: duckdb.DuckDBPyConnection, alias: str | None, tmp: Path) -> None:
    """A failed dump undone: its transaction rolled back and the dump detached (``alias``,
    where still attached), its temporary file and WAL removed."""
    if alias is not None:
        for stmt in ("ROLLBACK", f"DETACH {alias}"):
            with contextlib.suppress(duckdb.Error):
                con.execute(stmt)
    for p in (tmp, tmp.with_name(tmp.name + ".wal")):
        p.unlink(missing_ok=True)


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished temp file to ``out`` (refusing an existing file unless ``overwrite``)."""
    tmp.with_name(tmp.name + ".wal").unlink(missing_ok=True)  # checkpointed: nothing in it
    if overwrite:
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)  # atomic, and fails if someone created ``out`` meanwhile
    except FileExistsError:
        raise DumpError(
            f"{out} already exists (choose another name or allow overwriting)"
        ) from None
    except OSError:  # a file system without hard links
        if out.exists():
            raise DumpError(
                f"{out} already exists (choose another name or allow overwriting)"
            ) from None
        os.replace(tmp, out)
        return
    tmp.unlink()


def duckdb_file_problem(p: Path, folder_noun: str, what: str) -> str | None:
    """Why ``p`` cannot be a DuckDB file (one line naming it), or None. Checks existence, that
    it is a file, and DuckDB's magic bytes, before DuckDB itself gets to see it."""
    if not p.exists():
        return f"{p}: no such file"
    if p.is_dir():
        return f"{p}: is a folder, not a {folder_noun}"
    try:
        with open(p, "rb") as f:
            head = f.read(12)
    except OSError as exc:
        return f"{p}: cannot read: {exc.strerror or exc}"
    if len(head) < 12 or head[8:12] != DUCKDB_MAGIC:
        return f"{p}: not a DuckDB file (is it a {what}?)"
    return None


def open_dump(path: str | Path, *, verify: bool = True) -> duckdb.DuckDBPyConnection:
    """Open a dump (or a closed trace-store file) read-only; a Parquet dump folder
    (:mod:`.parquet_dump`), or a retention archive of them (:mod:`.retention`), opens as an
    in-memory DuckDB holding the same tables.

    Args:
        verify: read every row once so that a damaged block surfaces here, as a
            :class:`DumpError`, rather than in a later query.

    Raises:
        DumpError: missing file, not a DuckDB file, a corrupt or truncated file, a file locked
            by a running server, another schema version, or missing tables (one line, naming
            the file); a Parquet folder of another version or lacking a table file.
    """
    p = Path(path)
    from .retention import is_archive, open_archive

    if p.is_dir() and is_archive(p):  # old rows the live store rolled out (--trace-retention)
        return open_archive(p)
    if is_parquet_dump(p):  # a folder written by ``tokenmill dump --format parquet``
        try:
            return load_parquet(p)
        except ParquetDumpError as exc:
            raise DumpError(str(exc)) from None
    problem = not_a_parquet_dump(p) or duckdb_file_problem(p, "dump file", "tokenmill dump")
    if problem:
        raise DumpError(problem)
    try:
        con = duckdb.connect(str(p), read_only=True)
    except duckdb.Error as exc:
        raise DumpError(f"{p}: {_describe_open_error(exc)}") from None
    try:
        # a damaged catalog must not read as "no meta table" (a missing one: check_schema)
        with contextlib.suppress(duckdb.CatalogException):
            con.execute("SELECT key, value FROM meta").fetchall()
        check_schema(con)
        expose_missing_columns(con)
        if verify:
            for t in TABLES:
                con.execute(f"SELECT count(*), bit_xor(hash(COLUMNS(*))) FROM {t}").fetchall()
    except SchemaError as exc:
        con.close()
        raise DumpError(f"{p}: {exc}") from None
    except duckdb.Error as exc:
        con.close()
        raise DumpError(f"{p}: {_corrupt(_one_line(exc))}") from None
    return con


def _describe_open_error(exc: duckdb.Error) -> str:
    msg = _one_line(exc)
    low = msg.lower()
    if "could not set lock" in low or "conflicting lock" in low:
        return (
            "locked by another process (a running server?); write a dump of it with "
            "`tokenmill dump --url URL` (or stop it) and read that"
        )
    if "not a valid duckdb database file" in low:
        return "not a DuckDB file (is it a tokenmill dump?)"
    if "different configuration" in low:
        return "already open in this process with another configuration"
    if "version" in low and "storage" in low:
        return f"written by an incompatible DuckDB version ({msg})"
    return _corrupt(msg)


def _corrupt(msg: str) -> str:
    if "could not read enough bytes" in msg.lower():
        return f"truncated DuckDB file ({msg})"
    return f"corrupt DuckDB file ({msg})"


def describe_dump(con: duckdb.DuckDBPyConnection) -> dict:
    """Rows per table and the ``meta`` entries of an open dump (for summaries)."""
    counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
    meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    return {"counts": counts, "meta": meta}


def format_summary(path: str | Path, info: dict) -> str:
    """One line: where, rows per table, and the window (UTC)."""
    counts = ", ".join(f"{t} {n}" for t, n in info["counts"].items())
    meta = info["meta"]

    def ts(key: str) -> str:
        try:
            ns = int(meta[key])
        except (KeyError, ValueError):
            return "?"
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))

    return f"wrote {path}: {counts}; window {ts('window_start_ns')} .. {ts('window_end_ns')}"
