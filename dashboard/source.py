"""Where the console's rows come from: a dump or closed store file, or a live server.

A file is opened read-only with :func:`tokenmill.telemetry.dump.open_dump` (reopened when the
file changes). For a server URL a fresh dump is fetched from its admin-only ``GET /admin/dump``
into a private temp folder at most every ``refresh_s`` seconds; the two newest dumps stay open
(a page still reading the older one is not cut off) and older ones are closed and deleted.

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

from tokenmill.telemetry.dump import DumpError, open_dump
from tokenmill.telemetry.remote import FetchError, fetch_dump, normalize_url

ENV_SOURCE = "TOKENMILL_DASHBOARD_SOURCE"
ENV_REFRESH = "TOKENMILL_DASHBOARD_REFRESH"
ENV_API_KEY = "TOKENMILL_ADMIN_KEY"
#: the Compare page's baseline (BEFORE) dump, from ``tokenmill dashboard --baseline``
ENV_BASELINE = "TOKENMILL_DASHBOARD_BASELINE"


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
        path = self._tmp / f"live-{self._n}.duckdb"
        try:
            fetch_dump(
                self.spec, path, api_key=self.api_key, timeout_s=self.timeout_s, verify=False
            )
            con = open_dump(path, verify=False)
        except (FetchError, DumpError) as exc:
            with contextlib.suppress(OSError):
                path.unlink()
            if cur is None:
                raise SourceError(str(exc)) from None
            cur.error = str(exc)
            return cur
        self._push(Snapshot(f"url:{self.spec}:{self._n}", con, self.spec, now), path)
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
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def from_env() -> tuple[str | None, str | None, float]:
    """``(source, api_key, refresh_s)`` as ``tokenmill dashboard`` passed them."""
    try:
        refresh = float(os.environ.get(ENV_REFRESH, "10"))
    except ValueError:
        refresh = 10.0
    return os.environ.get(ENV_SOURCE), os.environ.get(ENV_API_KEY) or None, refresh
