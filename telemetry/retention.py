"""Trace-store retention: old rows leave the live file for Parquet dumps in an archive folder.

``tokenmill serve --trace-retention 24h`` keeps about a day in the live DuckDB file;
``--trace-max-bytes`` caps the file's size (the oldest half of what it holds rolls out when it
is over). Each roll-out (:func:`roll_out`) writes the rows older than a cutoff as one Parquet
dump ``<first ns>-<cutoff ns>/`` in the archive folder (default ``<store folder>/archive``),
then deletes exactly those rows from the live file, in the store's writer thread (nothing else
writes meanwhile). The archive folder carries :data:`ARCHIVE_FILE` naming the live store, and
:func:`open_archive` reads every roll-out in it back as one store: ``tokenmill diagnose
ARCHIVE_FOLDER`` diagnoses them as the one source they came from (add the live file's own dump
for the recent part).

After each roll-out the store tidies the archive (``telemetry/archive.py``): small roll-outs
merge into one folder per hour (per day for earlier days), and ``--trace-archive-max-age`` /
``--trace-archive-max-bytes`` delete the oldest folders. A reader never sees a folder half
written or half deleted: hidden (dot) folders are skipped, so are the parts a merged folder
names in its :data:`MERGED_FILE` (for the moment before they are deleted), and a read that
saw the folders change under it starts over.

A row's time is the same one dumps use (``telemetry/dump.py``): a request and its spans by the
request's arrival, steps by their start, samples and events by their time.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import duckdb

from .dump import TIME_COLUMN, DumpError, trace_ids_sql, write_dump
from .parquet_dump import ParquetDumpError, export_parquet, load_parquet
from .schema import SCHEMA_VERSION, TABLES, ddl

__all__ = [
    "ARCHIVE_FILE",
    "MERGED_FILE",
    "cutoff_ns",
    "is_archive",
    "open_archive",
    "read_parts",
    "roll_out",
    "visible_parts",
]

#: the file that makes a folder a roll-out archive: ``{"rolled_from": live store path}``
ARCHIVE_FILE = "archive.json"
#: the file in a merged folder naming the folders it replaces: ``{"parts": [names]}``
MERGED_FILE = "merged_from.json"
_READ_TRIES = 8  # reads of an archive that changed under them before the last one is kept


def is_archive(folder: str | Path) -> bool:
    return (Path(folder) / ARCHIVE_FILE).is_file()


def _oldest_ns(con: duckdb.DuckDBPyConnection) -> int | None:
    """The oldest row time in the store (None when empty)."""
    parts = ["SELECT min(arrival_ns) FROM requests", "SELECT min(start_ns) FROM spans"]
    parts += [f"SELECT min({c}) FROM {t}" for t, c in TIME_COLUMN.items()]
    (oldest,) = con.execute(f"SELECT min(m) FROM ({' UNION ALL '.join(parts)}) AS x(m)").fetchone()
    return oldest


def cutoff_ns(
    con: duckdb.DuckDBPyConnection,
    now_ns: int,
    *,
    retention_s: float | None,
    max_bytes: int | None,
    file_bytes: int,
) -> int | None:
    """The time before which rows roll out now: ``now - retention``, or past ``max_bytes``
    the middle of what the file holds (the later of the two); None when nothing is due."""
    oldest = _oldest_ns(con)
    if oldest is None:
        return None
    cut = None
    if retention_s is not None and oldest < now_ns - retention_s * 1e9:
        cut = int(now_ns - retention_s * 1e9)
    if max_bytes is not None and file_bytes > max_bytes:
        half = oldest + (now_ns - oldest) // 2
        cut = max(cut or 0, half)
    return cut


def roll_out(
    con: duckdb.DuckDBPyConnection, cutoff: int, archive: str | Path, live_path: str
) -> tuple[Path | None, dict[str, int]]:
    """Move every row older than ``cutoff`` from the store ``con`` to a new Parquet dump in
    ``archive``: ``(its folder or None when nothing was older, rows moved per table)``.

    The copy is written and published first; only then are the same rows deleted, in one
    transaction (a failure leaves them in the live file, and at worst a dump that repeats them
    is never written half: the folder appears whole or not at all).

    Raises:
        DumpError, ParquetDumpError: the archive could not be written (one line).
    """
    folder = Path(archive)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / ARCHIVE_FILE
    if not marker.exists():
        marker.write_text(json.dumps({"rolled_from": str(Path(live_path).resolve())}) + "\n")
    oldest = _oldest_ns(con)
    if oldest is None or oldest >= cutoff:
        return None, {}
    tmp = folder / f".roll-{cutoff}.duckdb"
    counts = write_dump(
        con, tmp, until_ns=cutoff, source=f"roll-out of {live_path}", overwrite=True
    )
    try:
        out = folder / f"{oldest}-{cutoff}"
        with duckdb.connect(str(tmp), read_only=True) as dump:
            export_parquet(dump, out, overwrite=True)
    finally:
        for p in (tmp, tmp.with_name(tmp.name + ".wal")):
            p.unlink(missing_ok=True)
    traces = trace_ids_sql(None, cutoff)
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute(f"CREATE OR REPLACE TEMP TABLE rolled_traces AS {traces}")
        for table in ("spans", "requests"):
            con.execute(f"DELETE FROM {table} WHERE trace_id IN (SELECT * FROM rolled_traces)")
        for table, column in TIME_COLUMN.items():
            con.execute(f"DELETE FROM {table} WHERE {column} < {int(cutoff)}")
        con.execute("DROP TABLE rolled_traces")
        con.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise
    con.execute("CHECKPOINT")
    return out, counts


def visible_parts(folder: str | Path) -> list[Path]:
    """The roll-out folders a reader of the archive ``folder`` reads, by name: every folder not
    hidden (a dot-name: being written or deleted) and not replaced by a merged folder beside it
    (named in its :data:`MERGED_FILE`, in the moment before the parts it merged are gone)."""
    p = Path(folder)
    shown = [d for d in p.iterdir() if d.is_dir() and not d.name.startswith(".")]
    replaced = {name for d in shown for name in merged_from(d)}
    return sorted((d for d in shown if d.name not in replaced), key=lambda d: d.name)


def merged_from(part: Path) -> list[str]:
    """The folders the merged folder ``part`` replaced ([] for a plain roll-out)."""
    try:
        return list(json.loads((part / MERGED_FILE).read_text())["parts"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def read_parts(
    parts: list[Path], source: str | None = None, threads: int | None = None
) -> duckdb.DuckDBPyConnection:
    """The Parquet dumps ``parts`` as one in-memory store: every row of each, and a ``meta``
    of the span they cover together, from ``source`` (default: the first part's).

    Raises:
        ParquetDumpError, duckdb.Error, KeyError, ValueError: a part cannot be read.
    """
    con = duckdb.connect(":memory:", config={"threads": threads} if threads else {})
    try:
        con.execute(ddl())
        starts, ends, sources = [], [], []
        for i, part in enumerate(parts):
            load_parquet(part, con, schema=f"rollout{i}")  # each in a schema of its own
            meta = dict(con.execute(f"SELECT key, value FROM rollout{i}.meta").fetchall())
            starts.append(int(meta["window_start_ns"]))
            ends.append(int(meta["window_end_ns"]))
            sources.append(meta.get("source", str(part)))
            for table in TABLES:
                if table != "meta":
                    con.execute(
                        f"INSERT INTO main.{table} BY NAME SELECT * FROM rollout{i}.{table}"
                    )
            con.execute(f"DROP SCHEMA rollout{i} CASCADE")
        con.executemany(
            "INSERT INTO meta VALUES (?, ?)",
            [["schema_version", str(SCHEMA_VERSION)], ["window_start_ns", str(min(starts))],
             ["window_end_ns", str(max(ends))], ["dumped_at_ns", str(time.time_ns())],
             ["source", source or sources[0]]],
        )  # fmt: skip
    except BaseException:
        con.close()
        raise
    return con


def _read_archive(p: Path, parts: list[Path]) -> duckdb.DuckDBPyConnection:
    """The roll-outs ``parts`` of the archive ``p`` as one in-memory store."""
    try:
        source = json.loads((p / ARCHIVE_FILE).read_text()).get("rolled_from", str(p))
        return read_parts(parts, source=f"archive of {source}")
    except (ParquetDumpError, duckdb.Error, OSError, ValueError, KeyError) as exc:
        raise DumpError(f"{p}: {str(exc).splitlines()[0]}") from None


def open_archive(folder: str | Path) -> duckdb.DuckDBPyConnection:
    """Every roll-out in the archive ``folder``, oldest first, as one in-memory store (its
    ``meta`` the span they cover together).

    The archive may change while it is read (a new roll-out, a merge, a pruned folder): the
    read starts over when the folders it listed are not the ones there at its end, so it sees
    each row once, never a half-deleted folder (a few tries; the last one's read is kept).

    Raises:
        DumpError: no roll-out in it, or one that cannot be read (one line).
    """
    p = Path(folder)
    for attempt in range(_READ_TRIES):
        parts = visible_parts(p)
        if not parts:
            raise DumpError(f"{p}: an archive with no roll-out in it yet")
        try:
            con = _read_archive(p, parts)
        except DumpError:
            if visible_parts(p) == parts or attempt == _READ_TRIES - 1:
                raise
            continue  # a folder went (pruned, or merged) while it was read
        if visible_parts(p) == parts or attempt == _READ_TRIES - 1:
            return con
        con.close()
    raise AssertionError("unreachable")
