"""Other engines' /metrics read into engine_samples, and the scraper's failure modes.

vLLM, SGLang and TGI need GPUs, so their exposition text is a fixture written from each
project's own metric definitions (the version read is in docs/engine_metrics.md); llama.cpp's
fixtures follow its server's `--metrics` output, an older build and the current one (its prompt counter
leaves out the tokens a slot's cache served). Each fixture holds one moment of the same load:
3 running, 5 waiting, KV use 0.62, 4 preemptions, prefix queries 1000 / hits 250, 51,200
prompt and 12,800 generated tokens, 100 finished requests (queue 25 s, prefill 50 s, decode
320 s, TTFT 80 s, E2E 400 s summed over them)."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import duckdb
import msgspec
import pytest

from tokenmill.telemetry.engine_metrics import (
    ENGINES,
    SIGNALS,
    EngineSampleRow,
    MetricsFormatError,
    missing_signals,
    read_exposition,
    read_slots,
)
from tokenmill.telemetry.scrape import MetricsScraper
from tokenmill.telemetry.store import TraceStore

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"

# what each engine's fixture must read as; None: the engine does not expose it
COMMON = {"running": 3.0, "waiting": 5.0, "generation_tokens_total": 12800.0}
EXPECTED = {
    "vllm": {
        **COMMON,
        "kv_usage": 0.62,
        "preemptions_total": 4.0,
        "prefix_queries_total": 1000.0,
        "prefix_hits_total": 250.0,
        "prompt_tokens_total": 51200.0,
        "requests_finished_total": 100.0,  # stop 96 + length 4 + abort 0, over finished_reason
        "iteration_tokens_sum": 64000.0,
        "iteration_tokens_count": 1400.0,
        "queue_s_sum": 25.0,
        "prefill_s_sum": 50.0,
        "decode_s_sum": 320.0,
        "ttft_s_sum": 80.0,
        "ttft_s_count": 100.0,
        "itl_s_sum": 320.0,
        "itl_s_count": 12700.0,
        "e2e_s_sum": 400.0,
    },
    "sglang": {
        **COMMON,
        "kv_usage": 0.62,
        "preemptions_total": 4.0,
        "prefix_queries_total": None,
        "prefix_hits_total": 250.0,  # cached prompt tokens
        "prompt_tokens_total": 51200.0,
        "requests_finished_total": 100.0,
        "queue_s_sum": 25.0,
        "prefill_s_sum": None,
        "ttft_s_sum": 80.0,
        "itl_s_count": 12700.0,
        "e2e_s_sum": 400.0,
    },
    # an older build of llama.cpp's server: a KV gauge, no count of cached prompt tokens
    "llamacpp": {
        **COMMON,
        "kv_usage": 0.62,
        "prompt_tokens_total": 51200.0,
        "prefix_hits_total": None,
        "preemptions_total": None,
        "ttft_s_sum": None,
    },
    # the current build: no KV gauge (see /slots below), cached prompt tokens counted
    "llamacpp_current": {
        **COMMON,
        "kv_usage": None,
        "prompt_tokens_total": 51200.0,
        "prefix_hits_total": 250.0,
        "prefix_queries_total": 51450.0,
        "preemptions_total": None,
    },
    "tgi": {
        **COMMON,
        "kv_usage": None,
        # TGI counts input length at validation: 108 requests, the 8 still queued or running too
        "prompt_tokens_total": 55296.0,
        "requests_finished_total": 100.0,
        "queue_s_sum": 25.0,
        "queue_s_count": 100.0,
        "itl_s_sum": 2.890625,  # mean time per token, one observation per request
        "e2e_s_sum": 400.0,
        "ttft_s_sum": None,
    },
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_each_engines_metrics_read_as_the_same_signals(fixture):
    kind = fixture.split("_")[0]
    text = (FIXTURES / f"{fixture}.prom").read_text()
    row = read_exposition(text, f"http://{kind}:8000/metrics", 123)
    assert row is not None and row.engine_kind == kind  # detected from the names alone
    for signal, want in EXPECTED[fixture].items():
        assert getattr(row, signal) == (pytest.approx(want) if want else None), signal
    # every signal the table maps is present in the fixture (a renamed metric shows up here),
    # but what this fixture's version is said above not to have
    for signal in ENGINES[kind].names:
        col = f"{signal}_sum" if signal not in EngineSampleRow.__struct_fields__ else signal
        if EXPECTED[fixture].get(col, 0) is not None:
            assert getattr(row, col) is not None, (fixture, signal)


def test_the_missing_signals_are_what_the_table_lacks():
    assert missing_signals("vllm") == []
    assert set(missing_signals("llamacpp")) >= {"preemptions_total", "ttft_s", "queue_s"}
    assert "kv_usage" in missing_signals("tgi")
    assert set(missing_signals("tgi")) | set(ENGINES["tgi"].names) == set(SIGNALS)


def test_older_vllm_names_and_several_engines_in_one_scrape():
    """vLLM before the rename served gpu_cache_usage_perc and gpu_prefix_cache_*; two engine
    indexes (data parallel) are summed, their KV use averaged."""
    text = "\n".join(
        [
            "# TYPE vllm:gpu_cache_usage_perc gauge",
            'vllm:gpu_cache_usage_perc{engine="0"} 0.5',
            'vllm:gpu_cache_usage_perc{engine="1"} 0.7',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0"} 2',
            'vllm:num_requests_running{engine="1"} 3',
            "# TYPE vllm:gpu_prefix_cache_hits counter",
            'vllm:gpu_prefix_cache_hits_total{engine="0"} 10',
            'vllm:gpu_prefix_cache_hits_total{engine="1"} 30',
            "",
        ]
    )
    row = read_exposition(text, "u", 1)
    assert (row.engine_kind, row.running, row.prefix_hits_total) == ("vllm", 5.0, 40.0)
    assert row.kv_usage == pytest.approx(0.6)


def test_unknown_engine_and_garbage():
    assert read_exposition("# TYPE up gauge\nup 1\n", "u", 1) is None
    with pytest.raises(MetricsFormatError, match="not Prometheus exposition text"):
        read_exposition("<html>hello</html>\n{", "u", 1)


class _Upstream:
    """A real HTTP server on 127.0.0.1 answering /metrics with whatever ``body``/``status``
    hold at the time (vLLM itself needs a GPU)."""

    def __init__(self):
        self.body, self.status = b"", 200
        self.key: str | None = None  # the bearer key /metrics wants (None: open)
        self.slots: tuple[int, bytes] | None = None  # /slots' status and body (None: 404)
        self.slot_reads = 0
        up = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = up.status, up.body
                if up.key and self.headers.get("Authorization") != f"Bearer {up.key}":
                    status, body = 401, b'{"error": {"message": "missing metrics key"}}'
                if self.path == "/slots":
                    up.slot_reads += 1
                    status, body = up.slots or (404, b"")
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_the_scraper_writes_rows_and_says_each_problem_once(tmp_path, caplog):
    up = _Upstream()
    store = TraceStore(tmp_path / "s.duckdb", flush_interval_s=0.05)
    scraper = MetricsScraper(up.url, store.submit, interval_s=60)
    try:
        up.body = (FIXTURES / "vllm.prom").read_bytes()
        assert scraper.scrape_once()["kv_usage"] == 0.62
        up.status = 404
        with caplog.at_level("WARNING", logger="tokenmill.scrape"):
            assert scraper.scrape_once() is None
            assert scraper.scrape_once() is None
        assert "404" in scraper.status["problem"]
        assert "not assessed" in scraper.status["problem"]
        assert len([r for r in caplog.records if "404" in r.getMessage()]) == 1  # once a streak
        up.status, up.body = 200, b"<html>not metrics</html>\n{{{"
        assert scraper.scrape_once() is None
        assert "not Prometheus exposition text" in scraper.status["problem"]
        up.body = b"# TYPE up gauge\nup 1\n"
        assert scraper.scrape_once() is None
        assert "only the client-side view" in scraper.status["problem"]
        up.body = (FIXTURES / "llamacpp.prom").read_bytes()
        assert scraper.scrape_once()["engine_kind"] == "llamacpp"
        assert scraper.status["problem"] is None
        assert "ttft_s" in scraper.status["not_exposed"]
        up.close()
        assert scraper.scrape_once() is None
        assert scraper.status["problem"].startswith("no answer")
        assert store.flush()
        rows = store.query("SELECT engine_kind, url, waiting FROM engine_samples ORDER BY time_ns")
        assert rows == [("vllm", up.url, 5.0), ("llamacpp", up.url, 5.0)]
    finally:
        scraper.stop()
        store.close()
    # a closed store reads back the same rows (the table is part of the schema)
    con = duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM engine_samples").fetchone() == (2,)
    finally:
        con.close()


def test_a_keyed_metrics_endpoint_is_scraped_with_its_key(tmp_path):
    """A keyed tokenmill server's /metrics answers only its metrics or admin key: the scraper
    (`proxy`/`collect --scrape-key`) sends it; without it each scrape is a 401, said."""
    up = _Upstream()
    up.key, up.body = "m-key", (FIXTURES / "vllm.prom").read_bytes()
    store = TraceStore(tmp_path / "s.duckdb", flush_interval_s=0.05)
    keyed = MetricsScraper(up.url, store.submit, interval_s=60, key="m-key")
    bare = MetricsScraper(up.url, store.submit, interval_s=60)
    try:
        assert keyed.scrape_once()["kv_usage"] == 0.62
        assert bare.scrape_once() is None and "401" in bare.status["problem"]
    finally:
        keyed.stop()
        bare.stop()
        up.close()
        store.close()


def test_llamacpps_slots_say_busy_slots_and_what_they_hold():
    """llama.cpp's current server (the version built here, docs/engine_metrics.md) has no KV
    gauge; ``/slots`` gives busy slots and the tokens they hold. The fixture is written from
    its ``server-context.cpp``."""
    slots = read_slots(json.loads((FIXTURES / "llamacpp_current_slots.json").read_text()))
    # three busy slots: 1000+200, 3000+1500 (held at most n_ctx 4096), 500 in prefill; the
    # idle slot's cached prompt is not in use
    assert slots == {"running": 3.0, "kv_usage": (1200 + 4096 + 500) / (4 * 4096)}
    # an older build's slots say no prompt size: busy slots only
    assert read_slots(json.loads((FIXTURES / "llamacpp_slots.json").read_text())) == {
        "running": 1.0
    }
    for bad in ({}, [], [{"n_ctx": "4096"}], [{"n_ctx": 0}], ["slot"]):
        with pytest.raises(MetricsFormatError, match="/slots"):
            read_slots(bad)


def test_the_scraper_fills_kv_use_from_llamacpps_slots(tmp_path, caplog):
    up = _Upstream()
    store = TraceStore(tmp_path / "s.duckdb", flush_interval_s=0.05)
    scraper = MetricsScraper(up.url, store.submit, interval_s=60)
    try:
        up.body = (FIXTURES / "llamacpp_current.prom").read_bytes()
        up.slots = (200, (FIXTURES / "llamacpp_current_slots.json").read_bytes())
        row = scraper.scrape_once()
        assert row["kv_usage"] == pytest.approx(5796 / 16384)
        assert row["running"] == 3.0 and scraper.status["slots"] == "read"
        # a server started with --no-slots answers 501: said once, asked no more, rows go on
        up.slots = (501, b'{"error": {"code": 501, "type": "not_supported_error"}}')
        with caplog.at_level("WARNING", logger="tokenmill.scrape"):
            assert scraper.scrape_once()["kv_usage"] is None
            assert scraper.scrape_once()["kv_usage"] is None
        assert up.slot_reads == 2
        assert "--no-slots" in scraper.status["slots"]
        assert len([r for r in caplog.records if "/slots" in r.getMessage()]) == 1
        # another engine's scrape never asks for /slots
        other = MetricsScraper(up.url, store.submit, interval_s=60)
        up.body = (FIXTURES / "vllm.prom").read_bytes()
        other.scrape_once()
        other.stop()
        assert up.slot_reads == 2
        assert store.flush()
        kv = store.query("SELECT kv_usage FROM engine_samples WHERE engine_kind = 'llamacpp'")
        assert [k for (k,) in kv] == [pytest.approx(5796 / 16384), None, None]
    finally:
        scraper.stop()
        up.close()
        store.close()


def test_the_scraper_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown engine kind 'triton'"):
        MetricsScraper("http://x/metrics", lambda t, r: True, kind="triton")


def _two_engines(pre0: float, pre1: float, kv0: str, kv1: str) -> bytes:
    """vLLM's exposition with two data-parallel engine indexes (one label set each)."""
    return (
        "# TYPE vllm:num_preemptions counter\n"
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {pre0}\n'
        f'vllm:num_preemptions_total{{engine="1",model_name="m"}} {pre1}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv0}\n'
        f'vllm:kv_cache_usage_perc{{engine="1",model_name="m"}} {kv1}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
    ).encode()


