"""The DuckDB trace store on its own: batched writes land exactly, a full queue drops and counts
instead of blocking, and the store fails soft: a bad value drops its row alone, a full disk (a
real 4 MiB tmpfs), a removed file and an unwritable one (``chattr +i``: refused to root too) drop
and count rows by reason, say so once, and writing resumes by itself when the cause goes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

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


def _count(store) -> int:
    assert store.flush()
    return store.query("SELECT count(*) FROM spans")[0][0]


@pytest.mark.parametrize(
    "bad, column",
    [
        ({"input_tokens": "12"}, "input_tokens"),  # a string token count
        ({"output_tokens": 2**31}, "output_tokens"),  # past INTEGER
        ({"start_ns": 2**63 + 5, "end_ns": 2**63 + 9}, "start_ns"),  # past BIGINT
        ({"name": None}, None),  # NOT NULL (DuckDB's own refusal, not Arrow's)
    ],
)
def test_a_bad_value_drops_its_row_alone_and_the_writer_goes_on(tmp_path, bad, column):
    store = TraceStore(tmp_path / "t.duckdb", flush_interval_s=0.05)
    for i in range(5):
        assert store.submit("spans", _span(i))
    store.submit("spans", {**_span(99), **bad})
    store.submit("events", {"time_ns": 1, "kind": "x", "severity": "info"})  # same batch
    assert _count(store) == 5  # the good rows of the same batch
    assert store.drops == {("spans", "bad_value"): 1}
    assert store.query("SELECT count(*) FROM events") == [(1,)]
    if column is not None:  # the store names the column a producer's row does not fit
        (why,) = store.check_rows("spans", [{**_span(99), **bad}])
        assert why.startswith(column)
    assert store.check_rows("spans", [_span(7)]) == [None]
    for i in range(5, 8):  # and every later row still lands
        assert store.submit("spans", _span(i))
    assert _count(store) == 8 and store.writer_alive and store.problem is None
    store.close()


def test_many_bad_rows_in_a_big_batch_are_each_dropped_alone(tmp_path):
    store = TraceStore(tmp_path / "t.duckdb", flush_interval_s=0.05)
    with store.connection_locked():  # one batch
        for i in range(1000):
            row = _span(i) if i % 97 else {**_span(i), "output_tokens": "many"}
            assert store.submit("spans", row)
    assert _count(store) == 1000 - 11
    assert store.drops == {("spans", "bad_value"): 11}
    store.close()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs: a disk that really fills (needs root and mount)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(store, start=0, rounds=None) -> int:
    """Submit spans in batches of 200 until the store says the disk is full (or for
    ``rounds`` batches); the rows sent."""
    sent = 0
    while store.problem is None if rounds is None else sent < rounds * 200:
        assert sent < 80_000, "the disk never filled"
        for _ in range(200):
            row = {**_span(start + sent), "attributes": json.dumps({"x": "y" * 300})}
            store.submit("spans", row)
            sent += 1
        assert store.flush()
    return sent


def test_a_full_disk_drops_and_counts_and_writing_resumes_when_space_is_freed(tiny_disk, caplog):
    filler = tiny_disk / "filler"
    filler.write_bytes(b"\0" * (2 * 2**20))  # what frees the space later
    tel = Telemetry("m", trace_db=str(tiny_disk / "t.duckdb"), device_sample_interval_s=0)
    store = tel.store
    store.flush_interval_s = 0.05
    sent = _fill(store)
    assert store.problem == "disk_full" and store.writer_alive
    full = store.drops[("spans", "disk_full")]
    assert full > 0
    # every row is either in the file or counted as dropped
    assert _count(store) == store.written["spans"] == sent - full
    h = tel.health()
    assert h["status"] == "degraded" and h["store"]["problem"] == "disk_full"
    assert h["dropped_by_reason"] == {"disk_full": {"spans": full}}
    assert "No space left" in h["store_error"]
    body = tel.metrics.render()[0].decode()
    assert (
        'tokenmill_telemetry_dropped_total{model_name="m",reason="disk_full",table="spans"} '
        f"{float(full)}"
    ) in body
    sent += _fill(store, start=sent, rounds=3)  # still full: dropped, counted, said once
    assert store.problem == "disk_full"
    lost = store.drops[("spans", "disk_full")]
    assert lost > full and _count(store) == sent - lost
    said = [r for r in caplog.records if "dropping rows (disk_full)" in r.getMessage()]
    assert len(said) == 1

    filler.unlink()  # space again: the next batch is written, no restart
    before = _count(store)
    for i in range(10):
        assert store.submit("spans", _span(2 * 10**6 + i))
    assert _count(store) == before + 10
    assert store.problem is None and tel.health()["status"] == "ok"
    ended = [r.getMessage() for r in caplog.records if "writing again" in r.getMessage()]
    assert ended == [
        f"trace store {store.path}: writing again: {lost} rows dropped (spans {lost}) "
        "while disk_full"
    ]
    # and the store itself records the gap, for the console's Errors page and any reader
    store.flush()
    ((severity, attrs),) = store.query(
        "SELECT severity, attributes FROM events WHERE kind = 'telemetry_dropped'"
    )
    assert severity == "warning"
    gap = json.loads(attrs)
    assert gap["reason"] == "disk_full" and gap["rows"] == {"spans": lost}
    assert gap["since_ns"] > 0
    tel.close()


def test_a_store_file_removed_under_the_writer_is_written_anew(tmp_path):
    path = tmp_path / "t.duckdb"
    store = TraceStore(path, flush_interval_s=0.05)
    for i in range(10):
        store.submit("spans", _span(i))
    assert _count(store) == 10
    for f in tmp_path.glob("t.duckdb*"):
        f.unlink()
    for i in range(10, 15):
        assert store.submit("spans", _span(i))
    assert _count(store) == 5  # a new file at the same path, with the rows sent since
    assert store.reopened == 1 and store.dropped_total == 0 and path.exists()
    store.close()
    again = TraceStore(path)
    assert again.query("SELECT min(start_ns), count(*) FROM spans") == [(1_010, 5)]
    again.close()


@pytest.fixture
def immutable(tmp_path):
    """``chattr +i`` (root writes are refused too) on a folder and its files; undone after."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here")
    touched: list[Path] = []

    def freeze(*paths: Path) -> None:
        for p in paths:
            done = subprocess.run(["chattr", "+i", str(p)], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"chattr +i refused: {done.stderr.strip()}")
            touched.append(p)

    def thaw() -> None:
        while touched:
            subprocess.run(["chattr", "-i", str(touched.pop())], check=False)

    yield freeze, thaw
    thaw()


