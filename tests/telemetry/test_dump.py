"""Trace dumps: write_dump windows and whole traces, open_dump refusals, the ``tokenmill dump``
command, and ``GET /admin/dump`` with its admin key. No model needed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenmill.engine.api.admin import register_admin_routes
from tokenmill.engine.api.errors import APIError
from tokenmill.engine.api.gateway import Gateway, TenantsFileError, hash_key, load_tenants
from tokenmill.telemetry.dump import (
    DumpError,
    duration_ns,
    open_dump,
    parse_duration,
    write_dump,
)
from tokenmill.telemetry.hub import LiveDumps
from tokenmill.telemetry.rows import finding_row
from tokenmill.telemetry.schema import SCHEMA_VERSION, TABLES
from tokenmill.telemetry.store import TraceStore

TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))
ADMIN_KEY = "sk-admin-0123456789"
TENANT_KEY = "sk-acme-0123456789"
MIN = 60 * 1_000_000_000


# ---------------------------------------------------------------- the store of a test hour


def _at(now: int, minute: int) -> int:
    """Grid time ``minute`` minutes (and 30 s) before ``now``: never on a window edge."""
    return now - minute * MIN - 30_000_000_000


def _span(now, trace, span, name, minute, parent=None):
    start = _at(now, minute)
    return {
        "trace_id": trace * 32,
        "span_id": span * 16,
        "parent_span_id": None if parent is None else parent * 16,
        "name": name,
        "kind": "SERVER" if parent is None else "INTERNAL",
        "start_ns": start,
        "end_ns": start + 1_000_000,
        "duration_ns": 1_000_000,
        "status_code": "OK",
        "attributes": '{"tokenmill.x": 1}',
        "events": "[]",
        "request_id": f"cmpl-{trace}",
    }


@pytest.fixture(scope="module")
def hour(tmp_path_factory):
    """A closed trace store with an hour of rows ending at ``now``.

    Traces (by the minute their request started): ``a`` at -50 (a child span at -25), ``b`` at
    -20 (a child at -8), ``c`` at -15 still in flight (spans only, no root, no requests row).
    Steps every minute 0..59, device samples every even minute, events at -45, exactly -30 min,
    -25, exactly -10 min and -1; another engine's /metrics scraped every 5 minutes.
    """
    path = tmp_path_factory.mktemp("store") / "trace.duckdb"
    now = time.time_ns()
    spans = [
        _span(now, "a", "1", "request", 50),
        _span(now, "a", "2", "decode", 25, parent="1"),
        _span(now, "b", "3", "request", 20),
        _span(now, "b", "4", "prefill", 19, parent="3"),
        _span(now, "b", "5", "stream", 8, parent="3"),
        _span(now, "c", "6", "prefill", 15, parent="7"),
        _span(now, "c", "8", "decode", 14, parent="7"),
    ]
    requests = [
        {
            "request_id": f"cmpl-{t}",
            "trace_id": t * 32,
            "tenant": "acme",
            "arrival_ns": _at(now, m),
            "end_ns": _at(now, m) + 1_000_000,
            "ttft_ms": 12.5,
        }
        for t, m in (("a", 50), ("b", 20))
    ]
    steps = [
        {"step_id": m, "start_ns": _at(now, m), "end_ns": _at(now, m) + 1000} for m in range(60)
    ]
    samples = [
        {"time_ns": _at(now, m), "kind": "host", "cpu_pct": 5.0, "clock_event_reasons": ["idle"]}
        for m in range(0, 60, 2)
    ]
    events = [
        {"time_ns": t, "kind": "config", "severity": "info", "message": f"e{i}"}
        for i, t in enumerate(
            [_at(now, 45), now - 30 * MIN, _at(now, 25), now - 10 * MIN, _at(now, 1)]
        )
    ]
    scrapes = [
        {
            "time_ns": _at(now, m),
            "url": "http://vllm:8000/metrics",
            "engine_kind": "vllm",
            "waiting": float(m),
        }
        for m in range(0, 60, 5)
    ]
    waiting = [
        {
            "time_ns": _at(now, m),
            "request_id": f"w{m}",
            "arrival_ns": _at(now, m) - 2 * 10**9,
            "wait_ms": 2000.0,
            "prompt_tokens": 90,
            "scheduled": False,
        }
        for m in range(0, 60, 3)
    ]
    streams = [
        {
            "time_ns": _at(now, m),
            "request_id": f"s{m}",
            "first_token_ns": _at(now, m) - 3 * 10**9,
            "last_token_ns": _at(now, m) - 10**8,
            "output_tokens": 40,
        }
        for m in range(0, 60, 4)
    ]
    # a live finding's states: opened at -45, then each period it held (written by time_ns)
    findings = [
        finding_row(time_ns=_at(now, m), finding_id="f1", rule="ttft_queueing", status="open",
                    severity="warning", confidence=0.8, title="t", summary="s",
                    first_seen_ns=_at(now, 45), opened_ns=_at(now, 45), last_seen_ns=_at(now, m),
                    evidence={"queue_share_of_ttft": 0.9})
        for m in (45, 25, 15, 5)
    ]  # fmt: skip
    rows = {
        "spans": spans,
        "requests": requests,
        "engine_steps": steps,
        "device_samples": samples,
        "events": events,
        "engine_samples": scrapes,
        "waiting_samples": waiting,
        "findings": findings,
        "stream_samples": streams,
    }
    _fill(path, rows).close()
    return SimpleNamespace(path=path, now=now, rows=rows)


def _fill(path, rows) -> TraceStore:
    """A new store at ``path`` holding ``rows`` ({table: [row]}), open and flushed."""
    store = TraceStore(path)
    for table, table_rows in rows.items():
        for row in table_rows:
            assert store.submit(table, row)
    assert store.flush()
    return store


def _rows(con, sql):
    return sorted(r[0] for r in con.execute(sql).fetchall())


def _counts(con):
    return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg
    return msg


@pytest.fixture
def dump_file(hour, tmp_path) -> Path:
    """A valid dump of the whole hour (for the corruption tests)."""
    out = tmp_path / "all.duckdb"
    con = duckdb.connect(str(hour.path), read_only=True)
    try:
        write_dump(con, out)
    finally:
        con.close()
    return out


# ------------------------------------------ the one duration grammar (engine/durations.py)


@pytest.mark.parametrize(
    "text,seconds",
    [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1.5h", 5400), ("500ms", 0.5),
     ("10", 10), (" 7d ", 604800), (45, 45)],
)  # fmt: skip
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds
    assert duration_ns(text) == round(seconds * 1e9)


@pytest.mark.parametrize("text", ["", "m", "10x", "-5m", "0s", "10 minutes", "1e3s", "nan"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_duration(text)


# ---------------------------------------------------------------- write_dump / open_dump


def test_window_counts_and_whole_traces(hour, tmp_path):
    out = tmp_path / "w.duckdb"
    since, until = hour.now - 30 * MIN, hour.now - 10 * MIN
    con = duckdb.connect(str(hour.path), read_only=True)
    try:
        counts = write_dump(con, out, since_ns=since, until_ns=until, source="unit test")
    finally:
        con.close()
    # b (its stream span at -8 is past `until`, kept: traces are whole) and in-flight c; not a
    # (started at -50, though a span of it starts at -25)
    expected = {"spans": 5, "requests": 1, "engine_steps": 20, "device_samples": 10, "events": 2}
    expected["engine_samples"] = 4  # scraped at -30, -25, -20, -15
    expected["waiting_samples"] = 6  # sampled at -27, -24, ..., -12 (and 30 s)
    expected["findings"] = 2  # the finding's states at -25 and -15
    expected["stream_samples"] = 5  # sampled at -28, -24, ..., -12
    assert counts == expected
    assert sorted(os.listdir(tmp_path)) == ["w.duckdb"]  # no temp or .wal file left
    d = open_dump(out)
    try:
        assert _counts(d) == expected
        assert _rows(d, "SELECT span_id FROM spans") == [c * 16 for c in "34568"]
        assert _rows(d, "SELECT DISTINCT trace_id FROM spans") == ["b" * 32, "c" * 32]
        assert _rows(d, "SELECT request_id FROM requests") == ["cmpl-b"]
        assert _rows(d, "SELECT step_id FROM engine_steps") == list(range(10, 30))
        # the -30 min event is on the (inclusive) start, the -10 min one on the (exclusive) end
        assert _rows(d, "SELECT message FROM events") == ["e1", "e2"]
        steps = d.execute("SELECT min(start_ns), max(start_ns) FROM engine_steps").fetchone()
        assert since <= steps[0] and steps[1] < until
        assert d.execute("SELECT clock_event_reasons FROM device_samples LIMIT 1").fetchone() == (
            ["idle"],
        )
        meta = dict(d.execute("SELECT key, value FROM meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION)
        assert meta["window_start_ns"] == str(since)
        assert meta["window_end_ns"] == str(until)
        assert meta["source"] == "unit test"
        assert abs(int(meta["dumped_at_ns"]) - time.time_ns()) < 60 * 1_000_000_000
        with pytest.raises(duckdb.Error):  # read-only
            d.execute("DELETE FROM spans")
    finally:
        d.close()


def test_whole_store_and_no_overwrite(hour, tmp_path):
    out = tmp_path / "all.duckdb"
    con = duckdb.connect(str(hour.path), read_only=True)
    try:
        counts = write_dump(con, out)
        assert counts == {
            "spans": 7,
            "requests": 2,
            "engine_steps": 60,
            "device_samples": 30,
            "events": 5,
            "engine_samples": 12,
            "waiting_samples": 20,
            "findings": 4,
            "stream_samples": 15,
        }
        size = out.stat().st_size
        with pytest.raises(DumpError, match="already exists") as ei:
            write_dump(con, out, since_ns=hour.now - 5 * MIN)
        _one_line_error(ei)
        assert out.stat().st_size == size
        counts = write_dump(con, out, since_ns=hour.now - 5 * MIN, overwrite=True)
        assert counts["engine_steps"] == 5 and counts["spans"] == 0
        with pytest.raises(DumpError, match="until must be after since"):
            write_dump(con, tmp_path / "x.duckdb", since_ns=10, until_ns=10)
    finally:
        con.close()
    d = open_dump(out)
    try:
        meta = dict(d.execute("SELECT key, value FROM meta").fetchall())
        assert meta["window_start_ns"] == str(hour.now - 5 * MIN)
        assert _counts(d)["engine_steps"] == 5
    finally:
        d.close()


def test_failed_dump_leaves_no_file(tmp_path):
    from tokenmill.telemetry.schema import apply_schema

    con = duckdb.connect(":memory:")
    apply_schema(con)
    con.execute("ALTER TABLE events ADD COLUMN surprise INTEGER")  # not in the dump's schema
    con.execute("INSERT INTO events VALUES (1, 'x', 'info', 'm', NULL, 7)")
    out = tmp_path / "out" / "d.duckdb"
    out.parent.mkdir()
    with pytest.raises(DumpError, match="failed") as ei:
        write_dump(con, out)
    _one_line_error(ei)
    assert os.listdir(out.parent) == []
    # the source connection is usable again (the output was detached)
    assert con.execute("SELECT count(*) FROM events").fetchone() == (1,)
    names = _rows(con, "SELECT database_name FROM duckdb_databases()")
    assert not [n for n in names if "dump" in n], names


def test_dump_of_a_live_store(hour, tmp_path):
    """The server's path: write_dump on the store's own connection, under its lock, while the
    writer keeps going."""
    store = _fill(tmp_path / "live.duckdb", hour.rows)
    try:
        store.submit("events", {"time_ns": time.time_ns(), "kind": "x", "severity": "info"})
        assert store.flush()
        with store.connection_locked() as con:
            counts = write_dump(con, tmp_path / "d.duckdb", since_ns=hour.now - 2 * MIN)
        assert counts["events"] == 2  # -1 min and the new one
        assert store.submit("events", {"time_ns": time.time_ns(), "kind": "y", "severity": "info"})
        assert store.flush()
        assert store.query("SELECT count(*) FROM events") == [(7,)]
        assert store.writer_alive and store.error is None
    finally:
        store.close()


def test_open_dump_missing_file(tmp_path):
    with pytest.raises(DumpError, match="no such file") as ei:
        open_dump(tmp_path / "nope.duckdb")
    assert "nope.duckdb" in _one_line_error(ei)


@pytest.mark.parametrize(
    "content",
    [os.urandom(300_000), b"spans,requests\n" * 1000, b""],
    ids=["random", "text", "empty"],
)
def test_open_dump_not_duckdb(tmp_path, content):
    p = tmp_path / "bad.duckdb"
    p.write_bytes(content)
    with pytest.raises(DumpError, match="not a DuckDB file") as ei:
        open_dump(p)
    assert "bad.duckdb" in _one_line_error(ei)


def test_open_dump_truncated(dump_file):
    data = dump_file.read_bytes()
    dump_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(DumpError, match=r"truncated|corrupt") as ei:
        open_dump(dump_file)
    _one_line_error(ei)


def test_open_dump_garbage_overwritten(dump_file):
    data = bytearray(dump_file.read_bytes())
    data[4096:] = os.urandom(len(data) - 4096)  # the header survives, every block is garbage
    dump_file.write_bytes(bytes(data))
    with pytest.raises(DumpError, match="corrupt") as ei:
        open_dump(dump_file)
    assert "checksum" in _one_line_error(ei)


def test_open_dump_other_schema_version(dump_file):
    con = duckdb.connect(str(dump_file))
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(DumpError, match="schema version 999") as ei:
        open_dump(dump_file)
    _one_line_error(ei)


def test_open_dump_missing_table(dump_file):
    con = duckdb.connect(str(dump_file))
    con.execute("DROP TABLE events")
    con.close()
    with pytest.raises(DumpError, match=r"lacks table\(s\) events"):
        open_dump(dump_file)


def test_open_dump_not_a_store(tmp_path):
    p = tmp_path / "other.duckdb"
    duckdb.connect(str(p)).execute("CREATE TABLE t (a INTEGER)").close()
    with pytest.raises(DumpError, match="not a tokenmill trace store"):
        open_dump(p)


# ---------------------------------------------------------------- tokenmill dump --db


def _cli(*args, env=None, timeout=60):
    full_env = {**os.environ, "COLUMNS": "80", **(env or {})}
    full_env.pop("TOKENMILL_DEBUG", None)
    return subprocess.run(
        [TOKENMILL, "dump", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def _assert_cli_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_cli_db_ok(hour, tmp_path):
    out = tmp_path / "d.duckdb"
    r = _cli("--db", hour.path, "--since", "30m", "-o", out)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and line.startswith(f"wrote {out}")
    assert "spans 5, requests 1, engine_steps 30, device_samples 15" in line
    d = open_dump(out)
    try:
        assert _counts(d)["engine_steps"] == 30
        assert dict(d.execute("SELECT key, value FROM meta").fetchall())["source"].startswith(
            "file "
        )
    finally:
        d.close()
    _assert_cli_error(_cli("--db", hour.path, "-o", out), "already exists", "--force")
    r = _cli("--db", hour.path, "--force", "-o", out)
    assert r.returncode == 0 and "engine_steps 60" in r.stdout


@pytest.mark.parametrize("kind", ["missing", "random", "text", "version"])
def test_cli_db_bad_input(tmp_path, dump_file, kind):
    src = tmp_path / "in.duckdb"
    if kind == "random":
        src.write_bytes(os.urandom(100_000))
    elif kind == "text":
        src.write_text("not a database\n")
    elif kind == "version":
        shutil.copy(dump_file, src)
        duckdb.connect(str(src)).execute("UPDATE meta SET value = '999'").close()
    out = tmp_path / "out.duckdb"
    r = _cli("--db", src, "-o", out)
    needle = {
        "missing": "no such file",
        "random": "not a DuckDB file",
        "text": "not a DuckDB file",
        "version": "schema version 999",
    }[kind]
    _assert_cli_error(r, needle, "in.duckdb")
    assert not out.exists()


def test_cli_db_locked_by_a_live_store(hour, tmp_path):
    live = tmp_path / "live.duckdb"
    store = _fill(live, hour.rows)
    try:
        _assert_cli_error(_cli("--db", live, "-o", tmp_path / "o.duckdb"), "locked", "--url")
    finally:
        store.close()


def test_cli_usage_errors(hour, tmp_path):
    out = tmp_path / "o.duckdb"
    _assert_cli_error(_cli("-o", out), "exactly one of --db")
    _assert_cli_error(_cli("--db", hour.path, "--url", "http://x", "-o", out), "exactly one")
    _assert_cli_error(_cli("--db", hour.path, "--since", "ten", "-o", out), "--since", "'ten'")
    _assert_cli_error(
        _cli("--db", hour.path, "--since", "5m", "--until", "10m", "-o", out), "--until"
    )
    _assert_cli_error(_cli("--db", hour.path, "-o", tmp_path / "no" / "o.duckdb"), "does not exist")
    assert not out.exists()


# ---------------------------------------------------------------- the admin key


def _tenants_file(tmp_path, admin=True) -> Path:
    p = tmp_path / "tenants.toml"
    text = f'[tenants.acme]\nkey_sha256 = "{hash_key(TENANT_KEY)}"\n'
    if admin:
        text += f'\n[admin]\nkey_sha256 = "{hash_key(ADMIN_KEY).upper()}"\n'
    p.write_text(text)
    return p


def test_admin_key_parsing(tmp_path):
    tenants = load_tenants(_tenants_file(tmp_path))
    assert tenants.admin_key_sha256 == hash_key(ADMIN_KEY)
    assert set(tenants) == {"acme"}
    assert load_tenants(_tenants_file(tmp_path, admin=False)).admin_key_sha256 is None
    bad = tmp_path / "bad.toml"
    for extra, needle in (
        ('[admin]\nkey_sha256 = "abc"\n', "admin.key_sha256 must be 64 hex digits"),
        ("[admin]\n", "admin.key_sha256 must be 64 hex digits"),
        ('admin = "x"\n', "admin must be a table"),
    ):
        bad.write_text(extra + f'[tenants.acme]\nkey_sha256 = "{hash_key(TENANT_KEY)}"\n')
        with pytest.raises(TenantsFileError, match=needle.replace("(", r"\(")):
            load_tenants(bad)


def test_authenticate_admin(tmp_path):
    gw = Gateway(load_tenants(_tenants_file(tmp_path)))
    gw.authenticate_admin(f"Bearer {ADMIN_KEY}")
    gw.authenticate_admin(f"bearer  {ADMIN_KEY} ")
    assert gw.authenticate(f"Bearer {TENANT_KEY}").name == "acme"
    cases = [
        (None, 401, "missing admin key"),
        ("Basic abc", 401, "missing admin key"),
        ("Bearer sk-wrong", 401, "invalid admin key"),
        (f"Bearer {TENANT_KEY}", 403, "admin only"),
    ]
    for header, status, needle in cases:
        with pytest.raises(APIError) as ei:
            gw.authenticate_admin(header)
        assert (ei.value.status, needle in ei.value.message) == (status, True), ei.value.message
    with pytest.raises(APIError) as ei:  # the admin key is no tenant key
        gw.authenticate(f"Bearer {ADMIN_KEY}")
    assert ei.value.status == 401
    no_admin = Gateway(load_tenants(_tenants_file(tmp_path, admin=False)))
    with pytest.raises(APIError) as ei:
        no_admin.authenticate_admin(f"Bearer {ADMIN_KEY}")
    assert ei.value.status == 403 and "no admin key configured" in ei.value.message
    open_gw = Gateway(None)
    open_gw.authenticate_admin(None)
    open_gw.authenticate_admin(None, "127.0.0.1")
    open_gw.authenticate_admin(None, "::1")
    open_gw.authenticate_admin(None, "::ffff:127.0.0.1")
    for remote in ("10.1.2.3", "testclient", "::ffff:10.0.0.1"):
        with pytest.raises(APIError) as ei:
            open_gw.authenticate_admin(None, remote)
        assert ei.value.status == 403


# ---------------------------------------------------------------- GET /admin/dump


@pytest.fixture
def live(hour, tmp_path, monkeypatch):
    """A FastAPI app with only the admin routes, over a live copy of the hour's store."""
    store = _fill(tmp_path / "live.duckdb", hour.rows)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    holder = {"store": store}
    state = SimpleNamespace(gateway=Gateway(load_tenants(_tenants_file(tmp_path))))
    app = FastAPI()
    register_admin_routes(app, state, LiveDumps(lambda: holder["store"]))
    yield SimpleNamespace(app=app, state=state, holder=holder, store=store, tmpdir=tmpdir)
    store.close()


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def _api_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_http_dump_auth(live):
    c = TestClient(live.app)
    assert "missing admin key" in _api_error(c.get("/admin/dump"), 401)["message"]
    assert "invalid" in _api_error(c.get("/admin/dump", headers=_auth("sk-nope")), 401)["message"]
    err = _api_error(c.get("/admin/dump", headers=_auth(TENANT_KEY)), 403)
    assert "admin only" in err["message"] and err["type"] == "permission_error"


