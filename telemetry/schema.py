"""The trace store's schema: the DDL, its version, the shared SQL predicates, and the check that
a DuckDB file (a live store or a dump) was written by this version.

``device_samples``, ``events`` and ``meta`` are written out in ``schema.sql``; ``spans``,
``requests``, ``engine_steps``, ``engine_samples``, ``waiting_samples`` and ``stream_samples``
are generated from their row types (:class:`~tokenmill.telemetry.rows.SpanRow`,
:class:`~tokenmill.telemetry.rows.RequestRow`,
:class:`~tokenmill.engine.messages.StepRecord`,
:class:`~tokenmill.telemetry.engine_metrics.EngineSampleRow`,
:class:`~tokenmill.telemetry.rows.WaitingSampleRow`,
:class:`~tokenmill.telemetry.rows.StreamSampleRow`), so the engine's step record and
its stored row cannot disagree.
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

from .engine_metrics import EngineSampleRow
from .rows import FindingRow, RequestRow, SpanRow, StreamSampleRow, WaitingSampleRow

SCHEMA_VERSION = 4
TABLES = (
    "spans",
    "requests",
    "engine_steps",
    "device_samples",
    "events",
    "engine_samples",
    "waiting_samples",
    "findings",
    "stream_samples",
)
#: tables added after this version was stamped: a store or dump written before them reads them
#: as empty (apply_schema creates them, expose_missing_columns gives a read-only file an empty
#: one, a Parquet dump may lack their file)
ADDED_TABLES = ("engine_samples", "waiting_samples", "findings", "stream_samples")
# the child spans of every root span (`chat {model}`), in the order a request passes them (DESIGN.md §2)
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


# ---- the roofline of engine steps: the one place its derived values are defined ----
# The engine counts each step's bytes and FLOPs (engine/roofline.py: weight_bytes,
# kv_read_bytes, kv_write_bytes, flops); forward_ms is the forward's wall time. The console's
# roofline and the diagnoser's signals both read these expressions.
#: bytes a step moved: weights read + KV read + KV written
STEP_BYTES_SQL = "(weight_bytes + kv_read_bytes + kv_write_bytes)"
#: arithmetic intensity of a step, FLOP/byte
STEP_INTENSITY_SQL = f"(flops::DOUBLE / nullif({STEP_BYTES_SQL}, 0))"
#: achieved memory bandwidth of a step, GB/s (bytes per ms / 1e6)
STEP_GBPS_SQL = f"({STEP_BYTES_SQL}::DOUBLE / nullif(forward_ms, 0) / 1e6)"
#: achieved compute of a step, GFLOP/s (FLOP per ms / 1e6)
STEP_GFLOPS_SQL = "(flops::DOUBLE / nullif(forward_ms, 0) / 1e6)"
#: a step the roofline counts: it ran tokens and carries its counts (older rows are NULL)
ROOFLINE_STEP_SQL = f"({WORKING_STEP_SQL} AND flops > 0 AND forward_ms > 0)"


def roofline_agg_sql(where: str = "TRUE") -> str:
    """SELECT columns of the roofline over a group of steps (those matching ``where`` and
    :data:`ROOFLINE_STEP_SQL`): ``roofline_steps``, ``step_bytes`` (sum, bytes), ``flops_sum``,
    ``arith_intensity`` (FLOP/byte), ``achieved_gbps`` (GB/s) and ``achieved_gflops`` (GFLOP/s),
    the latter as sums over the summed ``forward_ms``: time-weighted, as one long step would
    read."""
    f = f"FILTER (WHERE {ROOFLINE_STEP_SQL} AND ({where}))"
    return (
        f"count(*) {f} AS roofline_steps, "
        f"sum({STEP_BYTES_SQL}) {f} AS step_bytes, "
        f"sum(flops) {f} AS flops_sum, "
        f"sum(flops) {f} / nullif(sum({STEP_BYTES_SQL}) {f}, 0) AS arith_intensity, "
        f"sum({STEP_BYTES_SQL}) {f} / nullif(sum(forward_ms) {f}, 0) / 1e6 AS achieved_gbps, "
        f"sum(flops) {f} / nullif(sum(forward_ms) {f}, 0) / 1e6 AS achieved_gflops"
    )


# ---- speculative decoding of engine steps (StepRecord.num_drafts, num_draft_tokens,
# num_accepted_tokens, num_accepted_tokens_per_pos): the console's panel and the diagnoser's
# spec_decode_ineffective read these. Draft tokens are counted inside num_decode_tokens (a
# request verifying K drafts runs 1 + K decode tokens) and num_sampled counts every token a step
# produced, accepted drafts included. Rows from before the fields read NULL (coalesce).
#: a step that verified draft tokens
SPEC_STEP_SQL = "(coalesce(num_draft_tokens, 0) > 0)"
#: decode sequences a step ran: its decode tokens less the draft tokens verified
STEP_DECODE_SEQS_SQL = "(num_decode_tokens - coalesce(num_draft_tokens, 0))"
#: a working step of decodes only (no prefill chunk), with or without drafts
DECODE_ONLY_STEP_SQL = f"({WORKING_STEP_SQL} AND num_prefill_tokens = 0 AND num_decode_tokens > 0)"
#: output tokens per decode sequence of a decode-only step (1 without drafts)
STEP_TOKENS_PER_SEQ_SQL = f"(num_sampled::DOUBLE / nullif({STEP_DECODE_SEQS_SQL}, 0))"


def spec_agg_sql(where: str = "TRUE") -> str:
    """SELECT columns of speculative decoding over a group of steps (those matching ``where``):
    ``spec_steps`` (steps that verified drafts), ``spec_drafts``, ``spec_draft_tokens``,
    ``spec_accepted_tokens`` (sums), ``spec_acceptance_rate`` (accepted / draft tokens, 0..1)
    and ``spec_accepted_per_draft`` (accepted tokens per request-step that verified drafts, the
    tokens a draft adds to the one the step samples anyway)."""
    f = f"FILTER (WHERE {SPEC_STEP_SQL} AND ({where}))"
    return (
        f"count(*) {f} AS spec_steps, "
        f"sum(num_drafts) {f} AS spec_drafts, "
        f"sum(num_draft_tokens) {f} AS spec_draft_tokens, "
        f"sum(num_accepted_tokens) {f} AS spec_accepted_tokens, "
        f"sum(num_accepted_tokens::DOUBLE) {f} / nullif(sum(num_draft_tokens) {f}, 0) "
        "AS spec_acceptance_rate, "
        f"sum(num_accepted_tokens::DOUBLE) {f} / nullif(sum(num_drafts) {f}, 0) "
        "AS spec_accepted_per_draft"
    )


#: The tables generated from a row type, in the order they are created.
ROW_TYPES: dict[str, type[msgspec.Struct]] = {
    "spans": SpanRow,
    "requests": RequestRow,
    "engine_steps": StepRecord,
    "engine_samples": EngineSampleRow,
    "waiting_samples": WaitingSampleRow,
    "findings": FindingRow,
    "stream_samples": StreamSampleRow,
}

__all__ = [
    "ADDED_TABLES",
    "COMPLETED_FINISH_REASONS",
    "COMPLETED_SQL",
    "DECODE_ONLY_STEP_SQL",
    "DEFAULT_BLOCK_SIZE",
    "IDLE_KV_LEAK_SHARE",
    "ROOFLINE_STEP_SQL",
    "ROW_TYPES",
    "SCHEMA_VERSION",
    "SPEC_STEP_SQL",
    "STATIONS",
    "STEP_BYTES_SQL",
    "STEP_DECODE_SEQS_SQL",
    "STEP_GBPS_SQL",
    "STEP_GFLOPS_SQL",
    "STEP_INTENSITY_SQL",
    "STEP_TOKENS_PER_SEQ_SQL",
    "TABLES",
    "WORKING_STEP_SQL",
    "SchemaError",
    "apply_schema",
    "check_schema",
    "ddl",
    "expose_missing_columns",
    "has_table",
    "roofline_agg_sql",
    "spec_agg_sql",
    "sql_type",
    "struct_ddl",
]


class SchemaError(Exception):
    """A DuckDB file is not a tokenmill trace store of this schema version (one-line reason)."""


def sql_type(t: mi.Type) -> str:
    """The DuckDB type of one field type: an explicit ``Meta(extra={"sql": ...})`` wins, else
    int → INTEGER, float → DOUBLE, str → VARCHAR, bool → BOOLEAN, list[int] → BIGINT[],
    list[float] → DOUBLE[], list[str] → VARCHAR[], list[bool] → BOOLEAN[].

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
    lists = {mi.IntType: "BIGINT[]", mi.FloatType: "DOUBLE[]", mi.StrType: "VARCHAR[]"}
    lists[mi.BoolType] = "BOOLEAN[]"
    if isinstance(t, mi.ListType) and type(t.item_type) in lists:
        return lists[type(t.item_type)]
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


