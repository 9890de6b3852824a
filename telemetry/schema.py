"""The trace store's schema: the DDL in ``schema.sql``, its version, and the check that a
DuckDB file (a live store or a dump) was written by this version."""

from __future__ import annotations

from importlib import resources

import duckdb

SCHEMA_VERSION = 1
TABLES = ("spans", "requests", "engine_steps", "device_samples", "events")
# the child spans of every `request` span, in the order a request passes them (DESIGN.md §2)
STATIONS = (
    "gateway",
    "tokenize",
    "admission",
    "schedule",
    "prefill",
    "decode",
    "stream",
    "metering",
)
# an `engine_steps` row that ran tokens; rows without are an idle engine's heartbeats
# (EngineCore.idle_record), which count for KV use and queue depth but not as steps
WORKING_STEP_SQL = "num_prefill_tokens + num_decode_tokens > 0"


class SchemaError(Exception):
    """A DuckDB file is not a tokenmill trace store of this schema version (one-line reason)."""


def ddl() -> str:
    """The ``CREATE TABLE`` statements of this version."""
    return resources.files(__package__).joinpath("schema.sql").read_text()


def apply_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create the tables (if missing) and stamp the version.

    Raises:
        SchemaError: the file already carries another schema version.
    """
    con.execute(ddl())
    rows = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
    row = rows[0] if rows else None  # fetchall: a half-read result would block the next query
    if row is None:
        con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
    elif row[0] != str(SCHEMA_VERSION):
        raise SchemaError(
            f"store has schema version {row[0]}, this tokenmill writes version {SCHEMA_VERSION}"
        )


def columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """Column names of ``table`` in table order."""
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
        "ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return [r[0] for r in rows]


def check_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Check that ``con`` is a tokenmill store of this version.

    Raises:
        SchemaError: no ``meta`` table, another version, or a missing table.
    """
    try:
        rows = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
        row = rows[0] if rows else None
    except duckdb.Error:
        raise SchemaError("not a tokenmill trace store (no meta table)") from None
    if row is None:
        raise SchemaError("not a tokenmill trace store (no schema_version in meta)")
    if row[0] != str(SCHEMA_VERSION):
        raise SchemaError(f"schema version {row[0]}; this tokenmill reads version {SCHEMA_VERSION}")
    present = {
        r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()
    }
    missing = [t for t in TABLES if t not in present]
    if missing:
        raise SchemaError(f"trace store lacks table(s) {', '.join(missing)}")
