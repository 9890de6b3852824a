"""The collector: OTLP/HTTP traces (protobuf and JSON) from another engine into the store, known
engine spans mapped onto our stations, garbage refused with a 400 and nothing stored; and
`tokenmill collect` as a process, fed by the real OpenTelemetry SDK's OTLP/HTTP exporter.

vLLM and SGLang need GPUs: their spans are fixtures written from their published span
definitions (docs/engine_metrics.md)."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from fastapi.testclient import TestClient

from tokenmill.telemetry.collect import make_app
from tokenmill.telemetry.otlp_receiver import decode_export
from tokenmill.telemetry.store import TraceStore

FIXTURES = Path(__file__).parent / "fixtures" / "otlp"
VLLM_JSON = (FIXTURES / "vllm_request_span.json").read_bytes()
TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))


@pytest.fixture
def collector(tmp_path):
    store = TraceStore(tmp_path / "c.duckdb", flush_interval_s=0.05)
    with TestClient(make_app(store)) as client:
        yield client, store
    store.close()


def _spans(store):
    assert store.flush()
    return store.query(
        "SELECT name, parent_span_id, (end_ns - start_ns) / 1e9, input_tokens, output_tokens "
        "FROM spans ORDER BY start_ns, name"
    )


def test_vllm_request_span_becomes_our_stations_and_a_request_row(collector):
    client, store = collector
    r = client.post("/v1/traces", content=VLLM_JSON, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json() == {}  # no partial success to report
    spans = _spans(store)
    root = "b7ad6b7169203331"
    assert ("llm_request", "00f067aa0ba902b7", 4.0, 512, 128) in spans
    stations = {name: (parent, dur) for name, parent, dur, *_ in spans if name != "llm_request"}
    assert stations == {"schedule": (root, 0.25), "prefill": (root, 0.5), "decode": (root, 3.2)}
    # the stations lie end to end from the request's arrival
    (gap,) = store.query(
        "SELECT max(s.start_ns) - min(s.start_ns) FROM spans s WHERE name = 'decode' "
        "OR name = 'llm_request'"
    )[0]
    assert gap == 750_000_000
    (row,) = store.query(
        "SELECT request_id, trace_id, ttft_ms, queue_ms, prefill_ms, decode_ms, e2e_ms, "
        "input_tokens, output_tokens, finish_reason FROM requests"
    )
    assert row == (
        "chatcmpl-3f2a9c1e7b5d4e08a6c1d2e3f4a5b6c7",
        "4bf92f3577b34da6a3ce929d0e0e4736",
        800.0,
        250.0,
        500.0,
        3200.0,
        4000.0,
        512,
        128,
        "stop",
    )


def test_protobuf_and_gzip_store_the_same_as_json(collector, tmp_path):
    client, store = collector
    body = gzip.compress(decode_export(VLLM_JSON, "application/json").SerializeToString())
    r = client.post(
        "/v1/traces",
        content=body,
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-protobuf"
    assert r.content == b""  # an empty ExportTraceServiceResponse: all accepted
    assert len(_spans(store)) == 4


def test_sglang_stage_spans_map_one_to_one(collector):
    client, store = collector
    body = (FIXTURES / "sglang_request_spans.json").read_bytes()
    r = client.post("/v1/traces", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert store.flush()
    rows = store.query(
        "SELECT s.name, p.name, s.duration_ns / 1e9 FROM spans s JOIN spans p "
        "ON s.parent_span_id = p.span_id WHERE s.name IN ('schedule', 'prefill', 'decode') "
        "ORDER BY s.start_ns"
    )
    assert rows == [
        ("schedule", "prefill_waiting", 0.25),
        ("prefill", "prefill_forward", 0.5),
        ("decode", "decode_loop", 3.2),
    ]


@pytest.mark.parametrize(
    "body, content_type, needle",
    [
        (b"not json at all", "application/json", "not JSON"),
        (b"[1, 2]", "application/json", "not an object"),
        (b'{"resourceSpans": "x"}', "application/json", "not an OTLP trace export"),
        (
            VLLM_JSON.replace(b"4bf92f3577b34da6a3ce929d0e0e4736", b"zz-not-hex"),
            "application/json",
            "traceId 'zz-not-hex' is not hex",
        ),
        (
            VLLM_JSON.replace(b"4bf92f3577b34da6a3ce929d0e0e4736", b"4bf92f35"),
            "application/json",
            "trace id must be 16 bytes",
        ),
        (b"\xff\xff\xff garbage", "application/x-protobuf", "not an OTLP protobuf"),
        (VLLM_JSON, "text/plain", "send application/x-protobuf or application/json"),
    ],
)
def test_garbage_is_a_400_naming_why_and_nothing_is_stored(collector, body, content_type, needle):
    client, store = collector
    r = client.post("/v1/traces", content=body, headers={"content-type": content_type})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert store.flush()
    assert store.query("SELECT count(*) FROM spans")[0][0] == 0
    assert store.query("SELECT count(*) FROM requests")[0][0] == 0


def test_a_bad_gzip_body_is_a_400(collector):
    client, _ = collector
    r = client.post(
        "/v1/traces",
        content=b"not gzip",
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
    )
    assert r.status_code == 400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tokenmill_collect_receives_the_sdks_otlp_export(tmp_path):
    """The collector as a process; the OpenTelemetry SDK's own OTLP/HTTP exporter sends it a
    vLLM-shaped request span (as vLLM's tracer does) and a span of no known engine."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    port = _free_port()
    db = tmp_path / "collected.duckdb"
    proc = subprocess.Popen(
        [TOKENMILL, "collect", "--trace-db", str(db), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import httpx

        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("vllm.llm_engine")
        t0 = time.time_ns()
        span = tracer.start_span("llm_request", start_time=t0)
        span.set_attributes(
            {
                "gen_ai.request.id": "req-1",
                "gen_ai.latency.time_in_queue": 0.1,
                "gen_ai.latency.time_to_first_token": 0.3,
                "gen_ai.latency.time_in_model_prefill": 0.2,
                "gen_ai.latency.time_in_model_decode": 0.5,
                "gen_ai.latency.e2e": 0.8,
                "gen_ai.usage.prompt_tokens": 40,
                "gen_ai.usage.completion_tokens": 11,
            }
        )
        span.end(end_time=t0 + 800_000_000)
        tracer.start_span("something_else").end()
        provider.shutdown()
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    con = duckdb.connect(str(db), read_only=True)
    try:
        names = sorted(r[0] for r in con.execute("SELECT name FROM spans").fetchall())
        assert names == ["decode", "llm_request", "prefill", "schedule", "something_else"]
        assert con.execute("SELECT service_name FROM spans LIMIT 1").fetchone() == ("vllm",)
        row = con.execute("SELECT request_id, ttft_ms, tpot_ms FROM requests").fetchone()
        assert row == ("req-1", 300.0, pytest.approx(50.0))
    finally:
        con.close()


def test_collect_refuses_bad_options_in_one_line(tmp_path):
    for args, needle in (
        (["--port", "0"], "nothing to collect"),
        (["--scrape", "vllm:8000"], "give an http(s) URL"),
        (["--scrape-interval", "soon", "--port", "0"], "--scrape-interval"),
        (["--engine-kind", "triton"], "--engine-kind must be one of"),
    ):
        r = subprocess.run(
            [TOKENMILL, "collect", "--trace-db", str(tmp_path / "x.duckdb"), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert needle in lines[0], lines[0]
