"""Trace-store retention on a real engine's traces (a run of the labelled corpus): rows older
than a cutoff leave the live file for Parquet roll-outs and nothing is lost or doubled; the
archive diagnoses as the one store it came from; rolling keeps the live file bounded; a second
writer on the same file is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokenmill.diagnose.findings import diagnose
from tokenmill.telemetry.dump import DumpError, open_dump
from tokenmill.telemetry.retention import is_archive, open_archive, roll_out
from tokenmill.telemetry.schema import TABLES
from tokenmill.telemetry.store import TraceStore, TraceStoreInUse

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "diagnosis_corpus"
RUN = CORPUS / "hol_strict-2"  # head-of-line blocking behind a long prompt (real engine)
TIMES = {"requests": "arrival_ns", "spans": "start_ns", "engine_steps": "start_ns",
         "device_samples": "time_ns", "events": "time_ns", "waiting_samples": "time_ns"}  # fmt: skip


def _counts(con) -> dict[str, int]:
    return {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES if t != "meta"
    }


def _live_store(tmp_path: Path, shift_ns: int = 0, store: TraceStore | None = None) -> TraceStore:
    """A live store file holding the run's rows (times moved by ``shift_ns``)."""
    store = store or TraceStore(tmp_path / "live" / "traces.duckdb")
    src = open_dump(RUN / "dump", verify=False)
    with store.connection_locked() as con:
        for table in TIMES:
            rows = src.sql(f"SELECT * FROM {table}").to_arrow_table()  # noqa: F841
            con.execute("CREATE OR REPLACE TEMP TABLE incoming AS SELECT * FROM rows")
            for col in ("arrival_ns", "start_ns", "end_ns", "time_ns", "queued_ns",
                        "scheduled_ns", "first_token_ns", "last_token_ns", "first_text_ns"):  # fmt: skip
                cols = [r[0] for r in con.execute("DESCRIBE incoming").fetchall()]
                if col in cols:
                    con.execute(f"UPDATE incoming SET {col} = {col} + {shift_ns}")
            if shift_ns and "trace_id" in [
                r[0] for r in con.execute("DESCRIBE incoming").fetchall()
            ]:
                # a later copy of the run is other traffic: its own trace ids
                con.execute(
                    f"UPDATE incoming SET trace_id = substr(md5(trace_id || '{shift_ns}'), 1, 32)"
                )
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM incoming")
    src.close()
    return store


def _span(con) -> tuple[int, int]:
    return con.execute("SELECT min(arrival_ns), max(arrival_ns) FROM requests").fetchone()


def test_roll_outs_move_every_row_once_and_diagnose_as_the_original(tmp_path):
    original = open_dump(RUN / "dump", verify=False)
    want = _counts(original)
    before = diagnose(original, window_s=10.0)
    assert before.findings and before.findings[0].rule_id == "head_of_line_blocking"
    store = _live_store(tmp_path)
    archive = tmp_path / "archive"
    with store.connection_locked() as con:
        lo, hi = _span(con)
        last = max(con.execute(f"SELECT max({c}) FROM {t}").fetchone()[0] for t, c in TIMES.items())
        for k, cut in enumerate((lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3, last + 1)):
            out, moved = roll_out(con, cut, archive, store.path)
            assert out is not None and out.is_dir() and sum(moved.values()) > 0
            # nothing older than the cutoff is left live
            for table, col in TIMES.items():
                if table in ("spans",):
                    continue
                left = con.execute(f"SELECT count(*) FROM {table} WHERE {col} < {cut}").fetchone()
                assert left[0] == 0, (k, table)
            # live + archived = the original, table by table (no row lost or doubled)
            arch = open_archive(archive)
            live = _counts(con)
            assert {t: live[t] + _counts(arch)[t] for t in live} == want, k
            arch.close()
        assert _counts(con) == dict.fromkeys(want, 0)  # the last cutoff took everything
    assert is_archive(archive) and len([d for d in archive.iterdir() if d.is_dir()]) == 3
    # the three roll-outs read back as one store: the same findings as the original run
    after = diagnose(open_dump(archive), window_s=10.0)
    assert [f.rule_id for f in after.findings] == [f.rule_id for f in before.findings]
    assert [f.confidence for f in after.findings] == [f.confidence for f in before.findings]
    # and `tokenmill diagnose ARCHIVE` reads it as one source, not a fleet of three
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "diagnose", str(archive), "--window",
         "10s", "--format", "json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert report["findings"][0]["rule"] == "head_of_line_blocking"
    assert not report.get("sources") or len(report["sources"]) == 1
    store.close()


def test_rolling_keeps_the_live_file_bounded(tmp_path):
    """Six copies of the run arrive one after another; after each, everything older than the
    newest copy rolls out. The live file grows with the first copies, then stops: DuckDB
    reuses the freed blocks, so the sixth copy leaves it no larger than 1.5x the second's."""
    store = None
    sizes = []
    with open_dump(RUN / "dump", verify=False) as src:
        lo, hi = _span(src)
    span = hi - lo + 10**9
    for k in range(6):
        store = _live_store(tmp_path, shift_ns=k * span, store=store)
        with store.connection_locked() as con:
            roll_out(con, lo + k * span, tmp_path / "archive", store.path)
            con.execute("CHECKPOINT")
        sizes.append(store.file_bytes())
    assert sizes[5] <= 1.5 * sizes[1], sizes
    rolled = open_archive(tmp_path / "archive")
    assert rolled.execute("SELECT count(DISTINCT trace_id) FROM requests").fetchone()[0] > 0
    store.close()


def test_the_writer_rolls_out_on_its_own(tmp_path):
    """A store with a retention rolls old rows out from its writer thread (here: the run's
    rows are hours older than the retention)."""
    store = _live_store(tmp_path)
    store.retention_s, store.roll_interval_s = 60.0, 0.0
    deadline = time.monotonic() + 30
    while not store.rolled and time.monotonic() < deadline:
        store.submit("events", {"time_ns": time.time_ns(), "kind": "tick", "severity": "info",
                                "message": "", "attributes": "{}"})  # fmt: skip
        time.sleep(0.2)
    assert sum(store.rolled.values()) > 0 and store.roll_error is None
    assert store.health()["rolled_rows"] == dict(store.rolled)
    store.close()


def test_a_second_writer_is_refused_in_one_line(tmp_path):
    path = tmp_path / "traces.duckdb"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from tokenmill.telemetry.store import TraceStore
            s = TraceStore({str(path)!r})
            print("open", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(TraceStoreInUse, match=rf"in use by process {holder.pid}"):
            TraceStore(path)
    finally:
        holder.kill()
        holder.wait(30)


def test_an_empty_archive_is_one_line(tmp_path):
    (tmp_path / "archive.json").write_text("{}")
    with pytest.raises(DumpError, match="no roll-out"):
        open_dump(tmp_path)
