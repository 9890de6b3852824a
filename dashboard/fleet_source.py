"""The console over a fleet: several dumps (one per replica or host) as one source.

:class:`FleetHandle` builds one in-memory DuckDB that ATTACHes every DuckDB dump read-only
(a Parquet dump folder is loaded into a schema of its own, :func:`load_parquet`) and, in its
``main`` schema, one view per table that is the union of all sources with a ``source`` column
(the source's name, :func:`tokenmill.diagnose.fleet.source_names`). A snapshot is either that
union ("all") or one source: a cursor whose default schema is that source's own tables, so
every console query runs unchanged on it. The fleet is rebuilt when a dump file changes.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb

from tokenmill.diagnose.fleet import FleetError, collect_dumps, source_names
from tokenmill.telemetry.dump import DumpError, open_dump
from tokenmill.telemetry.parquet_dump import ParquetDumpError, is_parquet_dump, load_parquet
from tokenmill.telemetry.schema import ADDED_TABLES, ROW_TYPES, TABLES, has_table, struct_ddl

from .source import Snapshot, SourceError

ALL = "all"
#: separates the dumps of a fleet in ``TOKENMILL_DASHBOARD_SOURCE``
SEPARATOR = "\n"


def is_fleet(spec: str | None) -> bool:
    """A source string ``tokenmill dashboard`` made from two or more dumps."""
    return bool(spec) and SEPARATOR in spec


def check_fleet(specs: list[str]) -> str:
    """Validate the dumps of a fleet (files, Parquet dump folders, folders of dumps); returns
    the source string for the console (absolute paths joined by :data:`SEPARATOR`).

    Raises:
        SourceError: a URL among them, a folder with no dumps, a dump given twice, or a file
            that is not a readable dump of this schema version (one line naming it).
    """
    if any(s.strip().lower().startswith(("http://", "https://")) for s in specs):
        raise SourceError("a fleet is dump files or folders; give a server URL on its own")
    try:
        paths = collect_dumps([Path(s.strip()) for s in specs])
    except FleetError as exc:
        raise SourceError(str(exc)) from None
    for p in paths:
        try:
            open_dump(p, verify=False).close()
        except DumpError as exc:
            raise SourceError(str(exc)) from None
    if len(paths) == 1:
        return str(paths[0].resolve())
    return SEPARATOR.join(str(p.resolve()) for p in paths)


@dataclass
class FleetSnapshot(Snapshot):
    """A fleet snapshot: ``schema`` is the one source's ``catalog.schema`` to ``USE`` on each
    cursor of ``con`` (None: the union of all sources)."""

    schema: str | None = None

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A cursor of its own whose unqualified table names are this snapshot's tables."""
        cur = self.con.cursor()
        if self.schema:
            cur.execute(f"USE {self.schema}")
        return cur


@dataclass
class Member:
    """One source of the fleet: its name, dump path and the schema holding its tables."""

    name: str
    path: str
    schema: str  # a qualified ``catalog.schema`` in the fleet's database


class FleetHandle:
    """Owns the in-memory fleet database; thread-safe.

    Args:
        spec: the dumps, joined by :data:`SEPARATOR` (:func:`check_fleet`).
    """

    live = False

    def __init__(self, spec: str):
        self.paths = [Path(p) for p in spec.split(SEPARATOR) if p]
        self.spec = spec
        self.refresh_s = 0.0
        self._lock = threading.Lock()
        self._open: list[tuple[str, duckdb.DuckDBPyConnection, list[Member]]] = []

    @property
    def members(self) -> list[Member]:
        """The sources of the current build (builds it if needed).

        Raises:
            SourceError: a dump cannot be read.
        """
        with self._lock:
            return self._current()[2]

    def snapshot(self, choice: str = ALL, force: bool = False) -> FleetSnapshot:
        """The union of all sources (``choice`` = :data:`ALL`) or the source named ``choice``.

        Raises:
            SourceError: a dump cannot be read, or no source has that name.
        """
        with self._lock:
            key, con, members = self._current()
            if choice == ALL:
                return FleetSnapshot(f"{key}:{ALL}", con, f"{len(members)} sources", 0.0)
            m = next((m for m in members if m.name == choice), None)
            if m is None:
                raise SourceError(f"no source named {choice!r} in the fleet")
            return FleetSnapshot(
                f"{key}:{m.name}", con, f"{m.name} ({m.path})", 0.0, None, m.schema
            )

    def _key(self) -> str:
        parts = []
        for p in self.paths:
            files = sorted(p.iterdir()) if p.is_dir() else [p]
            for f in files:
                try:
                    st = f.stat()
                except OSError as exc:
                    raise SourceError(f"{f}: {exc.strerror or exc}") from None
                parts.append(f"{f}:{st.st_mtime_ns}:{st.st_size}")
        return "fleet:" + str(hash(tuple(parts)))

    def _current(self) -> tuple[str, duckdb.DuckDBPyConnection, list[Member]]:
        key = self._key()
        if self._open and self._open[-1][0] == key:
            return self._open[-1]
        con, members = build(self.paths)
        self._open.append((key, con, members))
        while len(self._open) > 2:  # a page may still read the previous build
            with contextlib.suppress(duckdb.Error):
                self._open.pop(0)[1].close()
        return self._open[-1]

    def close(self) -> None:
        with self._lock:
            for _, con, _ in self._open:
                with contextlib.suppress(duckdb.Error):
                    con.close()
            self._open.clear()


def build(paths: list[Path]) -> tuple[duckdb.DuckDBPyConnection, list[Member]]:
    """The fleet's in-memory database over ``paths`` and its members.

    Raises:
        SourceError: a dump that is not readable, of another schema version, or lacks a table.
    """
    metas = []
    for p in paths:  # each dump checked (version, tables) as the console opens any dump
        try:
            c = open_dump(p, verify=False)
        except DumpError as exc:
            raise SourceError(str(exc)) from None
        row = c.execute("SELECT value FROM meta WHERE key = 'source'").fetchone()
        metas.append(row[0] if row else "")
        c.close()
    con = duckdb.connect(":memory:")
    members = []
    try:
        for i, (p, name) in enumerate(zip(paths, source_names(paths, metas), strict=True)):
            alias = f"src_{i}"
            if is_parquet_dump(p):
                load_parquet(p, con, schema=alias)
                schema = f"memory.{alias}"
            else:
                path = str(p).replace("'", "''")
                con.execute(f"ATTACH '{path}' AS {alias} (READ_ONLY)")
                schema = f"{alias}.main"
            members.append(Member(name, str(p), schema))
        for table in ("meta", *TABLES):
            if table == "meta":  # one schema_version row (all sources share it), then the rest
                parts = [f"SELECT * FROM {members[0].schema}.meta"]
            else:
                parts = [
                    f"SELECT '{m.name.replace(chr(39), chr(39) * 2)}' AS source, * "
                    f"FROM {m.schema}.{table}"
                    for m in members
                    # a dump written before an added table has none of its rows
                    if table not in ADDED_TABLES or has_table(con, *m.schema.split("."), table)
                ]
            if not parts:  # no member has this added table: an empty one
                con.execute(struct_ddl(f"main.{table}", ROW_TYPES[table]))
                con.execute(f"ALTER TABLE main.{table} ADD COLUMN source VARCHAR")
                continue
            con.execute(f"CREATE VIEW main.{table} AS " + " UNION ALL BY NAME ".join(parts))
    except (duckdb.Error, ParquetDumpError) as exc:
        con.close()
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SourceError(f"cannot build the fleet: {first}") from None
    return con, members
