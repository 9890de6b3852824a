"""Client timings into a trace store: ``requests.client_ttft_ms``.

The server stores the ``x-request-id`` each bench request sent as
``requests.client_request_id``. :func:`record_client_timings` opens a *closed* store (a stopped
server's ``traces.duckdb``) or a dump read-write and sets ``client_ttft_ms`` (ms, the client's
TTFT: send → first token-carrying chunk, see :mod:`.client`) on the rows whose
``client_request_id`` matches, so the diagnoser can compare client and server TTFT per request
(a gap means something between them, such as a buffering proxy, holds the stream). Requests
without a TTFT (failed before the first token) are not written. A live server's store is
locked: stop the server first, or record into a dump of it (``tokenmill dump``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ..telemetry.dump import duckdb_file_problem
from ..telemetry.schema import SchemaError, check_schema


class RecordError(Exception):
    """The store cannot be updated (one line)."""


@dataclass
class RecordSummary:
    written: int  # rows of requests updated
    unmatched: int  # client timings with no row of that client_request_id
    skipped: int  # results without a TTFT


def _timings(results) -> list[tuple[str, float]]:
    """``(request_id, ttft_ms)`` from :class:`~.client.RequestResult` objects or the dicts of a
    results JSON's ``requests`` list."""
    out = []
    for r in results:
        rid = r["request_id"] if isinstance(r, dict) else r.request_id
        ttft = r.get("ttft_ms") if isinstance(r, dict) else r.ttft_ms
        if rid and ttft is not None:
            out.append((str(rid), float(ttft)))
    return out


def record_client_timings(path: str | Path, results) -> RecordSummary:
    """Set ``requests.client_ttft_ms`` in the store or dump at ``path`` for every result with a
    TTFT, matching ``requests.client_request_id``.

    Raises:
        RecordError: missing file, not a tokenmill store, locked by a running server (one line,
            naming the file).
    """
    p = Path(path)
    problem = duckdb_file_problem(p, "trace store", "tokenmill trace store")
    if problem:
        raise RecordError(problem)
    rows = _timings(results)
    skipped = len(results) - len(rows)
    try:
        con = duckdb.connect(str(p))
    except duckdb.Error as exc:
        msg = (str(exc).strip().splitlines() or [""])[0]
        if "lock" in msg.lower():
            raise RecordError(
                f"{p}: locked by another process (a running server?); stop the server first, "
                "or record into a dump of it (tokenmill dump)"
            ) from None
        raise RecordError(f"{p}: cannot open: {msg}") from None
    try:
        try:
            check_schema(con)
        except SchemaError as exc:
            raise RecordError(f"{p}: {exc}") from None
        con.execute("CREATE TEMP TABLE bench_client (id VARCHAR, ttft DOUBLE)")
        if rows:
            con.executemany("INSERT INTO bench_client VALUES (?, ?)", rows)
        con.execute("BEGIN")
        con.execute(
            """UPDATE requests SET client_ttft_ms = c.ttft FROM bench_client c
               WHERE requests.client_request_id = c.id"""
        )
        written = con.execute(
            "SELECT count(*) FROM requests r JOIN bench_client c ON r.client_request_id = c.id"
        ).fetchone()[0]
        unmatched = con.execute(
            """SELECT count(*) FROM bench_client c WHERE NOT EXISTS
               (SELECT 1 FROM requests r WHERE r.client_request_id = c.id)"""
        ).fetchone()[0]
        con.execute("COMMIT")
    except duckdb.Error as exc:
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")
        msg = (str(exc).strip().splitlines() or [""])[0]
        raise RecordError(f"{p}: cannot update: {msg}") from None
    finally:
        con.close()
    return RecordSummary(int(written), int(unmatched), skipped)