def test_http_dump_ok(live, tmp_path):
    c = TestClient(live.app)
    live.store.submit("events", {"time_ns": time.time_ns(), "kind": "fresh", "severity": "info"})
    r = c.get("/admin/dump?since=30m", headers=_auth(ADMIN_KEY))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/vnd.duckdb"
    cd = r.headers["content-disposition"]
    assert cd.startswith("attachment; filename=tokenmill-dump-") and cd.endswith(".duckdb")
    assert int(r.headers["content-length"]) == len(r.content)
    out = tmp_path / "got.duckdb"
    out.write_bytes(r.content)
    d = open_dump(out)
    try:
        # since = 30 min back from the store's latest row (the minute-0 step, 30 s before the
        # fixture's now): the -30 min edge event is in, and the queued "fresh" one (the route
        # flushes the store first)
        assert _counts(d) == {
            "spans": 5,
            "requests": 1,
            "engine_steps": 30,
            "device_samples": 15,
            "events": 5,
            "engine_samples": 6,
            "waiting_samples": 10,
            "findings": 3,
            "stream_samples": 8,
        }
        assert _rows(d, "SELECT kind FROM events WHERE kind = 'fresh'") == ["fresh"]
        assert dict(d.execute("SELECT key, value FROM meta").fetchall())["source"].startswith(
            "server "
        )
    finally:
        d.close()
    assert os.listdir(live.tmpdir) == []  # the temp dump is gone
    r = c.get("/admin/dump", params={"since": "30m", "until": "10m"}, headers=_auth(ADMIN_KEY))
    assert r.status_code == 200
    out.write_bytes(r.content)
    d = open_dump(out)
    try:
        counts = _counts(d)
        assert (counts["spans"], counts["requests"], counts["engine_steps"]) == (5, 1, 20)
    finally:
        d.close()


