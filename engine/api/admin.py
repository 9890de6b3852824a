"""Admin-only routes: ``GET /admin/dump`` hands out a trace dump of the live store.

Wire it with ``register_admin_routes(app, state, dumps)`` where ``state.gateway`` is the
server's :class:`~.gateway.Gateway` and ``dumps`` is a :class:`DumpWriter` (the server's
telemetry; the API knows it only through this interface).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..durations import duration_ns
from .errors import APIError

DUMP_MEDIA_TYPE = "application/vnd.duckdb"
_CHUNK = 1 << 20


class DumpWriter(Protocol):
    """What the dump route needs from telemetry."""

    can_dump: bool  # False without a trace store (--no-trace-db)

    def latest_ns(self) -> int | None:
        """The live store's latest row (ns), what ``since``/``until`` count back from; None
        when it holds none."""

    def write_dump(
        self,
        path: Path,
        since_ns: int | None,
        until_ns: int | None,
        ended_since_ns: int | None = None,
    ) -> None:
        """Write a dump of the live store to ``path`` (a window, or with ``ended_since_ns``
        what reached the store from then on). Raises RuntimeError (one line)."""


def register_admin_routes(app: FastAPI, state, dumps: DumpWriter) -> None:
    """Add ``GET /admin/dump?since=10m&until=1m`` to ``app``.

    ``since`` and ``until`` are durations (``engine/durations.py``: ``30s``, ``10m``, ``2h``,
    ``1d``) counted back from the store's latest row, as ``tokenmill dump --since`` and
    ``tokenmill diagnose --since`` count them; no ``since`` = from the first row, no ``until``
    = up to the latest. ``after_ns`` (Unix ns) instead asks for what reached the store from
    then on (every trace that ended, the steps that ended, samples and events taken): the live
    console's incremental fetch, which keeps the rest. Answers the dump file
    (``application/vnd.duckdb``, as an attachment), or an error in OpenAI's shape: 401/403 from
    :meth:`Gateway.authenticate_admin`, 400 for a bad ``since``/``until``, 503 when the server
    runs without a trace store, 500 when the dump fails. The dump holds the store's lock (the
    writer waits, and rows arriving meanwhile may be dropped and counted if its queue fills).
    """

    @app.get("/admin/dump")
    async def admin_dump(
        request: Request,
        since: str | None = None,
        until: str | None = None,
        after_ns: str | None = None,
    ):
        rid = getattr(request.state, "request_id", None)
        try:
            client = request.client.host if request.client else None
            state.gateway.authenticate_admin(request.headers.get("authorization"), client)
            now_ns = time.time_ns()
            # the store's latest row only when a duration counts back from it (it flushes the
            # store and reads under its lock: the console's incremental fetch needs none)
            counts_back = bool(since or until) and dumps.can_dump
            latest = await run_in_threadpool(dumps.latest_ns) if counts_back else None
            since_ns = _ago(latest or now_ns, since, "since")
            until_ns = _ago(latest or now_ns, until, "until")
            if since_ns is not None and until_ns is not None and until_ns <= since_ns:
                raise APIError(
                    400,
                    "until must be later than since (both count back from the store's latest row)",
                    param="until",
                )
            after = _after_ns(after_ns, since, until)
            if not dumps.can_dump:
                raise APIError(
                    503, "trace store disabled (--no-trace-db)", code="trace_store_disabled"
                )
            fh, size = await run_in_threadpool(_make_dump, dumps, since_ns, until_ns, after)
        except APIError as exc:
            return exc.response(rid)
        name = time.strftime("tokenmill-dump-%Y%m%dT%H%M%SZ.duckdb", time.gmtime(now_ns / 1e9))
        headers = {
            "content-disposition": f"attachment; filename={name}",
            "content-length": str(size),
        }
        if rid:
            headers["x-request-id"] = rid
        return StreamingResponse(_read_chunks(fh), media_type=DUMP_MEDIA_TYPE, headers=headers)


def _ago(ref_ns: int, text: str | None, param: str) -> int | None:
    if text is None or text == "":
        return None
    try:
        return ref_ns - duration_ns(text)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


def _after_ns(text: str | None, since: str | None, until: str | None) -> int | None:
    if text is None or text == "":
        return None
    if since or until:
        raise APIError(400, "after_ns takes no since/until", param="after_ns", code="invalid_value")
    if not text.isdigit() or len(text) > 20:
        raise APIError(
            400,
            f"after_ns: {text[:40]!r} is not a time in Unix nanoseconds",
            param="after_ns",
            code="invalid_value",
        )
    return int(text)


def _make_dump(
    dumps: DumpWriter, since_ns: int | None, until_ns: int | None, after_ns: int | None = None
):
    """Write the dump to a private temp folder and return (open file, size); the file is
    unlinked at once, so it disappears when the response closes it, whatever happens."""
    folder = Path(tempfile.mkdtemp(prefix="tokenmill-dump-"))
    try:
        path = folder / "dump.duckdb"
        try:
            dumps.write_dump(path, since_ns, until_ns, after_ns)
        except RuntimeError as exc:
            raise APIError(500, f"dump failed: {exc}", code="dump_failed") from None
        fh = open(path, "rb")  # noqa: SIM115 (closed by _read_chunks)
        return fh, os.fstat(fh.fileno()).st_size
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read_chunks(fh):
    try:
        while chunk := fh.read(_CHUNK):
            yield chunk
    finally:
        fh.close()
