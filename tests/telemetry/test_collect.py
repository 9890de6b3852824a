"""The collector: OTLP/HTTP traces (protobuf and JSON) from another engine into the store, known
engine spans mapped onto our stations, garbage refused with a 400 and nothing stored; and
`tokenmill collect` as a process, fed by the real OpenTelemetry SDK's OTLP/HTTP exporter. Bad
input never breaks it: a partly bad export keeps its good spans and says what it rejected in
`partial_success`, deep JSON and bad encodings are a 400, and a 256 MiB chunked body or a 1 GiB
gzip bomb is refused while read or inflated, the process's peak memory far below either.

vLLM and SGLang need GPUs: their spans are fixtures written from their published span
definitions (docs/engine_metrics.md)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import duckdb
import httpx
import pytest

from tokenmill.telemetry.otlp_receiver import decode_export

FIXTURES = Path(__file__).parent / "fixtures" / "otlp"
VLLM_JSON = (FIXTURES / "vllm_request_span.json").read_bytes()
TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))


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
    """A body that does not decode is a 400; a content type the receiver does not read a 415
    (OTLP/HTTP's answer); nothing of either is stored."""
    client, store = collector
    r = client.post("/v1/traces", content=body, headers={"content-type": content_type})
    assert r.status_code == (415 if content_type == "text/plain" else 400), r.text
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


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM to the group"])
def test_tokenmill_collect_receives_the_sdks_otlp_export(tmp_path, stop):
    """The collector as a process; the OpenTelemetry SDK's own OTLP/HTTP exporter sends it a
    vLLM-shaped request span (as vLLM's tracer does) and a span of no known engine. Stopped by
    Ctrl-C or by a stop sent to its process group (systemd's), it exits 0 with every row in the
    store (before: a SIGTERM was raised again after uvicorn's stop and killed the process
    before the store's last rows were written)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    db = tmp_path / "collected.duckdb"
    proc, url = _start_collect(db, new_session=True)
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
        exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces")
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
        if stop == "SIGINT":
            proc.send_signal(signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
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


# ----- bad input never breaks the receiver or the store (issue 53) -----


def _export(spans: list[dict]) -> bytes:
    """A real OTLP protobuf export of ``spans`` ({name, start, end, attrs})."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(
        KeyValue(key="service.name", value=AnyValue(string_value="engine"))
    )
    ss = rs.scope_spans.add()
    for i, s in enumerate(spans):
        sp = ss.spans.add()
        sp.trace_id = (1000 + i).to_bytes(16, "big")
        sp.span_id = (1000 + i).to_bytes(8, "big")
        sp.name = s["name"]
        sp.start_time_unix_nano = s.get("start", 1_767_225_600_000_000_000 + i)
        sp.end_time_unix_nano = s.get("end", sp.start_time_unix_nano + 1_000_000)
        for key, value in s.get("attrs", {}).items():
            v = (
                AnyValue(string_value=value)
                if isinstance(value, str)
                else AnyValue(int_value=value)
                if isinstance(value, int)
                else AnyValue(double_value=value)
            )
            sp.attributes.append(KeyValue(key=key, value=v))
    return req.SerializeToString()


def _post_pb(client, body: bytes, **headers):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    r = client.post(
        "/v1/traces", content=body, headers={"content-type": "application/x-protobuf", **headers}
    )
    reply = ExportTraceServiceResponse()
    if r.status_code == 200:
        reply.ParseFromString(r.content)
    return r, reply


GOOD = [{"name": f"good{i}", "attrs": {"gen_ai.usage.input_tokens": 10 + i}} for i in range(5)]


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"attrs": {"gen_ai.usage.input_tokens": "12"}}, "input_tokens '12' does not fit"),
        ({"attrs": {"gen_ai.usage.output_tokens": 2**31}}, "output_tokens"),
        ({"start": 2**63 + 5, "end": 2**63 + 9}, "start_ns"),
        ({"start": 2**63 - 10, "end": 2**64 - 1}, "end_ns"),
        ({"attrs": {"gen_ai.latency.e2e": float("nan")}, "name": "llm_request"}, None),
    ],
    ids=["string-tokens", "tokens-past-2^31", "start-past-2^63", "end-past-2^63", "nan-attr"],
)
def test_a_partly_bad_export_keeps_its_good_spans_and_says_how_many_it_rejected(
    collector, bad, why
):
    client, store = collector
    body = _export([*GOOD[:3], {"name": "bad", **bad}, *GOOD[3:]])
    r, reply = _post_pb(client, body)
    assert r.status_code == 200, r.text
    if why is None:  # a NaN attribute: stored as null (strict JSON), never a NaN statistic
        assert reply.partial_success.rejected_spans == 0
        assert _count_spans(store) == 6
        (attrs,) = store.query("SELECT attributes FROM spans WHERE name = 'llm_request'")[0]
        assert json.loads(attrs) == {"gen_ai.latency.e2e": None}
        # the request's E2E is the span's own length, not NaN
        assert store.query("SELECT e2e_ms FROM requests") == [(1.0,)]
        return
    assert reply.partial_success.rejected_spans == 1
    assert f"1 span(s) rejected: span 'bad': {why}" in reply.partial_success.error_message
    assert _count_spans(store) == 5
    assert store.drops == {("spans", "bad_value"): 1}
    # the writer goes on: a later export lands
    r, reply = _post_pb(client, _export(GOOD[:2]))
    assert r.status_code == 200 and reply.partial_success.rejected_spans == 0
    assert _count_spans(store) == 7 and store.writer_alive and store.problem is None


def _count_spans(store) -> int:
    assert store.flush()
    return store.query("SELECT count(*) FROM spans")[0][0]


