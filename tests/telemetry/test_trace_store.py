"""The DuckDB trace store on its own: batched writes land exactly, a full queue drops and counts
instead of blocking, and a dead writer turns every later row into a counted drop."""

from __future__ import annotations

import json
import threading

import duckdb
import pytest

from tokenmill.telemetry.hub import Telemetry
from tokenmill.telemetry.schema import SCHEMA_VERSION, SchemaError, apply_schema
from tokenmill.telemetry.store import TraceStore


def _span(i: int) -> dict:
    return {
        "trace_id": f"{i:032x}",
        "span_id": f"{i:016x}",
        "name": "decode",
        "kind": "INTERNAL",
        "start_ns": 1_000 + i,
        "end_ns": 2_000 + i,
        "duration_ns": 1_000,
        "status_code": "UNSET",
        "attributes": json.dumps({"tokenmill.decode.itl_ms": [1.5, 2.5]}),
        "events": "[]",
        "output_tokens": i % 7,
    }


def test_rows_land_exactly_and_reopen_keeps_them(tmp_path):
    path = tmp_path / "t.duckdb"
    store = TraceStore(path, batch_rows=100)
    for i in range(1_000):
        assert store.submit("spans", _span(i))
    store.submit("device_samples", {"time_ns": 5, "kind": "gpu", "clock_event_reasons": ["a"]})
    assert store.flush()
    assert store.query("SELECT count(*), sum(output_tokens) FROM spans")[0] == (
        1_000,
        sum(i % 7 for i in range(1_000)),
    )
    assert store.query("SELECT clock_event_reasons FROM device_samples") == [(["a"],)]
    assert store.written["spans"] == 1_000 and store.dropped_total == 0
    store.close()
    again = TraceStore(path)  # a restarted server appends to the same file
    assert again.query("SELECT count(*) FROM spans") == [(1_000,)]
    again.close()


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    store = TraceStore(tmp_path / "t.duckdb", max_queue_rows=10)
    with store.connection_locked():  # the writer cannot insert meanwhile
        accepted = sum(store.submit("spans", _span(i)) for i in range(100))
    assert store.dropped["spans"] == 100 - accepted > 0
    assert store.flush()
    assert store.query("SELECT count(*) FROM spans") == [(accepted,)]
    store.close()


def test_dead_writer_counts_every_later_row_as_dropped(tmp_path):
    store = TraceStore(tmp_path / "t.duckdb")
    boom = threading.Event()

    def broken_insert(table, rows):
        boom.set()
        raise OSError("disk went away")

    store._insert = broken_insert
    store.submit("spans", _span(0))
    assert boom.wait(10)
    store._thread.join(10)
    assert not store.writer_alive and store.error == "OSError: disk went away"
    assert not store.submit("spans", _span(1))
    assert store.dropped["spans"] == 2  # the row in flight and the one after
    assert store.health()["writer_alive"] is False
    store.close()


def test_telemetry_without_a_writable_store_counts_drops(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tel = Telemetry("m", trace_db=str(blocker / "traces.duckdb"), device_sample_interval_s=0)
    tel.event("config", "info", "x")
    h = tel.health()
    assert h["status"] == "degraded" and h["store_error"].startswith("FileExistsError")
    assert h["dropped"] == {"events": 1}
    body, _ = tel.metrics.render()
    assert 'tokenmill_telemetry_dropped_total{model_name="m",table="events"} 1.0' in body.decode()
    tel.close()


def test_a_store_of_another_version_is_refused(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    apply_schema(con)
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(SchemaError, match=f"version 999.*version {SCHEMA_VERSION}"):
        TraceStore(path)
