"""Parquet trace dumps: the tables of a dump as one Parquet file each, in a folder.

A Parquet dump is a folder holding ``meta.parquet`` and one ``<table>.parquet`` per table of
:data:`~tokenmill.telemetry.schema.TABLES`, written by DuckDB's ``COPY ... TO ... (FORMAT
parquet)`` from a DuckDB dump (:func:`export_parquet`). DuckDB, Spark or Trino read it as
fleet-scale trace data; tokenmill reads it back with :func:`load_parquet` (``open_dump`` on a
folder), which builds the store's tables (this version's DDL) in a DuckDB database and checks
the schema version before copying a row, like a DuckDB dump.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

import duckdb

from .schema import ADDED_TABLES, SCHEMA_VERSION, TABLES, ddl

META_FILE = "meta.parquet"
PARQUET_TABLES = ("meta", *TABLES)


class ParquetDumpError(Exception):
    """A Parquet dump cannot be written or read (one-line reason, naming the folder)."""


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_parquet_dump(path: str | Path) -> bool:
    """True when ``path`` is a folder holding ``meta.parquet`` (a Parquet dump, maybe broken)."""
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file()


def not_a_parquet_dump(path: str | Path) -> str | None:
    """Why ``path`` looks like part of a Parquet dump but is not one (one line), or None: a
    lone table file of a dump, or a folder of Parquet tables without :data:`META_FILE`."""
    p = Path(path)
    if p.is_file() and p.suffix == ".parquet":
        return f"{p}: one table of a Parquet dump; give the dump's folder, {p.parent}"
    if p.is_dir() and not (p / META_FILE).is_file() and any(p.glob("*.parquet")):
        return f"{p}: Parquet tables without {META_FILE}, which a Parquet dump folder holds"
    return None


def export_parquet(
    con: duckdb.DuckDBPyConnection, out_dir: str | Path, *, overwrite: bool = False
) -> None:
    """Write the tables of ``con`` (an open dump) as Parquet files into the folder ``out_dir``.

    The files go to a temporary folder next to ``out_dir``, renamed at the end: a failed export
    leaves nothing behind.

    Raises:
        ParquetDumpError: ``out_dir`` exists (and not ``overwrite``, or it is a file), its
            parent folder is missing, or DuckDB/the file system failed (one line).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ParquetDumpError(f"{out} is a file, not a folder")
    if out.exists() and not overwrite:
        raise ParquetDumpError(f"{out} already exists (choose another name or allow overwriting)")
    if not out.parent.is_dir():
        raise ParquetDumpError(f"folder {out.parent} does not exist")
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        tmp.mkdir()
        for table in PARQUET_TABLES:
            target = _sql_string(str(tmp / f"{table}.parquet"))
            con.execute(f"COPY (SELECT * FROM {table}) TO {target} (FORMAT parquet)")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except (duckdb.Error, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ParquetDumpError(f"writing {out} failed: {_one_line(exc)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_parquet(
    folder: str | Path, con: duckdb.DuckDBPyConnection | None = None, schema: str = "main"
) -> duckdb.DuckDBPyConnection:
    """Build the store's tables from the Parquet dump ``folder``.

    Args:
        con: the database to build them in (default: a new in-memory DuckDB).
        schema: the schema of ``con`` to build them in (created if missing).

    Returns:
        ``con`` (or the new connection).

    Raises:
        ParquetDumpError: not a Parquet dump (no ``meta.parquet``), another schema version, a
            missing table file, or an unreadable file (one line naming the folder).
    """
    p = Path(folder)
    if not p.is_dir():
        raise ParquetDumpError(f"{p}: not a folder")
    if not (p / META_FILE).is_file():
        raise ParquetDumpError(f"{p}: not a Parquet dump (no {META_FILE})")
    own = con is None
    con = duckdb.connect(":memory:") if own else con
    try:
        try:
            rows = con.execute(
                "SELECT value FROM read_parquet(?) WHERE key = 'schema_version'",
                [str(p / META_FILE)],
            ).fetchall()
        except duckdb.Error as exc:
            raise ParquetDumpError(f"{p}: unreadable {META_FILE} ({_one_line(exc)})") from None
        if not rows:
            raise ParquetDumpError(f"{p}: not a tokenmill dump (no schema_version in meta)")
        if rows[0][0] != str(SCHEMA_VERSION):
            raise ParquetDumpError(
                f"{p}: schema version {rows[0][0]}; this tokenmill reads version {SCHEMA_VERSION}"
            )
        present = [t for t in PARQUET_TABLES if (p / f"{t}.parquet").is_file()]
        missing = [t for t in PARQUET_TABLES if t not in present and t not in ADDED_TABLES]
        if missing:
            raise ParquetDumpError(
                f"{p}: Parquet dump lacks table file(s) {', '.join(t + '.parquet' for t in missing)}"
            )
        try:
            # a cursor of its own: its USE does not move the caller's default schema
            cur = con.cursor()
            if schema != "main":
                (db,) = cur.execute("SELECT current_database()").fetchone()
                cur.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                cur.execute(f'USE "{db}"."{schema}"')
            cur.execute(ddl())
            for table in present:
                cur.execute(
                    f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet(?)",
                    [str(p / f"{table}.parquet")],
                )
            cur.close()
        except duckdb.Error as exc:
            raise ParquetDumpError(
                f"{p}: cannot read the Parquet dump ({_one_line(exc)})"
            ) from None
    except BaseException:
        if own:
            with contextlib.suppress(duckdb.Error):
                con.close()
        raise
    return con