# columns of the written-out tables (schema.sql) added after the version was stamped: a store
# of this version written before them gets them as NULL (apply_schema, expose_missing_columns)
ADDED_COLUMNS: dict[str, dict[str, str]] = {
    "device_samples": {"loadgen_cpu_pct": "DOUBLE", "busy_others": "VARCHAR"},
}


def _missing_columns(con: duckdb.DuckDBPyConnection) -> dict[str, list[tuple[str, str]]]:
    """``{table: [(column, SQL type)]}`` the store lacks, row types and ADDED_COLUMNS alike."""
    out: dict[str, list[tuple[str, str]]] = {}
    for table, row_type in ROW_TYPES.items():
        have = set(columns(con, table))
        if not have:  # an added table the file lacks: expose_missing_columns makes it whole
            continue
        miss = [(f.name, sql_type(f.type)) for f in mi.type_info(row_type).fields]
        out[table] = [(n, t) for n, t in miss if n not in have]
    for table, cols in ADDED_COLUMNS.items():
        have = set(columns(con, table))
        out[table] = [(n, t) for n, t in cols.items() if n not in have]
    return {t: m for t, m in out.items() if m}


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
    for table, cols in ADDED_COLUMNS.items():
        have = set(columns(con, table))
        for name, typ in cols.items():
            if name not in have:
                con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {typ}")