@pytest.mark.parametrize("query,param", [("since=10x", "since"), ("since=1h&until=bad", "until")])
def test_http_dump_bad_window(live, query, param):
    err = _api_error(
        TestClient(live.app).get(f"/admin/dump?{query}", headers=_auth(ADMIN_KEY)), 400
    )
    assert err["param"] == param and err["message"].startswith(f"{param}:")
    assert err["type"] == "invalid_request_error"
    err = _api_error(
        TestClient(live.app).get("/admin/dump?since=1m&until=1h", headers=_auth(ADMIN_KEY)), 400
    )
    assert err["param"] == "until"


def test_http_dump_after_ns_brings_only_what_reached_the_store_since(live, tmp_path):
    """The live console's incremental fetch: ``?after_ns=T`` holds every trace that ended at or
    after T (all of its spans, also those that ended before T), the steps that ended and the
    samples and events taken from T on, and nothing older."""
    c = TestClient(live.app)
    (cut,) = live.store.query("SELECT max(end_ns) - 1500000000000 FROM engine_steps")[0]
    r = c.get(f"/admin/dump?after_ns={cut}", headers=_auth(ADMIN_KEY))
    assert r.status_code == 200, r.text
    out = tmp_path / "delta.duckdb"
    out.write_bytes(r.content)
    d = open_dump(out)
    try:
        ended = live.store.query(f"SELECT count(*) FROM requests WHERE end_ns >= {cut}")[0][0]
        assert _rows(d, "SELECT count(*) FROM requests") == [ended] and ended >= 1
        assert _rows(d, f"SELECT count(*) FROM engine_steps WHERE end_ns < {cut}") == [0]
        assert (
            _rows(d, "SELECT count(*) FROM engine_steps")[0]
            == live.store.query(f"SELECT count(*) FROM engine_steps WHERE end_ns >= {cut}")[0][0]
            and _rows(d, "SELECT count(*) FROM engine_steps")[0] < 60
        )
        # a trace comes whole: every span the store holds of each trace in the dump
        traces = [t for (t,) in d.execute("SELECT DISTINCT trace_id FROM spans").fetchall()]
        assert traces
        listed = ", ".join(f"'{t}'" for t in traces)
        assert (
            _rows(d, "SELECT count(*) FROM spans")[0]
            == live.store.query(f"SELECT count(*) FROM spans WHERE trace_id IN ({listed})")[0][0]
        )
        meta = dict(d.execute("SELECT key, value FROM meta").fetchall())
        assert int(meta["ended_since_ns"]) == cut
    finally:
        d.close()
    for query, needle in (
        ("after_ns=soon", "not a time in Unix nanoseconds"),
        ("after_ns=1&since=10m", "after_ns takes no since/until"),
    ):
        err = _api_error(c.get(f"/admin/dump?{query}", headers=_auth(ADMIN_KEY)), 400)
        assert needle in err["message"] and err["param"] == "after_ns", err


