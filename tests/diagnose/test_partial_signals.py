"""Signal families filled from what another engine's store holds: the queue and KV signals from
its scraped metrics (``engine_samples``) where there are no step records, and the request rows
a proxy wrote completed with the upstream's ``schedule``/``prefill`` stations of the same trace.

The store is written the way ``tokenmill proxy --otlp-receiver`` writes one: the proxy's
client-side request rows and its ``request``/``gateway``/``stream`` spans, the upstream's own
station spans under the same trace id, and one ``/metrics`` scrape a second (the real-engine
comparison of the two stores is ``benchmarks/any_engine.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.report import baseline_lines
from tokenmill.diagnose.rules import RULES
from tokenmill.diagnose.signals import load
from tokenmill.telemetry.engine_metrics import EngineSampleRow
from tokenmill.telemetry.rows import RequestRow
from tokenmill.telemetry.store import TraceStore

T0 = 1_767_225_600_000_000_000
S = 1_000_000_000
MS = 1_000_000
N = 40  # requests, one every 0.5 s over 20 s
URL = "http://127.0.0.1:8000/metrics"


def _span(trace: str, name: str, service: str, start: int, end: int, **kw) -> dict:
    return {
        "trace_id": trace,
        "span_id": f"{abs(hash((trace, name, service))) % 16**16:016x}",
        "parent_span_id": kw.pop("parent", None),
        "name": name,
        "service_name": service,
        "kind": "INTERNAL",
        "start_ns": start,
        "end_ns": end,
        "duration_ns": end - start,
        "status_code": "UNSET",
        "attributes": "{}",
        "events": "[]",
        **kw,
    }


def _request(i: int, queued: bool = True) -> tuple[dict, list[dict]]:
    """Request ``i`` as the proxy and the upstream recorded it: with ``queued``, the second
    half of the run queued 2 s inside the upstream (the client sees it only as TTFT)."""
    trace = f"{i + 1:032x}"
    arrival = T0 + i * S // 2
    queue_ms = 2000.0 if queued and i >= N // 2 else 20.0
    ttft_ms = queue_ms + 80.0
    first = arrival + int(ttft_ms * MS)
    end = first + 31 * 30 * MS
    row = RequestRow(
        request_id=f"chatcmpl-{i}", trace_id=trace, endpoint="chat", stream=True,
        http_status=200, arrival_ns=arrival, first_token_ns=first, last_token_ns=end,
        end_ns=end, input_tokens=0, output_tokens=32, ttft_ms=ttft_ms, tpot_ms=30.0,
        itl_p50_ms=30.0, itl_p99_ms=31.0, itl_max_ms=31.0, e2e_ms=(end - arrival) / MS,
        decode_ms=(end - first) / MS, finish_reason="length",
    )  # fmt: skip
    up = arrival + 2 * MS  # the upstream's own view starts when the proxy forwarded
    scheduled = up + int(queue_ms * MS)
    spans = [
        _span(trace, "request", "tokenmill-proxy", arrival, end, kind="SERVER"),
        _span(trace, "gateway", "tokenmill-proxy", arrival, up),
        _span(trace, "request", "tokenmill", up, end, input_tokens=60, output_tokens=32),
        _span(trace, "schedule", "tokenmill", up, scheduled),
        _span(trace, "prefill", "tokenmill", scheduled, scheduled + 75 * MS),
    ]
    return msgspec.structs.asdict(row), spans


def _sample(k: int) -> dict:
    """Scrape ``k`` (one a second): a queue that builds in the second half, KV use rising to
    95 %, and 6 preemptions in the last 5 s (counter 10 → 16)."""
    late = k >= 10
    row = EngineSampleRow(
        time_ns=T0 + k * S, url=URL, engine_kind="tokenmill",
        running=4.0, waiting=float(k - 9) if late else 0.0,
        kv_usage=0.5 + 0.045 * (k - 9) if late else 0.4,
        preemptions_total=10.0 + max(0, k - 14),
    )  # fmt: skip
    return msgspec.structs.asdict(row)


def _write(path, *, queued: bool = True, spans: bool = True, sample=_sample) -> TraceStore:
    """An open store holding the run's ``N`` requests (with the upstream's spans when
    ``spans``) and 21 scrapes of ``sample(k)``, flushed."""
    store = TraceStore(path, flush_interval_s=0.05)
    for i in range(N):
        row, rows = _request(i, queued=queued)
        assert store.submit("requests", row)
        for sp in rows if spans else ():
            assert store.submit("spans", sp)
    for k in range(21):
        assert store.submit("engine_samples", sample(k))
    assert store.flush()
    return store


@pytest.fixture(scope="module")
def proxy_store(tmp_path_factory):
    store = _write(tmp_path_factory.mktemp("proxy") / "p.duckdb")
    yield store
    store.close()


def test_queue_and_prefill_come_from_the_upstreams_stations(proxy_store):
    with proxy_store.connection_locked() as con:
        sig = load(con, window_s=5)
        # the stored rows are untouched: the proxy's connection still reads NULL queue times
        assert con.execute("SELECT count(*) FROM requests WHERE queue_ms IS NULL").fetchone() == (
            N,
        )
    w = sig.windows  # 5 s each: requests 0-9, 10-19 (quick), 20-29, 30-39 (queued 2 s)
    assert w[0].get("queue_p50") == pytest.approx(20.0)
    assert w[3].get("queue_p50") == pytest.approx(2000.0)
    assert w[3].get("queue_share_of_ttft") == pytest.approx(2000 / 2080)
    assert sig.overall["short_prompt_tokens"] == 60  # the upstream's prompt size, not usage's 0


def test_queue_and_kv_signals_come_from_the_scraped_metrics(proxy_store):
    with proxy_store.connection_locked() as con:
        sig = load(con, window_s=5)
    assert sig.sources == {
        "steps": "steps_from_samples",
        "kv": "kv_from_samples",
        "same_work": "same_work_from_requests",
    }
    w = sig.windows
    assert w[0].get("waiting_mean") == 0.0 and w[0].get("kv_usage_max") == pytest.approx(0.4)
    # scrapes 15..19 in the last full window: waiting 6..10, KV up to 0.5 + 0.045 * 10
    assert w[3].get("waiting_mean") == pytest.approx(8.0)
    assert w[3].get("kv_usage_max") == pytest.approx(0.95)
    assert w[3].get("preemptions") == 5 and w[2].get("preemptions") == 0
    assert sig.overall["preemptions"] == 6
    # what a scrape cannot say stays None: no step counts, no allocation failures
    assert w[3].get("steps") is None and w[3].get("allocation_failures") is None


def test_rules_reading_queue_and_kv_are_assessed_and_the_report_says_where_from(proxy_store):
    with proxy_store.connection_locked() as con:
        report = diagnose(con, window_s=5)
    for rid in ("ttft_queueing", "overload", "kv_pressure_preemption", "head_of_line_blocking"):
        assert rid not in report.not_assessed, (rid, report.not_assessed.get(rid))
    # rules that need what no scrape says are still listed
    assert "host_contention" in report.not_assessed
    assert report.to_json()["signal_sources"] == {
        "steps": "steps_from_samples",
        "kv": "kv_from_samples",
        "same_work": "same_work_from_requests",
    }
    lines = baseline_lines(report)
    assert any("scraped /metrics" in line and line.endswith("for kv, steps.") for line in lines)
    assert any("time per output token" in line for line in lines), lines
    assert {r.id for r in RULES} >= set(report.not_assessed)


def test_a_counter_reset_reads_as_a_restart_from_zero(tmp_path):
    store = TraceStore(tmp_path / "r.duckdb", flush_interval_s=0.05)
    try:
        row, _ = _request(0)
        assert store.submit("requests", row)
        for k, total in enumerate((50.0, 53.0, 2.0, 4.0)):  # restarted between 1 and 2
            s = _sample(k)
            s["time_ns"] = T0 + k * S // 4  # within the one request's range
            s["preemptions_total"] = total
            assert store.submit("engine_samples", s)
        assert store.flush()
        with store.connection_locked() as con:
            sig = load(con, window_s=10)
    finally:
        store.close()
    assert sig.overall["preemptions"] == 3 + 2 + 2


def test_kv_pressure_from_scraped_metrics_alone_names_what_it_could_not_see(tmp_path):
    """No healthy window (preemptions all along, the KV cache at 97 %): from our step records
    the rule would also want allocation failures in most steps; the engine's metrics do not
    count those, so its two other absolute markers decide, and the summary says so."""

    def full(k: int) -> dict:
        return {**_sample(k), "kv_usage": 0.97, "waiting": 0.0, "preemptions_total": 3.0 * k}

    store = _write(tmp_path / "kv.duckdb", spans=False, sample=full)
    try:
        with store.connection_locked() as con:
            report = diagnose(con, window_s=5)
    finally:
        store.close()
    assert report.healthy_baseline["available"] is False
    kv = next(f for f in report.findings if f.rule_id == "kv_pressure_preemption")
    assert "count no allocation failures" in kv.summary and "KV cache at 97%" in kv.summary
    assert kv.evidence["allocation_failure_step_share"] is None


def test_several_proxies_stores_read_as_a_fleet(tmp_path):
    """One proxy per region, each its own store: `tokenmill diagnose east.duckdb west.duckdb`
    diagnoses each on its own and says which one queues."""

    def flat(k: int) -> dict:  # no queue building
        return {**_sample(0), "time_ns": T0 + k * S}

    _write(tmp_path / "east.duckdb").close()
    _write(tmp_path / "west.duckdb", queued=False, sample=flat).close()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engine.cli",
            "diagnose",
            str(tmp_path / "east.duckdb"),
            str(tmp_path / "west.duckdb"),
            "--window",
            "5s",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [s["name"] for s in doc["sources"]] == ["east", "west"]
    fired = {(f["rule"], f.get("source")) for f in doc["findings"]}
    assert ("ttft_queueing", "east") in fired
    assert not any(src == "west" for _, src in fired), fired
    assert doc["fleet_wide"] == []


def test_a_batch_flat_at_its_most_while_requests_wait_is_named_without_the_engines_cap(tmp_path):
    """A store with no config event (the engine's flags unknown): running flat at 4, the most it
    ever ran, with requests waiting, KV at 30 % and TTFT mostly queue: `batching_ineffective`
    names the batch it saw and says the cap itself is not in the store."""
    store = _write(tmp_path / "b.duckdb", sample=lambda k: {**_sample(k), "kv_usage": 0.3})
    try:
        with store.connection_locked() as con:
            report = diagnose(con, window_s=5)
    finally:
        store.close()
    f = next(f for f in report.findings if f.rule_id == "batching_ineffective")
    assert "4 running (the most it ever ran; the engine's own cap is not in this store)" in (
        f.summary
    )
    assert f.evidence["max_num_seqs"] is None and f.evidence["running_max"] == 4.0


def _strict(text: str):
    """Parse ``text`` as RFC 8259 JSON: ``NaN``/``Infinity`` are refused."""

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_nan_and_inf_readings_are_no_statistic_and_the_json_report_is_strict(tmp_path):
    """An engine's /metrics may say NaN or +Inf (a gauge divided by zero); an older store may
    hold such readings. They never become a mean, a peak or a counter's increase, and
    `diagnose --format json` stays strict JSON."""

    def odd(k: int) -> dict:
        s = _sample(k)
        if k == 17:
            s["preemptions_total"] = float("nan")
        if k in (18, 19):
            s["kv_usage"] = float("nan") if k == 18 else float("inf")
        return s

    path = tmp_path / "nan.duckdb"
    store = _write(path, sample=odd)
    try:
        with store.connection_locked() as con:
            sig = load(con, window_s=5)
            report = diagnose(con, window_s=5)
    finally:
        store.close()
    w = sig.windows
    assert w[3].get("kv_usage_max") == pytest.approx(0.5 + 0.045 * 8)  # scrape 17, not NaN
    assert w[3].get("kv_usage_mean") == pytest.approx(
        sum(0.5 + 0.045 * (k - 9) for k in (15, 16, 17)) / 3
    )
    assert sig.overall["preemptions"] == 6  # 10 → 16, the NaN scrape passed over
    # a NaN that reaches a report anyway is written as null
    from tokenmill.diagnose.report import to_json

    report.findings[0].evidence["odd"] = float("nan")
    doc = _strict(to_json(report))
    assert doc["findings"][0]["evidence"]["odd"] is None
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "diagnose", "--db", str(path),
         "--window", "5s", "--format", "json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _strict(r.stdout)["findings"]


HOG = {"pid": 4242, "command": "python -m tokenmill.bench.cpu_hog --procs 4", "cpu_pct": 61.0,
       "load_generator": False}  # fmt: skip


def _neighbour_store(path, *, others_pct: float, slow: float = 3.0, streams: int = 3):
    """A proxy's store of 60 s: a request a second, each decoding 3 s (3 streams at once),
    and the host sampled twice a second with the upstream counted as the server's. In the
    second half the upstream's time per output token is ``slow`` x (same streams), while
    processes outside the server use ``others_pct`` % of the CPU (the hog named)."""
    store = TraceStore(path, flush_interval_s=0.05)
    for i in range(60):
        arrival = T0 + i * S
        tpot = 30.0 * (slow if i >= 30 else 1.0)
        tokens = int(3000 / tpot) + 1
        first = arrival + 80 * MS
        end = first + 3 * S
        row = RequestRow(
            request_id=f"chatcmpl-{i}", trace_id=f"{i + 1:032x}", endpoint="chat", stream=True,
            http_status=200, arrival_ns=arrival, first_token_ns=first, last_token_ns=end,
            end_ns=end, input_tokens=60, output_tokens=tokens, ttft_ms=80.0, tpot_ms=tpot,
            itl_p50_ms=tpot, itl_p99_ms=tpot, itl_max_ms=tpot, e2e_ms=(end - arrival) / MS,
            decode_ms=(end - first) / MS, finish_reason="length",
        )  # fmt: skip
        assert store.submit("requests", msgspec.structs.asdict(row))
    for k in range(130):
        t = T0 + k * S // 2
        busy = t >= T0 + 30 * S
        assert store.submit("device_samples", {
            "time_ns": t, "kind": "host", "device_index": 0, "cpu_pct": 95.0,
            "cpu_others_pct": others_pct if busy else 2.0, "steal_pct": 0.0, "run_queue": 6.0,
            "loadgen_cpu_pct": 3.0, "busy_others": json.dumps([HOG] if busy else []),
        })  # fmt: skip
    assert store.flush()
    return store


def _diagnosed(path, **kw):
    store = _neighbour_store(path, **kw)
    try:
        with store.connection_locked() as con:
            return diagnose(con, window_s=10)
    finally:
        store.close()


def test_a_neighbour_behind_a_proxy_is_found_from_the_requests_time_per_token(tmp_path):
    """No steps in a proxy's store: the same-work comparison runs over the requests, each one's
    time per output token against the quickest quarter of those decoding beside as many
    streams, and the proxy's host samples name the neighbour."""
    report = _diagnosed(tmp_path / "n.duckdb", others_pct=60.0)
    assert report.to_json()["signal_sources"]["same_work"] == "same_work_from_requests"
    found = {f.rule_id: f for f in report.findings}
    assert "host_contention" in found, sorted(found)
    f = found["host_contention"]
    assert 2.5 < f.evidence["same_work_slowdown"] < 3.5, f.evidence
    assert "time per output token" in f.summary and "cpu_hog" in f.summary, f.summary


def test_the_same_slower_tokens_without_a_neighbour_are_not_host_contention(tmp_path):
    report = _diagnosed(tmp_path / "q.duckdb", others_pct=2.0)
    assert "host_contention" not in {f.rule_id for f in report.findings}


def test_more_streams_at_once_is_not_the_same_work(tmp_path):
    """Twice the streams at 1.6x the time per token (a busier upstream, its batch grown): they
    are set against requests that decoded beside as many streams, not against the 3-stream
    ones (that would read 1.6x, past ``slowdown``), so a neighbour's samples alone do not make
    it contention."""
    store = _neighbour_store(tmp_path / "b.duckdb", others_pct=60.0, slow=1.0)
    try:
        with store.connection_locked() as con:  # double the second half's streams
            con.execute(
                "INSERT INTO requests SELECT * REPLACE (request_id || 'b' AS request_id, "
                "trace_id || 'b' AS trace_id, tpot_ms * 1.6 AS tpot_ms) FROM requests "
                "WHERE arrival_ns >= ?", [T0 + 30 * S]
            )  # fmt: skip
            con.execute("UPDATE requests SET tpot_ms = 48.0 WHERE arrival_ns >= ?", [T0 + 30 * S])
            report = diagnose(con, window_s=10)
            sig = load(con, window_s=10)
    finally:
        store.close()
    late = [w.get("same_work_slowdown") for w in sig.windows[4:6]]
    assert all(v is not None and v < 1.5 for v in late), late
    assert "host_contention" not in {f.rule_id for f in report.findings}


def _open_streams_store(path, *, tokens_move: bool, others_pct: float = 60.0):
    """A proxy's store: 30 s of quick requests (3 streams at 30 ms a token), then 30 s in
    which no request ends: three streams stay open, sampled each second, making a token every
    ``2 s`` when ``tokens_move`` (a neighbour: 66x slower) or none at all, while two requests
    wait for their first token and others use ``others_pct`` % of the CPU."""
    store = _neighbour_store(path, others_pct=others_pct)
    with store.connection_locked() as con:
        con.execute("DELETE FROM requests WHERE arrival_ns >= ?", [T0 + 30 * S])
    opened = T0 + 31 * S
    for k in range(30):
        t = opened + k * S
        for j in range(3):
            n = 1 + (k // 2 if tokens_move else 0)
            last = opened + (2 * (n - 1) * S if tokens_move else 0)
            assert store.submit("stream_samples", {
                "time_ns": t, "request_id": f"open-{j}", "first_token_ns": opened,
                "last_token_ns": last, "output_tokens": n,
            })  # fmt: skip
        for j in range(2):
            assert store.submit("waiting_samples", {
                "time_ns": t, "request_id": f"wait-{j}", "arrival_ns": opened,
                "wait_ms": (t - opened) / MS,
            })  # fmt: skip
    assert store.flush()
    return store


def test_open_streams_show_a_neighbour_before_any_request_ends(tmp_path):
    store = _open_streams_store(tmp_path / "o.duckdb", tokens_move=True)
    try:
        with store.connection_locked() as con:
            report = diagnose(con, window_s=10)
            sig = load(con, window_s=10)
    finally:
        store.close()
    late = [w.get("same_work_slowdown") for w in sig.windows[3:6]]
    assert all(v is not None and v > 10 for v in late), late
    assert "host_contention" in {f.rule_id for f in report.findings}


@pytest.mark.parametrize("tokens_move", [True, False])
def test_an_upstream_whose_open_streams_make_tokens_is_not_stalled(tmp_path, tokens_move):
    """No request ends for 30 s and two wait for a first token, the host quiet: streams that
    still make tokens (slowly) are an upstream at work, streams frozen at their first token a
    stopped one (engine_stalled)."""
    store = _open_streams_store(tmp_path / "s.duckdb", tokens_move=tokens_move, others_pct=2.0)
    try:
        with store.connection_locked() as con:
            report = diagnose(con, window_s=10)
    finally:
        store.close()
    assert ("engine_stalled" in {f.rule_id for f in report.findings}) is not tokens_move