def expose_missing_columns(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Let a store opened read-only, written before a nullable field existed, answer queries
    that name the field: a temporary view over each such table adds the missing columns as
    NULL (what :func:`apply_schema` would add to a writable file). Returns the
    ``table.column`` names added (and the names of added tables the file lacks, made empty)."""
    db = con.execute("SELECT current_database()").fetchone()[0]
    added = []
    for table in ADDED_TABLES:
        if not columns(con, table):
            con.execute(
                struct_ddl(table, ROW_TYPES[table]).replace("CREATE TABLE", "CREATE TEMP TABLE")
            )
            added.append(table)
    for table, missing in _missing_columns(con).items():
        extra = ", ".join(f"NULL::{typ} AS {name}" for name, typ in missing)
        con.execute(
            f'CREATE OR REPLACE TEMP VIEW {table} AS SELECT *, {extra} FROM "{db}".main.{table}'
        )
        added += [f"{table}.{name}" for name, _ in missing]
    return added


def columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """Column names of ``table`` in table order."""
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
        "ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return [r[0] for r in rows]


def has_table(con: duckdb.DuckDBPyConnection, database: str, schema: str, table: str) -> bool:
    """Whether ``database.schema.table`` exists (an attached file, or a schema of ``con``)."""
    return bool(
        con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE database_name = ? AND schema_name = ? "
            "AND table_name = ?",
            [database, schema, table],
        ).fetchone()[0]
    )


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
    missing = [t for t in TABLES if t not in present and t not in ADDED_TABLES]
    if missing:
        raise SchemaError(f"trace store lacks table(s) {', '.join(missing)}")