def test_one_engines_counter_reset_and_nan_readings_through_the_real_scraper(tmp_path):
    """Two engines behind one /metrics: engine 0 restarts between scrapes 2 and 3 (its counter
    20 → 2) while engine 1 counts on (10 → 16): 10 + 2 + 6 = 18 preemptions, where the sum's
    own reset (30 → 18) read 28. A NaN or +Inf KV reading is no reading: never the peak."""
    from tokenmill.diagnose.signals import load
    from tokenmill.telemetry.rows import RequestRow

    up = _Upstream()
    store = TraceStore(tmp_path / "s.duckdb", flush_interval_s=0.05)
    scraper = MetricsScraper(up.url, store.submit, interval_s=60)
    try:
        first = None
        for pre0, pre1, kv0, kv1 in (
            (10, 10, "0.5", "0.3"),
            (20, 10, "NaN", "+Inf"),  # no KV reading at all in this scrape
            (2, 16, "NaN", "0.7"),  # engine 0 restarted; its KV reading is NaN
        ):
            up.body = _two_engines(pre0, pre1, kv0, kv1)
            row = scraper.scrape_once()
            first = first or row["time_ns"]
        assert row["preemptions_total"] == 38.0  # 20 + 18: only grows
        assert row["kv_usage"] == 0.7  # the one finite reading, not NaN
        t0, t1 = first - 10**9, row["time_ns"] + 10**9  # one request over the scrapes
        request = RequestRow(request_id="r", trace_id="0" * 32, arrival_ns=t0, end_ns=t1)
        assert store.submit(
            "requests", {**msgspec.structs.asdict(request), "e2e_ms": (t1 - t0) / 1e6}
        )
        assert store.flush()
        assert store.query("SELECT count(*), count(kv_usage) FROM engine_samples") == [(3, 2)]
        with store.connection_locked() as con:
            sig = load(con, window_s=3600)
    finally:
        scraper.stop()
        up.close()
        store.close()
    assert sig.overall["preemptions"] == 18
    assert sig.overall["kv_usage_max"] == pytest.approx(0.7)
    assert sig.overall["kv_usage_mean"] == pytest.approx((0.4 + 0.7) / 2)
