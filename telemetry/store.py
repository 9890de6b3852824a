"""The DuckDB trace store: one file, written by one background thread in batches.

Producers (span processor, step listener, sampler, server events) call :meth:`TraceStore.submit`,
which never blocks: rows go into a bounded queue and, when it is full or the writer has failed,
they are dropped and counted per table. The writer groups rows by table and inserts each batch
as one Arrow table (``INSERT INTO t BY NAME``), which is what makes tens of thousands of spans a
second cheap on one core.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import threading
import time
from collections import Counter
from pathlib import Path

import duckdb
import pyarrow as pa

from tokenmill.engine.errors import TokenmillError

from .schema import TABLES, apply_schema

log = logging.getLogger(__name__)

_STOP = object()
BACKGROUND_NICE = 10  # telemetry threads yield the CPU to the engine and the event loop


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Give the calling thread a lower CPU priority (Linux: per-thread nice; elsewhere a no-op).

    The engine's torch threads wait for each other at every parallel op, so a telemetry thread
    that preempts one of them costs the whole op; at nice 10 it runs in the gaps instead.
    """
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))


def default_trace_db(path: str | None = None) -> str:
    """The store's absolute path: ``path``, or ``./tokenmill-data/traces.duckdb`` resolved where
    the server starts (``--trace-db`` or ``TOKENMILL_TRACE_DB`` put it elsewhere)."""
    return str(Path(path or "tokenmill-data/traces.duckdb").expanduser().resolve())


class TraceStoreInUse(TokenmillError):
    """Another process holds the store file (a second server on the same path): one line."""


