"""The DuckDB trace store: one file, written by one background thread in batches.

Producers (span processor, step listener, sampler, server events) call :meth:`TraceStore.submit`,
which never blocks: rows go into a bounded queue and, when it is full, they are dropped and
counted. The writer groups rows by table and inserts each batch as one Arrow table (``INSERT INTO
t BY NAME``), which is what makes tens of thousands of spans a second cheap on one core.

The store fails soft: nothing that goes wrong with it stops the writer or reaches the callers.
A row that could not be written is dropped and counted per table and :data:`DROP_REASONS`
reason (``TraceStore.drops``; the server's ``tokenmill_telemetry_dropped_total{table,reason}``).
A row with a value its column cannot hold (a string token count, a number past the column's
range) is dropped on its own: the batch is split until the bad rows are alone, and the rest is
written. A full disk, an unwritable file or any other DuckDB error drops the batch in hand and is
logged once per cause, with the rows it cost when it ends; the writer keeps taking batches and
writes again as soon as the cause goes (space freed). A store file removed under a running
writer is noticed before the next batch and a new one is opened at the same path; a connection
DuckDB gave up on ("invalidated") is reopened.
"""

from __future__ import annotations

import contextlib
import errno
import json
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
from tokenmill.engine.settings import DEFAULT_TRACE_DB

from .schema import TABLES, apply_schema

log = logging.getLogger(__name__)

_STOP = object()

#: why a row did not reach the store: the ``reason`` label of the drop counter
DROP_REASONS = {
    "queue_full": "the writer's queue was full (the writer fell behind)",
    "closed": "the store was closed, or its writer thread is gone",
    "bad_value": "a value its column cannot hold (a string count, a number out of range)",
    "disk_full": "no space left on the store's device",
    "unwritable": "the store file or its folder cannot be written (permissions, immutable, "
    "read-only file system)",
    "store_error": "another DuckDB or I/O error",
    "unknown_table": "a table the store does not have",
    "no_store": "the store could not be opened at all (the server serves without one)",
}

# DuckDB and Arrow errors that say a value does not fit its column (the row's fault, not the
# store's): such a row is dropped alone
_VALUE_ERRORS = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    OverflowError,
    TypeError,
    ValueError,
    duckdb.ConversionException,
    duckdb.ConstraintException,
    duckdb.OutOfRangeException,
    duckdb.InvalidInputException,
    duckdb.TypeMismatchException,
)


def drop_reason(exc: BaseException) -> str:
    """The :data:`DROP_REASONS` reason a failed write gives its rows."""
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in text:
        return "disk_full"
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "unwritable"
    if any(m in text for m in ("Permission denied", "Operation not permitted", "Read-only file")):
        return "unwritable"
    if isinstance(exc, _VALUE_ERRORS) and not isinstance(exc, OSError):
        return "bad_value"
    return "store_error"


