"""The Now page and its queries (``dashboard/data_findings.py``): each finding at its latest row,
the open ones, the resolved ones with how long they lasted, the timeline's segments and the
series under them equal the store's own rows; the page shows them on a dump (saying it is not
live), on a live source (first, from the mirrored findings table), and says plainly when a
store holds no findings or no findings table. Also the rows a real LiveService writes."""

from __future__ import annotations

import json

import duckdb
import pytest
from streamlit.testing.v1 import AppTest
from synth_store import T0, Phase, S, write_store
from test_dashboard_apptest import APP, _AdminDump, charts, open_page

from tokenmill.dashboard import data
from tokenmill.telemetry.dump import open_dump
from tokenmill.telemetry.schema import apply_schema

NO_FINDINGS = "No findings recorded (the live diagnosis runs in serve/proxy/collect"


@pytest.fixture
def con(findings_store):
    c = open_dump(findings_store.path)
    yield c.cursor()
    c.close()


# ----- the queries -----


def test_each_finding_is_read_at_its_latest_row(con, findings_store):
    fs = findings_store
    cur = data.findings_current(con)
    assert list(cur["finding_id"]) == [fs.open_id, fs.resolved_id]  # open first
    top = cur.iloc[0]
    assert (top["rule"], top["status"], top["severity"]) == (fs.open_rule, "open", "critical")
    assert top["summary"] == fs.open_summary  # the latest refresh, not the first row
    assert top["evidence"] == {"queue_share_of_ttft": 0.93, "ttft_p99_ms": 2150.0}
    assert top["example_trace_ids"] == list(fs.open_traces) and len(fs.open_traces) == 2
    assert top["start_ns"] == fs.open_opened_ns and top["last_seen_ns"] == fs.open_last_ns
    (n_rows,) = con.execute("SELECT count(*) FROM findings").fetchone()
    assert n_rows == 3 + 4 and len(cur) == 2
    assert [r["rule"] for _, r in data.open_findings(con).iterrows()] == [fs.open_rule]


def test_resolved_findings_carry_how_long_they_lasted(con, findings_store):
    fs = findings_store
    res = data.resolved_findings(con, T0, T0 + 200 * S)
    assert list(res["finding_id"]) == [fs.resolved_id]
    assert res.iloc[0]["duration_s"] == (fs.resolved_ns - fs.resolved_opened_ns) / S == 30
    assert res.iloc[0]["evidence"] == {"preemptions": 30}
    # the window is on the resolve time: a span after it holds none
    assert data.resolved_findings(con, fs.resolved_ns + 1, T0 + 200 * S).empty


def test_the_timeline_segments_run_from_open_to_resolve_or_to_now(con, findings_store):
    fs = findings_store
    now = data.store_now_ns(con)
    (newest,) = con.execute(
        "SELECT greatest((SELECT max(end_ns) FROM requests), (SELECT max(end_ns) FROM "
        "engine_steps), (SELECT max(time_ns) FROM findings))"
    ).fetchone()
    assert now == newest > fs.open_last_ns
    spans = data.findings_spans(con, T0, now + 1, now)
    got = {r.rule: (r.status, r.start_ns, r.end_ns) for r in spans.itertuples()}
    assert got == {
        fs.resolved_rule: ("resolved", fs.resolved_opened_ns, fs.resolved_ns),
        fs.open_rule: ("open", fs.open_opened_ns, now),
    }
    assert list(spans["rule"]) == [fs.resolved_rule, fs.open_rule]  # oldest first
    later = data.findings_spans(con, fs.resolved_ns + S, now + 1, now)  # the open one only
    assert list(later["rule"]) == [fs.open_rule]
    assert data.findings_spans(con, T0, fs.resolved_opened_ns, now).empty


def test_the_series_under_the_timeline_equal_the_store(con):
    since, until, bucket_s = T0, T0 + 120 * S, 10.0
    df = data.now_series(con, since, until, bucket_s)
    lat = data.latency_series(con, since, until, bucket_s)
    assert list(df["ttft_p99_ms"]) == pytest.approx(list(lat["ttft_p99_ms"]), nan_ok=True)
    (q99,) = con.execute(
        "SELECT quantile_cont(queue_ms, 0.99) FROM requests WHERE arrival_ns >= ? "
        "AND arrival_ns < ?",
        [T0 + 70 * S, T0 + 80 * S],
    ).fetchone()
    row = df[df["t_ns"] == T0 + 70 * S].iloc[0]
    assert row["queue_p99_ms"] == pytest.approx(q99) and q99 > 1900
    assert df[df["t_ns"] == T0 + 10 * S].iloc[0]["queue_p99_ms"] < 100


def test_a_store_without_findings_or_without_the_table():
    con = duckdb.connect()
    apply_schema(con)
    assert data.findings_current(con).empty and data.open_findings(con).empty
    con.execute("DROP TABLE findings")  # a store of a tokenmill from before the table
    assert not data.has_findings(con)
    assert data.findings_current(con) is None
    assert data.open_findings(con).empty
    assert data.resolved_findings(con, 0, 2**62).empty
    assert data.findings_spans(con, 0, 2**62, 2**61).empty
    assert data.store_now_ns(con) is None
    con.close()


