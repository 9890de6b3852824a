"""The trace store's schema: the DDL, its version, the shared SQL predicates, and the check that
a DuckDB file (a live store or a dump) was written by this version.

``spans``, ``device_samples``, ``events`` and ``meta`` are written out in ``schema.sql``;
``requests`` and ``engine_steps`` are generated from their row types
(:class:`~tokenmill.telemetry.rows.RequestRow`, :class:`~tokenmill.engine.messages.StepRecord`),
so the engine's step record and its stored row cannot disagree.
"""

from __future__ import annotations

from importlib import resources

import duckdb
import msgspec
import msgspec.inspect as mi

from tokenmill.engine.messages import (
    COMPLETED_FINISH_REASONS,
    DEFAULT_BLOCK_SIZE,
    IDLE_KV_LEAK_SHARE,
    WORKING_STEP_SQL,
    StepRecord,
)

from .rows import RequestRow

SCHEMA_VERSION = 3
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
#: A ``requests`` row that completed (:func:`tokenmill.engine.messages.is_completed` in SQL).
COMPLETED_SQL = (
    f"(finish_reason IN ({', '.join(repr(r) for r in COMPLETED_FINISH_REASONS)}) "
    "AND error_type IS NULL)"
)

#: The tables generated from a row type, in the order they are created.
ROW_TYPES: dict[str, type[msgspec.Struct]] = {"requests": RequestRow, "engine_steps": StepRecord}

__all__ = [
    "COMPLETED_FINISH_REASONS",
    "COMPLETED_SQL",
    "DEFAULT_BLOCK_SIZE",
    "IDLE_KV_LEAK_SHARE",
    "ROW_TYPES",
    "SCHEMA_VERSION",
    "STATIONS",
    "TABLES",
    "WORKING_STEP_SQL",
    "SchemaError",
    "apply_schema",
    "check_schema",
    "ddl",
    "sql_type",
    "struct_ddl",
]


class SchemaError(Exception):
    """A DuckDB file is not a tokenmill trace store of this schema version (one-line reason)."""


def sql_type(t: mi.Type) -> str:
    """The DuckDB type of one field type: an explicit ``Meta(extra={"sql": ...})`` wins, else
    int → INTEGER, float → DOUBLE, str → VARCHAR, bool → BOOLEAN, list[int] → BIGINT[].

    Raises:
        TypeError: a field type with no column type (give it ``Meta(extra={"sql": ...})``).
    """
    if isinstance(t, mi.Metadata):
        return (t.extra or {}).get("sql") or sql_type(t.type)
    if isinstance(t, mi.UnionType):
        inner = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if len(inner) == 1:
            return sql_type(inner[0])
    simple = {mi.IntType: "INTEGER", mi.FloatType: "DOUBLE", mi.StrType: "VARCHAR"}
    simple[mi.BoolType] = "BOOLEAN"
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.IntType):
        return "BIGINT[]"
    raise TypeError(f"no column type for {t!r}")


def struct_ddl(table: str, row_type: type[msgspec.Struct]) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for ``row_type``: one column per field, in field order;
    required fields are ``NOT NULL``."""
    cols = [
        f"    {f.name} {sql_type(f.type)}{' NOT NULL' if f.required else ''}"
        for f in mi.type_info(row_type).fields
    ]
    return f"CREATE TABLE IF NOT EXISTS {table} (\n" + ",\n".join(cols) + "\n);\n"


def ddl() -> str:
    """The ``CREATE TABLE`` statements of this version (``schema.sql`` + the generated tables)."""
    written = resources.files(__package__).joinpath("schema.sql").read_text()
    return written + "\n" + "\n".join(struct_ddl(t, cls) for t, cls in ROW_TYPES.items())


def apply_schema(con: duckdb.DuckDBPyConnection) -> None:
    """Create the tables (if missing), stamp the version, and add the columns of row-type
    fields that a store of this version written by an older tokenmill lacks (a new field has a
    default, so its column is nullable and older rows read as NULL).

    Raises:
        SchemaError: the file already carries another schema version, or lacks a column of a
            required field.
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
    for table, row_type in ROW_TYPES.items():
        have = set(columns(con, table))
        for f in mi.type_info(row_type).fields:
            if f.name in have:
                continue
            if f.required:
                raise SchemaError(f"store table {table} lacks required column {f.name}")
            con.execute(f"ALTER TABLE {table} ADD COLUMN {f.name} {sql_type(f.type)}")


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