def test_a_partly_bad_json_export_reports_partial_success_in_json(collector):
    client, store = collector
    doc = json.loads(VLLM_JSON)
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    bad = json.loads(json.dumps(spans[0]))
    bad["spanId"] = "00f067aa0ba902b8"
    for a in bad["attributes"]:
        if a["key"] == "gen_ai.usage.prompt_tokens":
            a["value"] = {"stringValue": "lots"}
    spans.append(bad)
    r = client.post("/v1/traces", json=doc)
    assert r.status_code == 200
    ps = r.json()["partialSuccess"]
    assert ps["rejectedSpans"] == "1" and "span 'llm_request'" in ps["errorMessage"]
    assert _count_spans(store) == 4  # the good request span and its three stations
    assert store.query("SELECT count(*) FROM requests") == [(1,)]


def test_an_export_of_only_bad_spans_is_a_400_naming_why(collector):
    client, store = collector
    body = _export([{"name": "late", "start": 10, "end": 5}])
    r, _ = _post_pb(client, body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "no span could be stored: span 'late': ends before it starts"
    )
    assert _count_spans(store) == 0 and store.drops == {("spans", "bad_value"): 1}


def test_deeply_nested_json_is_a_400(collector):
    client, store = collector
    deep = b'{"resourceSpans": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/traces", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested deeper than 64" in r.json()["error"]["message"]
    shallow_but_deep = b'{"resourceSpans": ' + b"[" * 200 + b"]" * 200 + b"}"
    r = client.post(
        "/v1/traces", content=shallow_but_deep, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "nested deeper than 64" in r.json()["error"]["message"]
    assert _count_spans(store) == 0


@pytest.mark.parametrize(
    "body, encoding, needle",
    [
        (gzip.compress(b"x" * 1000)[:-12], "gzip", "gzip body is cut short"),
        (b"\x1f\x8b\x08\x00 not really", "gzip", "not a gzip body"),
        (b"plain", "br", "content-encoding 'br'"),
    ],
    ids=["gzip-cut-short", "gzip-garbage", "brotli"],
)
def test_malformed_encodings_are_a_400_naming_why(collector, body, encoding, needle):
    """A body that does not inflate is a 400; an encoding the receiver does not read a 415."""
    client, _ = collector
    r, _ = _post_pb(client, body, **{"content-encoding": encoding})
    assert r.status_code == (415 if encoding == "br" else 400)
    assert needle in r.json()["error"]["message"]


def _start_collect(db, new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """``tokenmill collect`` as a process recording into ``db``, once its /health answers: the
    process and its URL (``new_session``: a process group of its own, for a group stop)."""
    port = _free_port()
    proc = subprocess.Popen(
        [TOKENMILL, "collect", "--trace-db", str(db), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):  # a hang guard, not a bound
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
    raise AssertionError("tokenmill collect did not start")


@pytest.fixture
def collect_process(tmp_path):
    """``tokenmill collect`` as a process: (url, pid)."""
    proc, url = _start_collect(tmp_path / "collected.duckdb")
    try:
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _post_stream(url: str, chunks, headers: dict) -> int | None:
    """POST a streamed (chunked) body; the status, or None when the server closed the
    connection before the body ended (it refused it mid-body)."""
    try:
        r = httpx.post(url + "/v1/traces", content=chunks, headers=headers, timeout=60)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return None
    return r.status_code


def _warm(url: str) -> None:
    body = gzip.compress(_export(GOOD))
    r = httpx.post(
        url + "/v1/traces",
        content=body,
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
    )
    assert r.status_code == 200


def test_a_256_mb_chunked_body_is_refused_while_read(collect_process):
    url, pid = collect_process
    _warm(url)
    before = _peak_rss(pid)

    def body():
        block = b"\0" * 2**20
        for _ in range(256):
            yield block

    status = _post_stream(url, body(), {"content-type": "application/x-protobuf"})
    assert status in (413, None)
    grew = _peak_rss(pid) - before
    print(f"256 MiB chunked body: peak RSS +{grew / 2**20:.1f} MiB")
    assert grew < 64 * 2**20  # the cap is 32 MiB: never the body's 256
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_gzip_bomb_is_refused_while_inflated(collect_process):
    url, pid = collect_process
    _warm(url)
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * 2**20
    bomb = b"".join(squeeze.compress(zeros) for _ in range(1024)) + squeeze.flush()
    assert len(bomb) < 2 * 2**20  # 1 GiB inflated
    before = _peak_rss(pid)
    r = httpx.post(
        url + "/v1/traces",
        content=bomb,
        headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
        timeout=60,
    )
    assert r.status_code == 413 and "inflates past" in r.json()["error"]["message"]
    grew = _peak_rss(pid) - before
    print(f"1 GiB gzip bomb: peak RSS +{grew / 2**20:.1f} MiB")
    assert grew < 96 * 2**20  # the 32 MiB cap and its copy: never the bomb's GiB
    _warm(url)  # and the receiver goes on


def test_scrape_interval_0_means_never(tmp_path):
    """As the proxy's help says of the same option: `--scrape-interval 0` scrapes nothing."""
    port = _free_port()
    proc = subprocess.Popen(
        [TOKENMILL, "collect", "--trace-db", str(tmp_path / "c.duckdb"), "--port", str(port),
         "--scrape", "http://127.0.0.1:9/metrics", "--scrape-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        health = None
        for _ in range(150):  # a hang guard, not a bound
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.2)
        assert health is not None and health["scrapers"] == [] and health["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "not scraping (--scrape-interval 0)" in " ".join(stderr.split())
    r = subprocess.run(
        [TOKENMILL, "collect", "--trace-db", str(tmp_path / "x.duckdb"), "--port", "0",
         "--scrape", "http://127.0.0.1:9/metrics", "--scrape-interval", "0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and "nothing to collect" in r.stderr
