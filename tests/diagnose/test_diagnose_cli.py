"""`tokenmill diagnose` as a user runs it: formats, exit codes, --fail-on, and bad input as one
line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import pytest
from synth_store import Phase, write_store

from tokenmill.telemetry.schema import apply_schema
from tokenmill.telemetry.store import TraceStore

HEALTHY = Phase(duration_s=40)


def tm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def queued(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "queued.duckdb"
    write_store(path, [HEALTHY, HEALTHY.but(duration_s=30, queue_ms=2000)], seed=3)
    return path


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "healthy.duckdb"
    write_store(path, [HEALTHY.but(duration_s=60)], seed=4)
    return path


def test_json_report_is_stable_and_ranked(queued):
    r = tm("diagnose", str(queued), "--format", "json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["schema_version"] == 1 and report["status"] == "problems_found"
    top = report["findings"][0]
    assert top["rule"] == "ttft_queueing" and top["severity"] in ("warning", "critical")
    assert set(top) >= {
        "rule",
        "title",
        "severity",
        "confidence",
        "summary",
        "evidence",
        "window",
        "example_trace_ids",
        "causes",
        "checks",
        "knob",
        "runbook",
        "explained_by",
    }
    assert 1 <= len(top["example_trace_ids"]) <= 5
    assert top["evidence"]["baseline_ttft_p99_ms"] < top["evidence"]["ttft_p99_ms"] / 3
    assert "rose from" in top["summary"]


def test_text_and_markdown_name_the_rule_and_runbook(queued, healthy):
    text = tm("diagnose", str(queued))
    assert text.returncode == 0 and "ttft_queueing" in text.stdout
    assert "runbooks/ttft_queueing.md" in text.stdout
    md = tm("diagnose", str(queued), "--format", "markdown")
    assert md.stdout.startswith("# tokenmill diagnosis") and "## 1. `ttft_queueing`" in md.stdout
    ok = tm("diagnose", str(healthy))
    assert ok.returncode == 0 and "No problems found" in ok.stdout and "TTFT p50" in ok.stdout


def test_fail_on_gates_ci(queued, healthy):
    assert tm("diagnose", str(queued), "--fail-on", "warning").returncode == 1
    assert tm("diagnose", str(healthy), "--fail-on", "warning").returncode == 0


def test_since_and_window(queued):
    # only the last 20 s: the queueing phase alone is its own baseline, so nothing rises
    r = tm("diagnose", str(queued), "--since", "20s", "--window", "5s", "--format", "json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["window_s"] == 5.0
    assert "ttft_queueing" not in [f["rule"] for f in report["findings"]]


def _bad(r: subprocess.CompletedProcess, needle: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert "Traceback" not in r.stderr + r.stdout


def test_bad_input_is_one_line_exit_2(tmp_path, queued):
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"\x00garbage" * 1000)
    _bad(tm("diagnose", str(junk)), "junk.duckdb")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    _bad(tm("diagnose", str(text)), "notes.txt")
    _bad(tm("diagnose", str(tmp_path / "missing.duckdb")), "missing.duckdb")
    # one table of a Parquet dump, and a folder of tables without the dump's meta.parquet
    tables = tmp_path / "tables"
    tables.mkdir()
    duckdb.sql("COPY (SELECT 1 AS x) TO '" + str(tables / "requests.parquet") + "'")
    _bad(tm("diagnose", str(tables / "requests.parquet")), f"give the dump's folder, {tables}")
    _bad(tm("diagnose", str(tables)), "without meta.parquet")

    old = tmp_path / "old.duckdb"
    con = duckdb.connect(str(old))
    apply_schema(con)
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.close()
    _bad(tm("diagnose", str(old)), "999")

    empty = tmp_path / "empty.duckdb"
    TraceStore(empty).close()
    _bad(tm("diagnose", str(empty)), "no requests")

    _bad(tm("diagnose", str(queued), "--since", "soon"), "--since")
    _bad(tm("diagnose", str(queued), "--window", "0s"), "--window")
    _bad(tm("diagnose", str(queued), "--format", "yaml"), "--format")
    _bad(tm("diagnose", str(queued), "--db", str(queued)), "exactly one")


def test_window_with_no_traffic_is_refused(tmp_path):
    path = tmp_path / "idle_tail.duckdb"
    write_store(path, [HEALTHY.but(duration_s=20), HEALTHY.but(duration_s=30, rate_per_s=0)])
    _bad(tm("diagnose", str(path), "--since", "10s"), "no requests")


def test_key_numbers_say_what_they_count(healthy):
    """Issue 19 item 10c: arrivals and completions in a range are different requests (one that
    arrived before the range can end in it); the key numbers must not print `requests 1` and
    `completed 3` under words that read as the same requests."""
    from tokenmill.diagnose.findings import diagnose
    from tokenmill.diagnose.report import to_markdown

    con = duckdb.connect(str(healthy), read_only=True)
    since, until = con.execute("SELECT max(arrival_ns), max(end_ns) + 1 FROM requests").fetchone()
    report = diagnose(con, since_ns=since, until_ns=until)
    con.close()
    s = report.summary
    assert s["requests"] == 1 and s["completed"] > s["requests"]  # the misreadable case
    assert s["completed_of_arrived"] == 1 and s["ended"] == s["completed"] + (s["errors"] or 0)
    text = to_markdown(report)
    assert "- requests arrived: 1\n" in text and "- arrived and completed: 1\n" in text
    assert f"- completed in range (by end time): {s['completed']}\n" in text
    assert "- completed:" not in text and "- requests:" not in text
    r = tm("diagnose", str(healthy), "--format", "text")
    assert r.returncode == 0, r.stderr
    for label in ("requests arrived", "arrived and completed", "completed in range (by end"):
        assert label in r.stdout, r.stdout