def by_reason(drops: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """Drop counts per ``(table, reason)`` as ``{reason: {table: rows}}`` (``/health``)."""
    out: dict[str, dict[str, int]] = {}
    for (table, reason), n in sorted(drops.items()):
        out.setdefault(reason, {})[table] = n
    return out


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


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
    """The store's absolute path: ``path``, or :data:`DEFAULT_TRACE_DB` resolved where
    the server starts (``--trace-db`` or ``TOKENMILL_TRACE_DB`` put it elsewhere)."""
    return str(Path(path or DEFAULT_TRACE_DB).expanduser().resolve())


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
        archive_max_age_s, archive_max_bytes: after each roll-out the archive is tidied in a
            thread of its own (``telemetry/archive.py``): its folders older than this are
            deleted, small ones merged, then the oldest deleted until it holds at most this
            many bytes; None: no bound. Counts in ``pruned`` and ``compacted``, and in
            :meth:`health`.

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
        archive_max_age_s: float | None = None,
        archive_max_bytes: int | None = None,
    ):
        self.path = str(path)
        self._con: duckdb.DuckDBPyConnection | None = None
        self._file_id: tuple[int, int] | None = None
        self._open()
        self.retention_s, self.max_bytes = retention_s, max_bytes
        self.archive = Path(archive) if archive else Path(self.path).parent / "archive"
        self.roll_interval_s = roll_interval_s
        self._last_roll = time.monotonic()
        self.rolled: Counter = Counter()  # rows moved to the archive, per table
        self.roll_error: str | None = None
        self.archive_max_age_s, self.archive_max_bytes = archive_max_age_s, archive_max_bytes
        self.pruned = Counter(folders=0, bytes=0)  # archive folders (and bytes) deleted
        self.compacted = Counter(merges=0, folders=0)  # merges, and the folders merged
        self.archive_state: dict = {"folders": None, "bytes": None}  # after the last tidy
        self.archive_error: str | None = None
        self._tidier: threading.Thread | None = None
        self._types = {t: self._arrow_schema(t) for t in TABLES}
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_rows)
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        self.written: Counter = Counter()
        self.drops: Counter = Counter()  # rows dropped per (table, reason): DROP_REASONS
        self.error: str | None = None  # the last write error (one line); None once writing again
        self.problem: str | None = None  # the reason rows are being dropped now, if any
        self._problem_since: Counter = Counter()  # drops of the current problem, per table
        self._problem_started_ns: int | None = None
        self._bad_logged = 0.0  # when a dropped bad value was last logged (monotonic)
        self._bad_unlogged = 0
        self.reopened = 0  # times the file was reopened (removed under us, or invalidated)
        self._lock = threading.Lock()  # guards the connection for readers (query/checkpoint)
        self._idle = threading.Event()
        self._wake = threading.Event()  # cuts the batching wait short (flush, close)
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="tokenmill-trace-writer", daemon=True
        )
        self._thread.start()

    def _open(self) -> None:
        """Open (or reopen) the file and apply the schema; remembers which file it is."""
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # one DuckDB thread: the store shares the API process with the server, and inserts of a
        # few thousand rows gain nothing from a parallel pipeline
        try:
            con = duckdb.connect(self.path, config={"threads": 1})
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                holder = re.search(r"\(PID (\d+)\)", str(exc))
                who = f"process {holder.group(1)}" if holder else "another process"
                raise TraceStoreInUse(
                    f"trace store {self.path} is in use by {who} (another server?): give this "
                    "one its own --trace-db"
                ) from None
            raise
        try:
            apply_schema(con)
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                con.close()
            raise
        self._con = con
        self._file_id = self._stat_id()

    def _stat_id(self) -> tuple[int, int] | None:
        if self.path == ":memory:":
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    # ----- producers -----
    def submit(self, table: str, row: dict) -> bool:
        """Queue one row (a dict of column -> value; missing columns are NULL).

        Returns False (and counts a drop for ``table``) when the queue is full or the store is
        closed. Never blocks.
        """
        if self._closed or not self._thread.is_alive():
            self.drops[(table, "closed")] += 1
            return False
        try:
            self._queue.put_nowait((table, row))
        except queue.Full:
            self.drops[(table, "queue_full")] += 1
            return False
        self._idle.clear()
        return True

    def drop(self, table: str, reason: str, rows: int = 1) -> None:
        """Count ``rows`` of ``table`` that a producer refused before submitting (e.g. the OTLP
        receiver's spans with a value the store cannot hold: ``bad_value``)."""
        if rows:
            self.drops[(table, reason)] += rows

    @property
    def dropped(self) -> Counter:
        """Rows dropped per table, all reasons together."""
        out: Counter = Counter()
        for (table, _), n in dict(self.drops).items():
            out[table] += n
        return out

    def dropped_by_reason(self) -> dict[str, dict[str, int]]:
        """``{reason: {table: rows}}``: every drop so far."""
        return by_reason(dict(self.drops))

    @property
    def dropped_total(self) -> int:
        return sum(dict(self.drops).values())

    @property
    def writer_alive(self) -> bool:
        return self._thread.is_alive()

    def health(self) -> dict:
        """What ``/health`` shows about the store: ``problem`` is the reason rows are being
        dropped now (None while they are written), ``error`` its last error line."""
        return {
            "path": self.path,
            "writer_alive": self.writer_alive,
            "problem": self.problem,
            "queued_rows": self._queue.qsize(),
            "written_rows": dict(self.written),
            "dropped_rows": dict(self.dropped),
            "dropped_by_reason": self.dropped_by_reason(),
            "error": self.error,
            "reopened": self.reopened,
            "file_bytes": self.file_bytes(),
            "rolled_rows": dict(self.rolled),
            "roll_error": self.roll_error,
            "archive": {
                **self.archive_state,
                "pruned": dict(self.pruned),
                "compacted": dict(self.compacted),
                "error": self.archive_error,
            },
        }

    def check_rows(self, table: str, rows: list[dict]) -> list[str | None]:
        """Per row, why the store could not hold it (one line), or None: the same conversion
        the writer makes, so a producer can refuse a row and say why (the OTLP receiver's
        ``partial_success``) before it is queued. Checks the whole list at once, and row by
        row only when that fails."""
        if table not in self._types:
            return [f"unknown table {table!r}"] * len(rows)
        try:
            self._arrow_batch(table, rows)
            return [None] * len(rows)
        except _VALUE_ERRORS:
            pass
        out: list[str | None] = []
        for row in rows:
            try:
                self._arrow_batch(table, [row])
                out.append(None)
            except _VALUE_ERRORS as exc:
                out.append(self._bad_value_line(table, row, exc))
        return out

    def _bad_value_line(self, table: str, row: dict, exc: BaseException) -> str:
        """Names the column a bad row's value does not fit, where one alone does not."""
        schema = self._types[table]
        for f in schema:
            if f.name in row:
                try:
                    pa.array([row[f.name]], type=f.type)
                except (*_VALUE_ERRORS,):
                    return f"{f.name} {str(row[f.name])[:40]!r} does not fit {f.type}"
        return _one_line(exc)

    # ----- readers -----
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued row is handled (written or dropped); False on timeout or a
        dead writer."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._wake.set()
            if self._queue.empty() and self._idle.is_set():
                return True
            if not self._thread.is_alive():
                return False
            self._idle.wait(0.05)
        return False

    def _connection(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise duckdb.ConnectionException(
                f"trace store {self.path} is not open ({self.error or 'closed'})"
            )
        return self._con

    def query(self, sql: str, params: list | None = None) -> list[tuple]:
        """Run a read query on the live store (serialized with the writer)."""
        with self._lock:
            return self._connection().execute(sql, params or []).fetchall()

    def connection_locked(self):
        """``with store.connection_locked() as con:`` for a caller that needs the connection
        itself (dumps), holding off the writer meanwhile."""
        store = self

        class _Ctx:
            def __enter__(self):
                store._lock.acquire()
                try:
                    return store._connection()
                except BaseException:
                    store._lock.release()
                    raise

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
        self.wait_tidy(min(timeout_s, 5.0))  # one cut short is finished by the next tidy
        self._end_problem("the store closed")
        with self._lock:
            if self._con is not None:
                try:
                    self._con.close()
                except duckdb.Error as exc:  # e.g. the closing checkpoint on a full disk
                    log.warning("trace store %s: closing: %s", self.path, _one_line(exc))
                self._con = None

    # ----- the writer thread -----
    def _arrow_schema(self, table: str) -> pa.Schema:
        return self._connection().sql(f"SELECT * FROM {table} LIMIT 0").to_arrow_table().schema

    def _run(self) -> None:
        lower_thread_priority()
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
            rows = [it for it in items if it is not _STOP]
            try:
                self._write(rows)
            except Exception as exc:  # never let one batch end the writer
                self._drop_batch(rows, "store_error", exc)
            if self._queue.empty():
                self._idle.set()
            if stop:
                return

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
                con = self._connection()
                cut = cutoff_ns(
                    con,
                    time.time_ns(),
                    retention_s=self.retention_s,
                    max_bytes=self.max_bytes,
                    file_bytes=self.file_bytes(),
                )
                if cut is None:
                    return None
                out, moved = roll_out(con, cut, self.archive, self.path)
            except Exception as exc:
                self.roll_error = _one_line(exc)
                log.error("trace store roll-out failed: %s", self.roll_error)
                return None
        self.roll_error = None
        self.rolled.update(moved)
        if out is not None:
            log.info("rolled %d rows older than %d out to %s", sum(moved.values()), cut, out)
            self._start_tidy()
        return out

    def _start_tidy(self) -> None:
        """Tidy the archive in a thread of its own (a merge may take seconds that the writer
        must not wait), unless one is still at it: the next roll-out starts the next."""
        if self._tidier is not None and self._tidier.is_alive():
            return
        self._tidier = threading.Thread(
            target=self._tidy_archive, args=(True,), name="tokenmill-trace-archive", daemon=True
        )
        self._tidier.start()

    def wait_tidy(self, timeout_s: float = 60.0) -> bool:
        """Wait for the archive's tidy in progress, if any; False if it is still running."""
        if self._tidier is not None:
            self._tidier.join(timeout_s)
            return not self._tidier.is_alive()
        return True

    def _tidy_archive(self, background: bool = False) -> None:
        """Prune and compact the archive after a roll-out (``telemetry/archive.py``); it only
        reads and writes archive folders, never the store. A failure is logged and kept in
        ``archive_error``."""
        from .archive import tidy_archive

        if background:
            lower_thread_priority()

        try:
            done = tidy_archive(
                self.archive,
                time.time_ns(),
                max_age_s=self.archive_max_age_s,
                max_bytes=self.archive_max_bytes,
            )
        except Exception as exc:
            self.archive_error = _one_line(exc)
            log.error("trace archive %s: tidying failed: %s", self.archive, self.archive_error)
            return
        self.archive_error = done.error
        if done.error:
            log.error("trace archive %s: %s", self.archive, done.error)
        self.pruned.update({"folders": done.pruned_folders, "bytes": done.pruned_bytes})
        self.compacted.update({"merges": done.merges, "folders": done.merged_folders})
        self.archive_state = {"folders": done.folders, "bytes": done.bytes}
        if done.merges:
            log.info(
                "trace archive %s: merged %d folders into %d",
                self.archive,
                done.merged_folders,
                done.merges,
            )
        if done.pruned_folders:
            log.info(
                "trace archive %s: deleted %d old folder(s), %d bytes; %d folder(s), %d bytes left",
                self.archive,
                done.pruned_folders,
                done.pruned_bytes,
                done.folders,
                done.bytes,
            )

    def file_bytes(self) -> int:
        """The store file's size with its write-ahead log (0 in memory)."""
        if self.path == ":memory:":
            return 0
        p = Path(self.path)
        total = 0
        for f in (p, p.with_name(p.name + ".wal")):
            with contextlib.suppress(OSError):
                total += f.stat().st_size
        return total

    # ----- failing soft -----
    def _trouble(self, reason: str, exc: BaseException | None, rows: Counter) -> None:
        """Count ``rows`` (per table) as dropped for ``reason``; a new cause is logged once."""
        for table, n in rows.items():
            if n:
                self.drops[(table, reason)] += n
        if exc is not None:
            self.error = _one_line(exc)
        if reason == "bad_value":  # the row's fault: at most one line a minute, with the count
            self._bad_unlogged += sum(rows.values())
            if time.monotonic() - self._bad_logged >= 60.0:
                log.warning(
                    "trace store: dropped %d row(s) with a value their column cannot hold "
                    "(last: %s)",
                    self._bad_unlogged,
                    self.error,
                )
                self._bad_logged, self._bad_unlogged = time.monotonic(), 0
            return
        if reason != self.problem:
            self._end_problem(f"now {reason}")
            self.problem = reason
            self._problem_started_ns = time.time_ns()
            log.error(
                "trace store %s: dropping rows (%s): %s; serving goes on, the drops are counted "
                "and writing resumes by itself when the cause goes",
                self.path,
                reason,
                self.error,
            )
        self._problem_since.update(rows)

    def _record_gap(self) -> None:
        """Writing works again after a problem: the store records its own gap, one
        ``telemetry_dropped`` event (severity warning: the console's Errors page lists it) with
        the cause, when it began and the rows lost per table, so a reader of the store knows
        what it is missing and when."""
        lost = {t: n for t, n in sorted(self._problem_since.items()) if n}
        self.submit(
            "events",
            {
                "time_ns": time.time_ns(),
                "kind": "telemetry_dropped",
                "severity": "warning",
                "message": f"trace store: {sum(lost.values())} rows dropped while {self.problem} "
                f"({', '.join(f'{t} {n}' for t, n in lost.items())}); writing again",
                "attributes": json.dumps(
                    {"reason": self.problem, "since_ns": self._problem_started_ns, "rows": lost}
                ),
            },
        )

    def _end_problem(self, why: str) -> None:
        """The current cause is over (a batch was written, or another cause took its place):
        its count in one line."""
        if self.problem is None:
            return
        lost = sum(self._problem_since.values())
        by_table = ", ".join(f"{t} {n}" for t, n in sorted(self._problem_since.items()) if n)
        log.warning(
            "trace store %s: %s: %d rows dropped (%s) while %s",
            self.path,
            why,
            lost,
            by_table or "none",
            self.problem,
        )
        self.problem = None
        self._problem_since = Counter()

    def _drop_batch(self, items: list[tuple[str, dict]], reason: str, exc) -> None:
        self._trouble(reason, exc, Counter(table for table, _ in items))

    def _check_file(self) -> None:
        """Reopen the store when its file was removed or replaced under the writer, or DuckDB
        closed the connection (an invalidated database); raises what reopening raises."""
        if self._con is not None and self.path != ":memory:":
            if self._stat_id() != self._file_id:
                log.error(
                    "trace store %s: the file was removed or replaced under the server; "
                    "writing a new store at the same path",
                    self.path,
                )
                self._reopen()
        elif self._con is None:
            self._reopen()

    def _reopen(self) -> None:
        with self._lock:
            if self._con is not None:
                with contextlib.suppress(duckdb.Error):
                    self._con.close()
                self._con = None
            self._open()
        self.reopened += 1

    def _probe(self) -> None:
        """After a failed write: is the connection still usable? DuckDB invalidates a database
        after some I/O errors (a failed checkpoint); then it is closed and reopened later."""
        try:
            with self._lock:
                self._connection().execute("SELECT 1").fetchall()
        except duckdb.Error:
            with self._lock:
                if self._con is not None:
                    with contextlib.suppress(duckdb.Error):
                        self._con.close()
                    self._con = None

    def _write(self, items: list[tuple[str, dict]]) -> None:
        by_table: dict[str, list[dict]] = {}
        for table, row in items:
            by_table.setdefault(table, []).append(row)
        for table in [t for t in by_table if t not in self._types]:
            rows = by_table.pop(table)
            log.warning("dropping %d rows for unknown table %r", len(rows), table)
            self.drops[(table, "unknown_table")] += len(rows)
        if not by_table:
            return
        handled: Counter = Counter()  # rows written or dropped alone, per table
        try:
            self._check_file()
            try:
                self._commit(by_table)
                handled.update({t: len(rows) for t, rows in by_table.items()})
            except Exception as exc:
                if drop_reason(exc) != "bad_value":
                    raise
                # a bad value: each table on its own, split until the bad rows are alone
                for table, rows in by_table.items():
                    self._write_split(table, rows, handled)
        except Exception as exc:  # the store's fault: the rest of the batch is dropped
            rest = Counter({t: len(rows) for t, rows in by_table.items()})
            rest.subtract(handled)
            self._trouble(drop_reason(exc), exc, +rest)
            self._probe()
            return
        if self.problem is not None:
            self._record_gap()
        self._end_problem("writing again")
        self.error = None

    def _write_split(self, table: str, rows: list[dict], handled: Counter) -> None:
        """Write ``rows`` in halves until each bad row is alone; a bad row is dropped and
        counted (``bad_value``); the store's own errors propagate."""
        try:
            self._commit({table: rows})
            handled[table] += len(rows)
            return
        except Exception as exc:
            if drop_reason(exc) != "bad_value":
                raise
            if len(rows) == 1:
                self._trouble("bad_value", exc, Counter({table: 1}))
                handled[table] += 1
                return
        half = len(rows) // 2
        self._write_split(table, rows[:half], handled)
        self._write_split(table, rows[half:], handled)

    def _commit(self, by_table: dict[str, list[dict]]) -> None:
        """One transaction (one WAL sync) for every table's rows; all or nothing."""
        with self._lock:
            con = self._connection()
            con.begin()
            try:
                for table, rows in by_table.items():
                    for i in range(0, len(rows), self.batch_rows):
                        self._insert(table, rows[i : i + self.batch_rows])
                con.commit()
            except BaseException:
                with contextlib.suppress(duckdb.Error):
                    con.rollback()
                raise
        self.written.update({t: len(rows) for t, rows in by_table.items()})

    def _arrow_batch(self, table: str, rows: list[dict]) -> pa.Table:
        schema = self._types[table]
        present = {k for row in rows for k in row}
        fields = [f for f in schema if f.name in present]
        cols = {f.name: [row.get(f.name) for row in rows] for f in fields}
        return pa.table(cols, schema=pa.schema(fields))

    def _insert(self, table: str, rows: list[dict]) -> None:
        batch = self._arrow_batch(table, rows)
        names = ", ".join(batch.column_names)
        self._connection().execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM batch")