def test_an_unwritable_store_drops_and_counts_then_recovers(tmp_path, immutable):
    freeze, thaw = immutable
    folder = tmp_path / "db"
    store = TraceStore(folder / "t.duckdb", flush_interval_s=0.05)
    for i in range(10):
        store.submit("spans", _span(i))
    assert _count(store) == 10
    freeze(*folder.iterdir(), folder)
    for i in range(10, 15):
        assert store.submit("spans", _span(i))
    assert store.flush()
    assert store.problem == "unwritable" and store.drops == {("spans", "unwritable"): 5}
    # a checkpoint that fails invalidates DuckDB's database: the writer must reopen it
    with pytest.raises(duckdb.Error):
        store.query("CHECKPOINT")
    store.submit("spans", _span(15))
    assert store.flush() and store.drops == {("spans", "unwritable"): 6}
    thaw()
    for i in range(16, 20):
        assert store.submit("spans", _span(i))
    assert _count(store) == 14  # the 10 before and the 4 after; the 6 between are counted
    assert store.problem is None and store.writer_alive and store.error is None
    assert store.reopened >= 1  # the invalidated database was reopened
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
    assert (
        'tokenmill_telemetry_dropped_total{model_name="m",reason="no_store",table="events"} 1.0'
        in body.decode()
    )
    tel.close()


def test_a_store_of_another_version_is_refused(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    apply_schema(con)
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(SchemaError, match=f"version 999.*version {SCHEMA_VERSION}"):
        TraceStore(path)


def test_the_drop_counters_help_names_every_reason():
    from tokenmill.telemetry.metrics import _DropsCollector
    from tokenmill.telemetry.otlp import DROP_REASONS as OTLP_REASONS
    from tokenmill.telemetry.store import DROP_REASONS

    assert [r for r in (*DROP_REASONS, *OTLP_REASONS) if r not in _DropsCollector.HELP] == []
