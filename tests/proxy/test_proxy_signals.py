"""`tokenmill proxy` stopped the way `tokenmill serve` is (engine/api/shutdown.py): the first
SIGTERM or SIGINT, to the proxy or to its process group, drains (new requests 503 with
Retry-After, /health 503 "draining", open streams finish), and the store keeps every row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import duckdb
import httpx
import pytest
from test_bad_upstream import DRIP_S, HANG_GUARD_S, RawUpstream, start_proxy

STREAMS = 4
EVENTS = 20  # each stream's events: EVENTS x DRIP_S seconds, open when the signal comes


def _stream(url: str, out: list) -> None:
    body = {"model": f"drip:{EVENTS}", "messages": [{"role": "user", "content": "hi"}],
            "stream": True}  # fmt: skip
    lines = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError as exc:
        lines.append(f"error {exc}")
    out.append(lines)


@pytest.mark.parametrize("stop", ["SIGTERM to the group", "SIGINT to the group"])
def test_a_stop_signal_drains_the_proxys_streams_and_keeps_every_row(tmp_path, stop):
    up = RawUpstream()
    db = tmp_path / "p.duckdb"
    proc, url = start_proxy(up.url, db, new_session=True)
    outs: list = []
    try:
        deadline = time.monotonic() + 60
        threads = [threading.Thread(target=_stream, args=(url, outs)) for _ in range(STREAMS)]
        for t in threads:
            t.start()
        while len(up.received) < STREAMS:  # every stream reached the upstream
            assert time.monotonic() < deadline, up.received
            time.sleep(0.05)
        time.sleep(3 * DRIP_S)
        os.killpg(proc.pid, signal.SIGTERM if "TERM" in stop else signal.SIGINT)
        time.sleep(2 * DRIP_S)
        health = httpx.get(url + "/health", timeout=5)
        late = httpx.post(
            url + "/v1/chat/completions", json={"model": "ok", "messages": []}, timeout=5
        )
        for t in threads:
            t.join(HANG_GUARD_S)
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        up.stop()
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert late.status_code == 503 and late.headers.get("retry-after")
    assert late.json()["error"]["code"] == "server_shutdown"
    assert len(outs) == STREAMS
    for lines in outs:  # each stream whole: every event, then [DONE]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert len(lines) == EVENTS + 1, len(lines)
        assert all("error" not in json.loads(ln[6:]) for ln in lines[:-1])
    assert proc.returncode == 0, stderr
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT count(*) FILTER (WHERE error_type IS NULL), "
        "count(*) FILTER (WHERE error_type = 'server_shutdown') FROM requests"
    ).fetchone()
    con.close()
    assert rows == (STREAMS, 1)  # the streams, and the request refused while draining


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_the_openai_base_url_is_taken_as_the_upstream(tmp_path, suffix):
    """`--upstream http://host:port/v1` (or `/v1/`), as every OpenAI client writes it:
    requests go to the upstream's /v1/chat/completions (not /v1/v1/...), and its metrics are
    scraped from /metrics (not /v1/metrics)."""
    up = RawUpstream()
    proc, url = start_proxy(up.url + suffix, tmp_path / "p.duckdb")
    try:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "ok", "messages": []})
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
        up.stop()
    assert r.status_code == 200 and up.received == ["ok"]
    assert up.paths == ["/v1/chat/completions"]
    assert f"→ {up.url}; recording" in " ".join(stderr.split())


def test_the_proxy_samples_its_host_with_the_upstream_counted_as_the_servers(tmp_path):
    """An upstream on this host is found by its port and counted with the proxy: its CPU is
    the server's, a CPU burner beside it is named among the others (host_contention's
    evidence through a proxy)."""
    up = RawUpstream()  # listens in this test's process: the upstream is this pid
    db = tmp_path / "p.duckdb"
    proc, _ = start_proxy(up.url, db, "--device-sample-interval", "0.2s")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # the upstream busy too, in its own process
            sum(i * i for i in range(10_000))
    finally:
        burner.kill()
        burner.wait(10)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HANG_GUARD_S)
        up.stop()
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT cpu_others_pct, busy_others FROM device_samples WHERE kind = 'host' "
        "ORDER BY time_ns"
    ).fetchall()
    con.close()
    named = [d for _, text in rows for d in json.loads(text or "[]")]
    pids = {d["pid"] for d in named}
    assert burner.pid in pids, named
    assert os.getpid() not in pids and proc.pid not in pids, named
    # the burner's one core of this host's CPUs is the others' share
    share = 100 / (os.cpu_count() or 1)
    assert max(pct for pct, _ in rows if pct is not None) >= share * 0.5, rows


def test_an_upstream_on_another_host_is_not_sampled(tmp_path):
    """The proxy's host says nothing about an upstream elsewhere: no host rows."""
    db = tmp_path / "p.duckdb"
    proc, _ = start_proxy("http://192.0.2.1:9", db, "--device-sample-interval", "0.1s")
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=HANG_GUARD_S)
    con = duckdb.connect(str(db), read_only=True)
    (n,) = con.execute("SELECT count(*) FROM device_samples").fetchone()
    con.close()
    assert n == 0


def test_open_streams_are_sampled_while_they_run(tmp_path):
    """Each second the proxy samples every stream that has made its first output and not
    ended (``stream_samples``): the upstream's pace is in the store before any stream ends."""
    up = RawUpstream()
    db = tmp_path / "p.duckdb"
    proc, url = start_proxy(up.url, db)
    outs: list = []
    try:
        events = 35  # 3.5 s: three samples or more
        body = {"model": f"drip:{events}", "messages": [{"role": "user", "content": "hi"}],
                "stream": True}  # fmt: skip
        t = threading.Thread(target=lambda: outs.append(
            httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_GUARD_S)))  # fmt: skip
        t.start()
        t.join(HANG_GUARD_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HANG_GUARD_S)
        up.stop()
    assert outs and outs[0].status_code == 200
    con = duckdb.connect(str(db), read_only=True)
    samples = con.execute(
        "SELECT request_id, time_ns, first_token_ns, last_token_ns, output_tokens "
        "FROM stream_samples ORDER BY time_ns"
    ).fetchall()
    (request_id, first, last, n) = con.execute(
        "SELECT request_id, first_token_ns, last_token_ns, output_tokens FROM requests"
    ).fetchone()
    con.close()
    assert len(samples) >= 3, samples
    assert {s[0] for s in samples} == {request_id}  # joins the request's row once it ends
    assert all(s[2] == first and s[2] <= s[3] <= s[1] and s[3] < last for s in samples)
    counts = [s[4] for s in samples]
    assert counts == sorted(counts) and 0 < counts[0] < counts[-1] < n, counts