def test_the_rows_a_live_service_writes_read_back(tmp_path):
    """The live loop itself over a synthetic incident (as tests/diagnose/test_live.py runs it):
    what the Now page reads is the finding the loop holds open."""
    from prometheus_client import CollectorRegistry

    from tokenmill.diagnose.live import LiveSettings
    from tokenmill.diagnose.live_service import LiveMetrics, LiveService
    from tokenmill.telemetry.store import TraceStore

    path = tmp_path / "live.duckdb"
    healthy = Phase(duration_s=90)
    write_store(path, [healthy, healthy.but(duration_s=40, queue_ms=2000)], seed=11)
    store = TraceStore(path, flush_interval_s=0.05)
    now = [T0 + 40 * S]
    service = LiveService(
        store, LiveSettings(), metrics=LiveMetrics(CollectorRegistry()), clock=lambda: now[0]
    )
    for _ in range(10):
        service.run_once()
        now[0] += 10 * S
    assert store.flush(60)
    snap = service.snapshot()
    store.close()
    c = open_dump(path)
    try:
        opened = data.open_findings(c)
        assert list(opened["rule"]) == [f["rule"] for f in snap["open"]] == ["ttft_queueing"]
        f = opened.iloc[0]
        assert f["finding_id"] == snap["open"][0]["id"]
        assert f["start_ns"] == snap["open"][0]["opened_ns"]
        assert f["evidence"] == json.loads(json.dumps(snap["open"][0]["evidence"]))
    finally:
        c.close()


# ----- the page -----


def test_now_page_on_a_dump(monkeypatch, findings_store):
    fs = findings_store
    at = open_page(monkeypatch, findings_store.path, "now")
    assert [h.value for h in at.header] == ["Now"]
    assert any(i.value.startswith("Not live") for i in at.info)
    assert "Open findings: 1" in [s.value for s in at.subheader]
    text = "\n".join(m.value for m in at.markdown)
    assert f"{fs.open_rule} — TTFT is dominated by queueing" in text
    assert "`queue_share_of_ttft` = 93" in text  # the evidence with its unit (a share)
    assert [e.value for e in at.error] == [fs.open_summary]  # critical: in red
    assert f"#### {fs.resolved_rule}" not in text  # resolved: not among the open
    links = [(pl.proto.page, pl.proto.query_string) for pl in at.get("page_link")]
    assert links == [("requests", f"trace={t}") for t in fs.open_traces]
    assert any(e.label.startswith(f"Runbook: runbooks/{fs.open_rule}.md") for e in at.expander)
    runbook = data.runbook(fs.open_rule)
    assert any(m.value.strip() == runbook.strip() for m in at.markdown)
    (table,) = at.table
    resolved = table.value
    assert list(resolved["rule"]) == [fs.resolved_rule] and list(resolved["lasted"]) == ["30 s"]
    (fig,) = charts(at)
    segments = [t for t in fig["data"] if t.get("meta", {}).get("finding_id")]
    assert {t["meta"]["finding_id"]: t["name"] for t in segments} == {
        fs.resolved_id: "warning",
        fs.open_id: "critical",
    }
    names = {t.get("name") for t in fig["data"]}
    assert {"TTFT p99", "ITL p99", "queue p99", "waiting (mean)"} <= names


def test_now_page_span_selector(monkeypatch, findings_store):
    at = open_page(monkeypatch, findings_store.path, "now")
    at.segmented_control(key="nw_span").set_value("6 h").run()
    assert not at.exception
    (fig,) = charts(at)
    lo, hi = fig["layout"]["xaxis"]["range"]
    from datetime import datetime

    span = datetime.fromisoformat(hi) - datetime.fromisoformat(lo)
    assert 6 * 3600 <= span.total_seconds() < 6 * 3600 + 600


def test_now_page_without_findings(monkeypatch, tmp_path):
    plain = tmp_path / "plain.duckdb"
    write_store(plain, [Phase(duration_s=10)], seed=2)
    at = open_page(monkeypatch, plain, "now")
    assert any(i.value.startswith(NO_FINDINGS) for i in at.info)
    assert "Open findings: 0" in [s.value for s in at.subheader]
    assert len(charts(at)) == 1  # the latencies still drawn, no finding on them


def test_now_page_on_a_store_without_the_findings_table(monkeypatch, tmp_path):
    old = tmp_path / "old.duckdb"
    write_store(old, [Phase(duration_s=10)], seed=2)
    with duckdb.connect(str(old)) as c:
        c.execute("DROP TABLE findings")
    at = open_page(monkeypatch, old, "now")
    assert not at.exception
    assert any(i.value.startswith(NO_FINDINGS) for i in at.info)


def test_now_page_on_an_empty_store(monkeypatch, tmp_path):
    empty = tmp_path / "empty.duckdb"
    with duckdb.connect(str(empty)) as c:
        apply_schema(c)
    at = open_page(monkeypatch, empty, "now")
    assert any(i.value.startswith(NO_FINDINGS) for i in at.info)
    assert any("No data" in i.value for i in at.info)


@pytest.fixture
def findings_server(findings_store):
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AdminDump)
    server.dump = findings_store.path
    server.queries = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_now_is_the_first_page_of_a_live_source(monkeypatch, findings_server, findings_store):
    """A live source opens on Now, from the findings table its mirror fetched; "now" is the
    wall clock, so the open finding is open for as long as since it opened."""
    monkeypatch.setenv("TOKENMILL_ADMIN_KEY", "k")
    monkeypatch.setenv(
        "TOKENMILL_DASHBOARD_SOURCE", f"http://127.0.0.1:{findings_server.server_port}"
    )
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    assert [h.value for h in at.header] == ["Now"]
    assert not any(i.value.startswith("Not live") for i in at.info)
    assert "Open findings: 1" in [s.value for s in at.subheader]
    assert [e.value for e in at.error] == [findings_store.open_summary]
    (table,) = at.table
    assert list(table.value["rule"]) == [findings_store.resolved_rule]
