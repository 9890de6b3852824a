"""The retention archive kept in bounds (``telemetry/archive.py``): a real store's rows at
synthetic old times, rolled out for real; old folders deleted by age and by size, small
roll-outs merged per hour with every row kept once, and a reader of the archive that never
errors while folders are merged or deleted under it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tokenmill.telemetry.archive import HOUR_NS, tidy_archive
from tokenmill.telemetry.dump import DumpError, open_dump
from tokenmill.telemetry.retention import MERGED_FILE, open_archive, roll_out, visible_parts
from tokenmill.telemetry.schema import TABLES
from tokenmill.telemetry.store import TraceStore

DAY0 = 1_700_006_400 * 10**9  # a UTC midnight (2023-11-15)
S = 10**9


def _store(tmp_path: Path, **kw) -> TraceStore:
    return TraceStore(tmp_path / "live" / "traces.duckdb", roll_interval_s=3600.0, **kw)


def _add(store: TraceStore, t_ns: int, n: int = 3) -> None:
    """``n`` requests (one span each), steps, samples and events at ``t_ns`` and after."""
    with store.connection_locked() as con:
        for i in range(n):
            t, tid = t_ns + i * 1000, f"{t_ns:x}{i:04x}"
            con.execute(
                "INSERT INTO requests (request_id, trace_id, arrival_ns, end_ns) VALUES (?,?,?,?)",
                [f"r{tid}", tid, t, t + 500],
            )
            con.execute(
                "INSERT INTO spans (trace_id, span_id, name, kind, start_ns, end_ns, "
                "duration_ns, status_code) VALUES (?, ?, 'chat', 'server', ?, ?, 500, 'ok')",
                [tid, f"s{tid}", t, t + 500],
            )
            con.execute(
                "INSERT INTO engine_steps (step_id, start_ns, end_ns) VALUES (?, ?, ?)",
                [t, t, t + 100],
            )
            con.execute("INSERT INTO device_samples (time_ns, kind) VALUES (?, 'cpu')", [t])
            con.execute(
                "INSERT INTO events (time_ns, kind, severity) VALUES (?, 'tick', 'info')", [t]
            )


def _roll(store: TraceStore, cutoff: int) -> dict[str, int]:
    with store.connection_locked() as con:
        out, moved = roll_out(con, cutoff, store.archive, store.path)
    assert out is not None
    return moved


def _counts(con) -> dict[str, int]:
    return {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in TABLES if t != "meta"
    }


def _distinct(con) -> dict[str, int]:
    """Distinct rows per table: equal to :func:`_counts` when no row is there twice."""
    return {
        t: con.execute(f"SELECT count(*) FROM (SELECT DISTINCT * FROM {t})").fetchall()[0][0]
        for t in TABLES
        if t != "meta"
    }


def _disk_bytes(folder: Path) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files
    )


def _history(store: TraceStore, start: int, rolls: int, every_ns: int, tidy=None) -> dict:
    """``rolls`` roll-outs ``every_ns`` apart from ``start``, rows in each; ``tidy(now)``
    after each. Rows rolled out per table."""
    total: dict[str, int] = {}
    for k in range(rolls):
        _add(store, start + k * every_ns)
        cut = start + (k + 1) * every_ns
        for t, n in _roll(store, cut).items():
            total[t] = total.get(t, 0) + n
        if tidy:
            tidy(cut)
    return total


def _read(archive: Path) -> tuple[dict, dict]:
    con = open_archive(archive)
    try:
        return _counts(con), _distinct(con)
    finally:
        con.close()


def test_a_day_of_roll_outs_compacts_to_a_few_folders_with_every_row_once(tmp_path):
    """200 roll-outs over a simulated day, the archive tidied after each as the store does:
    at most 30 folders at the end, and the archive reads every rolled row exactly once."""
    store = _store(tmp_path)
    every = 86_400 * S // 200
    rolled = _history(store, DAY0, 200, every, tidy=lambda now: tidy_archive(store.archive, now))
    folders = visible_parts(store.archive)
    assert len(folders) <= 30, len(folders)
    counts, distinct = _read(store.archive)
    assert counts == distinct == {t: rolled.get(t, 0) for t in counts}
    assert counts["requests"] == 600
    assert not [d for d in store.archive.iterdir() if d.name.startswith(".")]
    assert not list(store.archive.glob(f"*/{MERGED_FILE}"))  # merges finished whole
    store.close()


def test_compaction_keeps_the_same_rows(tmp_path):
    """The same rows, row for row, before and after compaction; the hours merge into one
    folder each and the earlier day into one; `diagnose ARCHIVE` reads the compacted one."""
    store = _store(tmp_path)
    start = DAY0 - 2 * HOUR_NS  # two hours of yesterday, three of today
    _history(store, start, 50, 6 * 60 * S)  # a roll-out every 6 min: 5 h
    before = open_archive(store.archive)
    done = tidy_archive(store.archive, start + 5 * HOUR_NS + 60 * S)  # in the 6th hour
    after = open_archive(store.archive)
    # yesterday: one folder; 00h, 01h, 02h: one each; the current hour's one roll-out
    assert done.merges == 4 and done.folders == len(visible_parts(store.archive)) == 5
    assert _counts(after) == _counts(before) == _distinct(after)
    for table in (t for t in TABLES if t != "meta"):
        mine = after.sql(f"SELECT * FROM {table}").to_arrow_table()  # noqa: F841
        theirs = before.sql(f"SELECT * FROM {table}").to_arrow_table()  # noqa: F841
        missing = after.execute(
            "SELECT count(*) FROM (SELECT * FROM theirs EXCEPT ALL SELECT * FROM mine)"
        ).fetchall()[0][0]
        extra = after.execute(
            "SELECT count(*) FROM (SELECT * FROM mine EXCEPT ALL SELECT * FROM theirs)"
        ).fetchall()[0][0]
        assert (missing, extra) == (0, 0), table
    meta = dict(after.execute("SELECT key, value FROM meta").fetchall())
    meta_before = dict(before.execute("SELECT key, value FROM meta").fetchall())
    for key in ("window_start_ns", "window_end_ns", "source"):
        assert meta[key] == meta_before[key], key
    with open_dump(store.archive) as con:  # what `tokenmill diagnose ARCHIVE` opens
        assert _counts(con) == _counts(before)
    before.close()
    after.close()
    store.close()


def test_old_folders_are_deleted_by_age(tmp_path):
    store = _store(tmp_path)
    _history(store, DAY0, 36, 2 * HOUR_NS)  # three days, a roll-out every 2 h
    now = DAY0 + 72 * HOUR_NS
    done = tidy_archive(store.archive, now, max_age_s=86_400)
    cutoffs = [int(d.name.split("-")[1]) for d in visible_parts(store.archive)]
    assert min(cutoffs) >= now - 86_400 * S and max(cutoffs) == now  # the newest kept
    assert done.pruned_folders == 23 and done.pruned_bytes > 0  # cutoff 2 to 46 h
    counts, _ = _read(store.archive)
    assert counts["requests"] == 3 * 13  # the last 13 roll-outs (cutoffs 48 to 72 h)
    store.close()


def test_the_archive_is_held_under_its_size(tmp_path):
    """The oldest folders go until the files under the archive folder add up to at most the
    limit; the newest stay. A limit smaller than the newest folder leaves none."""
    store = _store(tmp_path)
    _history(store, DAY0, 20, 10 * 60 * S)
    now = DAY0 + 200 * 60 * S
    tidy_archive(store.archive, now)  # merged first: far fewer bytes
    full, newest = _disk_bytes(store.archive), visible_parts(store.archive)[-1].name
    done = tidy_archive(store.archive, now, max_bytes=full // 2)
    assert _disk_bytes(store.archive) <= full // 2 and done.bytes == _disk_bytes(store.archive)
    assert done.pruned_folders > 0 and visible_parts(store.archive)[-1].name == newest
    assert _read(store.archive)[0]["requests"] >= 3
    done = tidy_archive(store.archive, now, max_bytes=100)
    assert [d.name for d in store.archive.iterdir()] == ["archive.json"]
    with pytest.raises(DumpError, match="no roll-out"):
        open_archive(store.archive)
    store.close()


def test_the_store_tidies_its_archive_after_each_roll_out(tmp_path):
    """A store with the two bounds: old roll-outs it made go at its next roll-out, counted
    and shown in health()."""
    store = _store(
        tmp_path, retention_s=3600.0, archive_max_age_s=86_400.0, archive_max_bytes=10**9
    )
    now = time.time_ns()
    _history(store, now - 6 * 86_400 * S, 8, 12 * HOUR_NS)  # 2 to 6 days ago
    _add(store, now - 2 * 3600 * S)  # past the store's one hour of retention
    assert store._maybe_roll(force=True) is not None
    assert store.wait_tidy()  # the tidy runs beside the writer, in a thread of its own
    health = store.health()["archive"]
    assert store.pruned["folders"] == 8 and store.pruned["bytes"] > 0
    assert health["pruned"] == dict(store.pruned) and health["error"] is None
    assert health["folders"] == len(visible_parts(store.archive)) == 1
    assert health["bytes"] == _disk_bytes(store.archive)
    store.close()


def test_a_reader_never_errors_while_the_archive_changes(tmp_path):
    """open_archive in a loop while a tidy merges and deletes folders under it: never an
    error, never a row twice; while only merging, always every row."""
    store = _store(tmp_path)
    rolled = _history(store, DAY0, 30, 2 * 60 * S)  # an hour of roll-outs
    want = {t: rolled.get(t, 0) for t in _read(store.archive)[0]}
    seen, errors, stop = [], [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                seen.append(_read(store.archive))
            except Exception as exc:  # the test is that there is none
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        while len(seen) < 2:
            time.sleep(0.01)
        merged = len(seen)
        done = tidy_archive(store.archive, DAY0 + 2 * HOUR_NS)
        while len(seen) < merged + 2:
            time.sleep(0.01)
        merged = len(seen)
        tidy_archive(store.archive, DAY0 + 2 * HOUR_NS, max_bytes=_disk_bytes(store.archive) // 2)
        while len(seen) < merged + 2:
            time.sleep(0.01)
    finally:
        stop.set()
        reader.join(60)
    assert not errors, errors
    assert done.merges >= 1
    assert all(counts == distinct for counts, distinct in seen)  # never a row twice
    assert all(counts == want for counts, _ in seen[:merged])  # merging lost nothing
    assert seen[-1][0]["requests"] < want["requests"]  # the deletions were seen


def test_an_interrupted_merge_is_finished_by_the_next_tidy(tmp_path):
    """A merge published but whose parts were not deleted yet (a crash): readers skip the
    parts, and the next tidy deletes them; a hidden half-written merge is removed."""
    store = _store(tmp_path)
    _history(store, DAY0, 4, 60 * S)
    want = _read(store.archive)[0]
    parts = visible_parts(store.archive)
    merged = store.archive / f"{parts[0].name.split('-')[0]}-{parts[-1].name.split('-')[1]}"
    with open_archive(store.archive) as con:
        from tokenmill.telemetry.parquet_dump import export_parquet

        export_parquet(con, merged)
    (merged / MERGED_FILE).write_text(json.dumps({"parts": [p.name for p in parts]}))
    (store.archive / ".merge-123-456").mkdir()  # a merge, and a roll-out, cut short
    (store.archive / ".123-456.99-abcd.tmp").mkdir()
    os.utime(store.archive / ".123-456.99-abcd.tmp", (time.time() - 7200, time.time() - 7200))
    (store.archive / ".456-789.99-abcd.tmp").mkdir()  # a roll-out exporting now: kept
    assert visible_parts(store.archive) == [merged]
    assert _read(store.archive) == (want, want)
    tidy_archive(store.archive, DAY0 + HOUR_NS // 2)
    left = sorted(d.name for d in store.archive.iterdir())
    assert left == sorted(["archive.json", merged.name, ".456-789.99-abcd.tmp"])
    assert _read(store.archive)[0] == want
    store.close()


def test_serve_flags_reach_the_store(monkeypatch):
    """``--trace-archive-max-age`` (a duration) and ``--trace-archive-max-bytes`` reach
    ServeConfig and, through the server's ``_trace_store``, the TraceStore's arguments."""
    from typer.testing import CliRunner

    import tokenmill.engine.api.server as server
    from tokenmill.engine import cli

    seen = {}

    def fake_make_server(config, serve, **kw):
        seen["serve"] = serve
        raise ValueError("stop here")

    monkeypatch.setattr(server, "make_server", fake_make_server)
    args = ["serve", "--trace-archive-max-age", "7d", "--trace-archive-max-bytes", "5000000000"]
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 1 and "stop here" in r.output, r.output
    serve = seen["serve"]
    assert (serve.trace_archive_max_age, serve.trace_archive_max_bytes) == (7 * 86_400.0, 5 * 10**9)
    _, retention = server._trace_store(serve)
    assert retention["archive_max_age_s"] == 7 * 86_400.0
    assert retention["archive_max_bytes"] == 5 * 10**9
    assert set(retention) <= set(TraceStore.__init__.__code__.co_varnames)