def test_http_dump_store_disabled(live):
    live.holder["store"] = None
    err = _api_error(TestClient(live.app).get("/admin/dump", headers=_auth(ADMIN_KEY)), 503)
    assert err["message"] == "trace store disabled (--no-trace-db)"


def test_http_dump_no_admin_configured(live, tmp_path):
    live.state.gateway = Gateway(load_tenants(_tenants_file(tmp_path, admin=False)))
    err = _api_error(TestClient(live.app).get("/admin/dump", headers=_auth(ADMIN_KEY)), 403)
    assert "no admin key configured" in err["message"]


def test_http_dump_open_mode_local_only(live):
    live.state.gateway = Gateway(None)
    _api_error(TestClient(live.app).get("/admin/dump"), 403)  # TestClient's peer: "testclient"
    r = TestClient(live.app, client=("127.0.0.1", 5555)).get("/admin/dump?since=2m")
    assert r.status_code == 200 and r.content[8:12] == b"DUCK"


# ---------------------------------------------------------------- tokenmill dump --url


@pytest.fixture
def server(live):
    """The admin app served by uvicorn on a free local port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(live.app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


def test_cli_url(server, live, tmp_path):
    out = tmp_path / "u.duckdb"
    r = _cli(
        "--url", server + "/v1", "--since", "30m", "-o", out, env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY}
    )
    assert r.returncode == 0, r.stderr
    assert "spans 5, requests 1, engine_steps 30" in r.stdout
    d = open_dump(out)
    d.close()
    _assert_cli_error(
        _cli("--url", server, "--admin-key", TENANT_KEY, "-o", tmp_path / "t.duckdb"),
        "403",
        "admin only",
    )
    _assert_cli_error(
        _cli("--url", server, "-o", tmp_path / "t.duckdb"), "401", "missing admin key"
    )
    live.holder["store"] = None
    _assert_cli_error(
        _cli("--url", server, "--admin-key", ADMIN_KEY, "-o", tmp_path / "t.duckdb"),
        "503",
        "trace store disabled",
    )
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]
    assert not (tmp_path / "t.duckdb").exists()


def test_cli_url_connection_refused(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    _assert_cli_error(
        _cli("--url", f"http://127.0.0.1:{port}", "--admin-key", "k", "-o", tmp_path / "x.duckdb"),
        "cannot connect",
        "refused",
    )
    assert os.listdir(tmp_path) == []


def test_a_dump_written_before_engine_samples_reads_it_as_empty(hour, tmp_path):
    """engine_samples came after schema version 4 was stamped: a dump of that version without
    the table opens (open_dump, a fleet of such dumps, a Parquet folder without its file) and
    reads it as empty, the other tables as written."""
    from tokenmill.dashboard.fleet_source import build
    from tokenmill.telemetry.parquet_dump import export_parquet, load_parquet

    old = tmp_path / "old.duckdb"
    con = duckdb.connect(str(hour.path), read_only=True)
    try:
        write_dump(con, old)
    finally:
        con.close()
    con = duckdb.connect(str(old))
    con.execute("DROP TABLE engine_samples")
    con.close()
    d = open_dump(old)
    try:
        assert _counts(d)["engine_samples"] == 0 and _counts(d)["engine_steps"] == 60
        export_parquet(d, tmp_path / "pq")
    finally:
        d.close()
    (tmp_path / "pq" / "engine_samples.parquet").unlink()
    pq = load_parquet(tmp_path / "pq")
    assert _counts(pq)["engine_samples"] == 0 and _counts(pq)["events"] == 5
    pq.close()
    fleet, _ = build([old])
    try:
        assert fleet.execute("SELECT count(*) FROM engine_samples").fetchone() == (0,)
        assert fleet.execute("SELECT count(*) FROM engine_steps").fetchone() == (60,)
    finally:
        fleet.close()


def test_a_window_without_a_config_event_carries_the_one_in_force(hour, tmp_path):
    """Steps read without their engine's config would be priced and diagnosed with the
    defaults: a window that began after the last ``config`` event carries that event."""
    out = tmp_path / "quiet.duckdb"
    con = duckdb.connect(str(hour.path), read_only=True)
    try:  # no event between -9 and -2 min; the last config before it is e3 at -10 min
        counts = write_dump(con, out, since_ns=hour.now - 9 * MIN, until_ns=hour.now - 2 * MIN)
        inc = tmp_path / "inc.duckdb"
        inc_counts = write_dump(con, inc, ended_since_ns=hour.now - 9 * MIN)
    finally:
        con.close()
    assert counts["events"] == 1
    d = open_dump(out)
    try:
        assert _rows(d, "SELECT message FROM events") == ["e3"]
    finally:
        d.close()
    # an incremental dump's reader keeps the config it has: only e4, which reached it since
    assert inc_counts["events"] == 1
    d = open_dump(inc)
    try:
        assert _rows(d, "SELECT message FROM events") == ["e4"]
    finally:
        d.close()