class TraceStore:
    """Owner of one trace-store DuckDB file.

    Args:
        path: the DuckDB file (its folder is created). ``":memory:"`` for an in-memory store.
        max_queue_rows: rows that may wait for the writer; beyond that, rows are dropped.
        batch_rows: the writer inserts at most this many rows per table per transaction.
        flush_interval_s: rows wait up to this long (s) so that each insert is one batch.
        retention_s, max_bytes: roll rows older than this, or the oldest half past this file
            size, out to Parquet dumps in ``archive`` (``telemetry/retention.py``), checked
            every ``roll_interval_s`` by the writer; None: keep everything.
        archive: the archive folder (default ``<store folder>/archive``).

    Raises:
        TraceStoreInUse: another process has the file open (the server refuses to start).
        duckdb.Error, OSError, SchemaError: the file cannot be opened or has another schema.
        The server catches these and serves on without a store (drops counted).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_queue_rows: int = 200_000,
        batch_rows: int = 8192,
        flush_interval_s: float = 1.0,
        retention_s: float | None = None,
        max_bytes: int | None = None,
        archive: str | Path | None = None,
        roll_interval_s: float = 30.0,
    ):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # one DuckDB thread: the store shares the API process with the server, and inserts of a
        # few thousand rows gain nothing from a parallel pipeline
        try:
            self._con = duckdb.connect(self.path, config={"threads": 1})
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                holder = re.search(r"\(PID (\d+)\)", str(exc))
                who = f"process {holder.group(1)}" if holder else "another process"
                raise TraceStoreInUse(
                    f"trace store {self.path} is in use by {who} (another server?): give this "
                    "one its own --trace-db"
                ) from None
            raise
        self.retention_s, self.max_bytes = retention_s, max_bytes
        self.archive = Path(archive) if archive else Path(self.path).parent / "archive"
        self.roll_interval_s = roll_interval_s
        self._last_roll = time.monotonic()
        self.rolled: Counter = Counter()  # rows moved to the archive, per table
        self.roll_error: str | None = None
        apply_schema(self._con)
        self._types = {t: self._arrow_schema(t) for t in TABLES}
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_rows)
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        self.written: Counter = Counter()
        self.dropped: Counter = Counter()
        self.error: str | None = None
        self._lock = threading.Lock()  # guards the connection for readers (query/checkpoint)
        self._idle = threading.Event()
        self._wake = threading.Event()  # cuts the batching wait short (flush, close)
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="tokenmill-trace-writer", daemon=True
        )
        self._thread.start()

    # ----- producers -----
    def submit(self, table: str, row: dict) -> bool:
        """Queue one row (a dict of column -> value; missing columns are NULL).

        Returns False (and counts a drop for ``table``) when the queue is full, the writer is
        dead, or the store is closed. Never blocks.
        """
        if self._closed or not self._thread.is_alive():
            self.dropped[table] += 1
            return False
        try:
            self._queue.put_nowait((table, row))
        except queue.Full:
            self.dropped[table] += 1
            return False
        self._idle.clear()
        return True

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def writer_alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> dict:
        """What ``/health`` shows about the store."""
        return {
            "path": self.path,
            "writer_alive": self.writer_alive,
            "queued_rows": self._queue.qsize(),
            "written_rows": dict(self.written),
            "dropped_rows": dict(self.dropped),
            "error": self.error,
            "file_bytes": self.file_bytes(),
            "rolled_rows": dict(self.rolled),
            "roll_error": self.roll_error,
        }

    # ----- readers -----
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued row is written; False on timeout or a dead writer."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._wake.set()
            if self._queue.empty() and self._idle.is_set():
                return True
            if not self._thread.is_alive():
                return False
            self._idle.wait(0.05)
        return False

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        """Run a read query on the live store (serialized with the writer)."""
        with self._lock:
            return self._con.execute(sql, params or []).fetchall()

    def connection_locked(self):
        """``with store.connection_locked() as con:`` for a caller that needs the connection
        itself (dumps), holding off the writer meanwhile."""
        store = self

        class _Ctx:
            def __enter__(self):
                store._lock.acquire()
                return store._con

            def __exit__(self, *exc):
                store._lock.release()

        return _Ctx()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, stop the writer, close the file."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(_STOP, timeout=timeout_s)
            self._wake.set()
            self._thread.join(timeout_s)
        with self._lock:
            self._con.close()

    # ----- the writer thread -----
    def _arrow_schema(self, table: str) -> pa.Schema:
        return self._con.sql(f"SELECT * FROM {table} LIMIT 0").to_arrow_table().schema

    def _run(self) -> None:
        lower_thread_priority()
        try:
            while True:
                self._maybe_roll()
                try:
                    first = self._queue.get(timeout=self.flush_interval_s)
                except queue.Empty:
                    self._idle.set()
                    continue
                # let a batch gather: one insert per flush interval, not one per row (a
                # commit costs milliseconds of CPU that the engine's process would miss)
                if first is not _STOP and self._queue.qsize() < self.batch_rows:
                    self._wake.wait(self.flush_interval_s)
                self._wake.clear()
                items = [first]
                while len(items) < self.batch_rows * 4:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = any(it is _STOP for it in items)
                self._write([it for it in items if it is not _STOP])
                if self._queue.empty():
                    self._idle.set()
                if stop:
                    return
        except Exception as exc:  # the store is gone; producers now count drops
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.error("trace store writer stopped: %s", self.error)
            self._drain_as_dropped()

    def _maybe_roll(self, force: bool = False) -> Path | None:
        """Roll old rows out to the archive when retention or the size cap says so (at most
        once per ``roll_interval_s`` unless ``force``); the writer thread's, or under the lock.
        A failure is logged and kept in ``roll_error``; the rows stay in the live file."""
        if self.retention_s is None and self.max_bytes is None:
            return None
        if not force and time.monotonic() - self._last_roll < self.roll_interval_s:
            return None
        self._last_roll = time.monotonic()
        from .retention import cutoff_ns, roll_out

        with self._lock:
            try:
                cut = cutoff_ns(
                    self._con,
                    time.time_ns(),
                    retention_s=self.retention_s,
                    max_bytes=self.max_bytes,
                    file_bytes=self.file_bytes(),
                )
                if cut is None:
                    return None
                out, moved = roll_out(self._con, cut, self.archive, self.path)
            except Exception as exc:
                self.roll_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log.error("trace store roll-out failed: %s", self.roll_error)
                return None
        self.roll_error = None
        self.rolled.update(moved)
        if out is not None:
            log.info("rolled %d rows older than %d out to %s", sum(moved.values()), cut, out)
        return out

    def file_bytes(self) -> int:
        """The store file's size with its write-ahead log (0 in memory)."""
        if self.path == ":memory:":
            return 0
        p = Path(self.path)
        return sum(f.stat().st_size for f in (p, p.with_name(p.name + ".wal")) if f.exists())

    def _drain_as_dropped(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self.dropped[item[0]] += 1

    def _write(self, items: list[tuple[str, dict]]) -> None:
        by_table: dict[str, list[dict]] = {}
        for table, row in items:
            by_table.setdefault(table, []).append(row)
        pending = Counter({table: len(rows) for table, rows in by_table.items()})
        try:
            with self._lock:
                self._con.begin()  # one commit (one WAL sync) per batch, all tables together
                written = Counter()
                try:
                    for table, rows in by_table.items():
                        if table not in self._types:
                            log.warning("dropping %d rows for unknown table %r", len(rows), table)
                            continue
                        for i in range(0, len(rows), self.batch_rows):
                            batch = rows[i : i + self.batch_rows]
                            self._insert(table, batch)
                            written[table] += len(batch)
                    self._con.commit()
                except BaseException:
                    with contextlib.suppress(duckdb.Error):
                        self._con.rollback()
                    raise
                pending.subtract(written)
                self.written.update(written)
        finally:  # rows not written (unknown table, or the insert failed) are counted as drops
            self.dropped.update(+pending)

    def _insert(self, table: str, rows: list[dict]) -> None:
        schema = self._types[table]
        present = {k for row in rows for k in row}
        fields = [f for f in schema if f.name in present]
        cols = {f.name: [row.get(f.name) for row in rows] for f in fields}
        batch = pa.table(cols, schema=pa.schema(fields))  # noqa: F841 (read by DuckDB by name)
        names = ", ".join(f.name for f in fields)
        self._con.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM batch")
