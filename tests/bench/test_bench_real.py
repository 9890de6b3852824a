"""``tokenmill bench`` against a real ``tokenmill serve`` (the default model, ~1 minute on a CPU).

A phased open-loop run (steady, overload at 6x, recovery; gamma arrivals of shape 2) at a rate
derived from the server's own measured capacity, so it holds on a fast or a slow machine: the overload phase builds a
queue (TTFT rises), recovery drains it, the JSON has one block per phase, and the client TTFTs
recorded into the stopped server's store are never below the server's own TTFT.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import duckdb
import pytest
from server_proc import Server

pytestmark = pytest.mark.slow

LOAD = ["--prompt-tokens", "32", "--output-tokens", "8", "--no-progress", "--seed", "1"]


def _bench(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "bench", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "160"},
    )


@pytest.mark.e2e
def test_phased_open_loop_builds_and_drains_a_queue(tmp_path, smollm2_dir):
    server = Server(
        tmp_path, "--model", str(smollm2_dir), "--max-num-seqs", "4", "--max-queue-len", "1024"
    )
    store = tmp_path / "tokenmill-data" / "traces.duckdb"
    out = tmp_path / "run.json"
    try:
        # the server's capacity on this machine: closed loop at its batch size
        calib = tmp_path / "calib.json"
        p = _bench("--url", server.url, "--concurrency", 4, "--num-requests", 8, *LOAD,
                   "--out", calib)  # fmt: skip
        assert p.returncode == 0, p.stderr
        capacity = json.loads(calib.read_text())["request_throughput"]
        # as sent (4 decimals); steady holds; overload (6x) is 1.8x what the server can do
        rate = round(0.3 * capacity, 4)
        # phases long enough for ~8 steady arrivals (6 s on an idle machine, at most 40 s); the
        # queue built in overload drains in about 1.2 phase lengths, recovery lasts 3: margins
        # for a capacity measured a little off, or a machine slowed down by other work
        d = min(40, max(6, round(8 / rate)))
        phases = f"steady:{d}s,overload:{d}s@6x,recovery:{3 * d}s"
        p = _bench(
            "--url", server.url, "--request-rate", f"{rate:.4f}", "--burstiness", 2,
            "--phases", phases, "--goodput", "ttft:2000",
            *LOAD, "--out", out, "--record-to", store,
        )  # fmt: skip
        # the live server holds its store: recording is refused with one line, the JSON is kept
        assert p.returncode == 2, p.stdout + p.stderr
        assert p.stderr.strip().startswith("error: --record-to: ")
        assert "locked by a running server" in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert "overload" in p.stdout and "recovery" in p.stdout  # the table
    finally:
        server.stop()

    doc = json.loads(out.read_text())
    phases = {ph["name"]: ph for ph in doc["phases"]}
    assert list(phases) == ["steady", "overload", "recovery"]
    assert phases["overload"]["offered_request_rate"] == pytest.approx(6 * rate, rel=1e-3)
    for ph in phases.values():
        assert ph["num_prompts"] > 0
        assert ph["completed"] == ph["num_prompts"], ph["errors"]  # recovery drained everything
    steady_p50 = phases["steady"]["median_ttft_ms"]
    overload_p50 = phases["overload"]["median_ttft_ms"]
    assert overload_p50 > steady_p50, (steady_p50, overload_p50)
    # the queue drains in recovery: its last requests are back below the overload TTFT
    recovery = sorted((r for r in doc["requests"] if r["phase"] == 2), key=lambda r: r["sent_s"])
    tail = recovery[-max(2, len(recovery) // 4) :]
    assert statistics.median(r["ttft_ms"] for r in tail) < overload_p50
    assert doc["completed"] == doc["num_prompts"]
    assert doc["request_goodput"] is not None and doc["client_lag_ms"]["p99"] is not None

    # the server has stopped: record the client TTFTs from the saved run
    p = _bench("--from-results", out, "--record-to", store)
    assert p.returncode == 0, p.stderr
    con = duckdb.connect(str(store), read_only=True)
    rows = con.execute(
        "SELECT client_request_id, ttft_ms, client_ttft_ms FROM requests "
        "WHERE client_request_id LIKE ?",
        [f"bench-{doc['run_id']}-%"],
    ).fetchall()
    con.close()
    got = {rid: (server_ttft, client_ttft) for rid, server_ttft, client_ttft in rows}
    sent = {r["request_id"]: r["ttft_ms"] for r in doc["requests"]}
    assert set(sent) <= set(got)
    for rid, client_ttft in sent.items():
        server_ttft, stored = got[rid]
        assert stored == pytest.approx(client_ttft)
        assert stored >= server_ttft, (rid, stored, server_ttft)
    assert got[f"bench-{doc['run_id']}-probe"][1] is None  # the probe is not a measured request
