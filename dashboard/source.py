"""Where the console's rows come from: a dump or closed store file, or a live server.

A file is opened read-only with :func:`tokenmill.telemetry.dump.open_dump` (reopened when the
file changes). A server URL is mirrored into a private temp folder: the first fetch of its
admin-only ``GET /admin/dump`` takes the whole store; every later one, at most every
``refresh_s`` seconds, only what reached the store since the mirror's newest row less
:data:`OVERLAP_S` (``?after_ns=``: the traces that ended, the steps that ended, the samples and
events taken), merged in place of the mirror's rows of the same traces and times. The server
dumps, and the console downloads, what is new, not the whole store on every refresh. Each
snapshot is a cursor of the mirror; the two newest stay open (a page still reading the older
one is not cut off).

``tokenmill dashboard`` hands the source to the Streamlit script through the environment:
``TOKENMILL_DASHBOARD_SOURCE``, ``TOKENMILL_DASHBOARD_REFRESH`` (s) and ``TOKENMILL_ADMIN_KEY``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import httpx

from tokenmill.telemetry.dump import ENDED_COLUMN, DumpError, open_dump
from tokenmill.telemetry.remote import FetchError, fetch_dump, normalize_url
from tokenmill.telemetry.schema import ADDED_TABLES, TABLES, ddl, has_table

ENV_SOURCE = "TOKENMILL_DASHBOARD_SOURCE"
ENV_REFRESH = "TOKENMILL_DASHBOARD_REFRESH"
ENV_API_KEY = "TOKENMILL_ADMIN_KEY"
#: the Compare page's baseline (BEFORE) dump, from ``tokenmill dashboard --baseline``
ENV_BASELINE = "TOKENMILL_DASHBOARD_BASELINE"


#: an incremental fetch starts this long before the mirror's newest row, so a row the server
#: wrote after the last fetch with an earlier time is fetched too: the store's writer batches
#: for 1 s (the route flushes it first), and a request whose stream was cut is written up to
#: 5 s after it ended (``engine/api/server_state.py``: ``ENGINE_FINAL_WAIT_S``). Rows fetched again
#: replace themselves (by trace and by time), so the overlap costs bytes, never duplicates.
OVERLAP_S = 10.0


class SourceError(Exception):
    """The source cannot be read (one-line reason)."""


def is_url(spec: str) -> bool:
    return spec.strip().lower().startswith(("http://", "https://"))


def check_source(spec: str | None) -> str:
    """Validate a ``--source`` value before the console starts; returns it normalized.

    Raises:
        SourceError: empty, a file that is not a readable dump/store, or a malformed URL.
    """
    if not spec or not spec.strip():
        raise SourceError("give --source: a dump or closed trace-store file, or a server URL")
    spec = spec.strip()
    if is_url(spec):
        import httpx

        try:
            url = httpx.URL(normalize_url(spec))
        except httpx.InvalidURL as exc:
            raise SourceError(f"bad --source URL {spec!r}: {exc}") from None
        if not url.host:
            raise SourceError(f"bad --source URL {spec!r}: no host")
        return normalize_url(spec)
    try:
        open_dump(spec, verify=False).close()
    except DumpError as exc:
        raise SourceError(str(exc)) from None
    return str(Path(spec).resolve())


@dataclass
class Snapshot:
    """One open store: ``key`` changes whenever the rows may have changed."""

    key: str
    con: duckdb.DuckDBPyConnection
    label: str
    fetched_at: float  # time.time() when opened or fetched
    error: str | None = None  # the last refresh failed (the rows are older)


class StoreHandle:
    """Owns the read-only connection(s) of one source; thread-safe.

    Args:
        spec: a file path or a server URL (``http(s)://``).
        api_key: the server's admin key (URL sources).
        refresh_s: the most a live view may lag (s); dumps are fetched no more often.
        timeout_s: how long one fetch may take.
    """

    def __init__(self, spec: str, api_key: str | None = None, refresh_s: float = 10.0,
                 timeout_s: float = 120.0):  # fmt: skip
        self.spec = spec
        self.api_key = api_key
        self.refresh_s = max(1.0, float(refresh_s))
        self.timeout_s = timeout_s
        self.live = is_url(spec)
        self._lock = threading.Lock()
        self._open: list[tuple[Snapshot, Path | None]] = []
        self._tmp = Path(tempfile.mkdtemp(prefix="tokenmill-dashboard-")) if self.live else None
        self._n = 0
        self._last_try = 0.0
        self._mirror: LiveMirror | None = None
        #: rows each fetch brought, newest last (the incremental fetch's proof, for tests)
        self.fetched_rows: list[int] = []
        #: a live server's ``/health`` ``telemetry`` block at the last fetch (None: not read):
        #: what the store cannot show, the rows it is losing now
        self.telemetry: dict | None = None

    def snapshot(self, force: bool = False) -> Snapshot:
        """The current store, refetched or reopened when due.

        Raises:
            SourceError: nothing could be read yet (the message says why).
        """
        with self._lock:
            if self.live:
                return self._live(force)
            return self._file()

    def _file(self) -> Snapshot:
        p = Path(self.spec)
        try:
            st = p.stat()
        except OSError as exc:
            raise SourceError(f"{p}: {exc.strerror or exc}") from None
        key = f"file:{p}:{st.st_mtime_ns}:{st.st_size}"
        if self._open and self._open[-1][0].key == key:
            return self._open[-1][0]
        try:
            con = open_dump(p, verify=False)
        except DumpError as exc:
            raise SourceError(str(exc)) from None
        self._push(Snapshot(key, con, str(p), time.time()), None)
        return self._open[-1][0]

    def _live(self, force: bool) -> Snapshot:
        now = time.time()
        cur = self._open[-1][0] if self._open else None
        if cur is not None and not force and now - self._last_try < self.refresh_s:
            return cur
        self._last_try = now
        self._n += 1
        path = self._tmp / f"fetch-{self._n}.duckdb"
        after = None if self._mirror is None else self._mirror.fetch_from_ns()
        try:
            fetch_dump(
                self.spec,
                path,
                after_ns=after,
                api_key=self.api_key,
                timeout_s=self.timeout_s,
                verify=False,
            )
            if self._mirror is None:
                self._mirror = LiveMirror(path, self._tmp / "mirror.duckdb")
                self.fetched_rows.append(self._mirror.rows())
            else:
                self.fetched_rows.append(self._mirror.merge(path, after))
        except (FetchError, DumpError, duckdb.Error) as exc:
            if cur is None:
                raise SourceError(str(exc).splitlines()[0]) from None
            cur.error = str(exc).splitlines()[0]
            return cur
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        self.telemetry = live_telemetry(self.spec, self.api_key)
        cursor = self._mirror.con.cursor()
        self._push(Snapshot(f"url:{self.spec}:{self._n}", cursor, self.spec, now), None)
        return self._open[-1][0]

    def _push(self, snap: Snapshot, path: Path | None) -> None:
        self._open.append((snap, path))
        while len(self._open) > 2:
            old, old_path = self._open.pop(0)
            with contextlib.suppress(duckdb.Error):
                old.con.close()
            if old_path is not None:
                with contextlib.suppress(OSError):
                    old_path.unlink()

    def close(self) -> None:
        with self._lock:
            for snap, _ in self._open:
                with contextlib.suppress(duckdb.Error):
                    snap.con.close()
            self._open.clear()
            if self._mirror is not None:
                self._mirror.close()
                self._mirror = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


class LiveMirror:
    """A live server's store as the console holds it: a DuckDB file made from the first full
    dump, kept current by merging incremental dumps (module docstring).

    Args:
        first: the first (full) dump; it is moved to ``path``.
        path: the mirror's file.
    """

    def __init__(self, first: Path, path: Path):
        open_dump(first, verify=False).close()  # a dump of this schema, or DumpError
        os.replace(first, path)
        self.path = path
        self.con = duckdb.connect(str(path))
        self.con.execute(ddl())  # tables added since the server's tokenmill wrote the dump

    def rows(self) -> int:
        return sum(self.con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES)

    def newest_ns(self) -> int:
        """The newest time any row reached the mirror's store (0 when empty)."""
        parts = ["SELECT max(end_ns) FROM requests", "SELECT max(end_ns) FROM spans"] + [
            f"SELECT max({c}) FROM {t}" for t, c in ENDED_COLUMN.items()
        ]
        (t,) = self.con.execute(f"SELECT max(m) FROM ({' UNION ALL '.join(parts)}) x(m)").fetchone()
        return t or 0

    def fetch_from_ns(self) -> int:
        """Where the next incremental fetch starts."""
        return max(0, self.newest_ns() - int(OVERLAP_S * 1e9))

    def merge(self, delta: Path, cut_ns: int) -> int:
        """Put an incremental dump (everything that reached the store from ``cut_ns`` on) in
        place of the mirror's rows of the same traces and times; returns its rows. A server
        that ignored ``after_ns`` (a full dump: no ``ended_since_ns`` in its meta) replaces
        the mirror whole.

        Raises:
            DumpError: the file is not a dump of this schema.
        """
        open_dump(delta, verify=False).close()
        con = self.con
        con.execute(f"ATTACH '{str(delta).replace(chr(39), chr(39) * 2)}' AS delta (READ_ONLY)")
        try:
            meta = dict(con.execute("SELECT key, value FROM delta.main.meta").fetchall())
            full = "ended_since_ns" not in meta
            con.execute("BEGIN TRANSACTION")
            if full:
                for t in (*TABLES, "meta"):
                    con.execute(f"DELETE FROM {t}")
            else:
                for t in ("spans", "requests"):
                    con.execute(
                        f"DELETE FROM {t} WHERE trace_id IN (SELECT trace_id FROM delta.main.{t})"
                    )
                for t, c in ENDED_COLUMN.items():
                    con.execute(f"DELETE FROM {t} WHERE {c} >= {int(cut_ns)}")
                con.execute("DELETE FROM meta WHERE key IN ('dumped_at_ns', 'window_end_ns')")
            n = 0
            for t in TABLES:
                if t in ADDED_TABLES and not has_table(con, "delta", "main", t):
                    continue  # a server of an older tokenmill: none of its rows
                con.execute(f"INSERT INTO {t} BY NAME SELECT * FROM delta.main.{t}")
                n += con.execute(f"SELECT count(*) FROM delta.main.{t}").fetchone()[0]
            keep = "" if full else "WHERE key IN ('dumped_at_ns', 'window_end_ns')"
            con.execute(f"INSERT INTO meta SELECT key, value FROM delta.main.meta {keep}")
            con.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                con.execute("ROLLBACK")
            raise
        finally:
            con.execute("DETACH delta")
        return n

    def close(self) -> None:
        with contextlib.suppress(duckdb.Error):
            self.con.close()


def live_telemetry(url: str, api_key: str | None = None) -> dict | None:
    """A live server's ``/health`` ``telemetry`` block (its store's problem, rows dropped by
    reason); None when it does not answer in a few seconds or has none."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        body = httpx.get(normalize_url(url) + "/health", headers=headers, timeout=3.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    block = body.get("telemetry") if isinstance(body, dict) else None
    return block if isinstance(block, dict) else None


def telemetry_warning(block: dict | None) -> str | None:
    """One line for the console when a live server's telemetry is losing rows, else None."""
    if not block:
        return None
    store = block.get("store") or {}
    problem = store.get("problem") if isinstance(store, dict) else None
    dropped = block.get("dropped_by_reason") or {}
    lost = {
        reason: sum(n for n in tables.values() if isinstance(n, (int, float)))
        for reason, tables in dropped.items()
        if isinstance(tables, dict)
    }
    lost = {r: int(n) for r, n in lost.items() if n}
    if not problem and not lost:
        return None
    said = ", ".join(f"{n:,} {r}" for r, n in sorted(lost.items(), key=lambda kv: -kv[1]))
    now = f"the trace store is dropping rows now ({problem}); " if problem else ""
    return f"Telemetry: {now}rows not stored since the server started: {said or 'none'}."


def from_env() -> tuple[str | None, str | None, float]:
    """``(source, api_key, refresh_s)`` as ``tokenmill dashboard`` passed them."""
    try:
        refresh = float(os.environ.get(ENV_REFRESH, "10"))
    except ValueError:
        refresh = 10.0
    return os.environ.get(ENV_SOURCE), os.environ.get(ENV_API_KEY) or None, refresh
