"""Spans from timelines without a server: stations reached, error placement, and the optional
OTLP export received by a real HTTP endpoint on 127.0.0.1."""

from __future__ import annotations

import collections
import http.server
import json
import random
import threading

import duckdb
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokenmill.engine.api.timeline import RequestTimeline
from tokenmill.engine.api.traceparent import parse_traceparent
from tokenmill.engine.messages import RequestOutput, RequestStats
from tokenmill.engine.request import RequestEvent
from tokenmill.telemetry.hub import Telemetry
from tokenmill.telemetry.otlp import GENAI_SERVER_HISTOGRAMS, OTLPConfigError
from tokenmill.telemetry.spans import (
    STATIONS,
    StoreSpanProcessor,
    emit_trace,
    kv_transfer_interval,
    make_tracer_provider,
)

T0 = 1_800_000_000_000_000_000


def _completed() -> RequestTimeline:
    tl = RequestTimeline(arrival_ns=T0, method="POST", path="/v1/chat/completions")
    tl.endpoint, tl.request_id, tl.tenant, tl.model = "chat", "cmpl-1", "acme", "m"
    tl.gateway_end_ns, tl.tokenize_end_ns, tl.admission_end_ns = T0 + 100, T0 + 200, T0 + 300
    tl.stats.queued_ns, tl.stats.scheduled_ns, tl.stats.first_token_ns = (
        T0 + 400,
        T0 + 2_000_000,
        T0 + 5_000_000,
    )
    tl.token_ns = [T0 + 5_000_000, T0 + 7_000_000, T0 + 12_000_000]
    tl.stats.output_tokens, tl.stats.input_tokens, tl.finish_reason = 3, 20, "stop"
    tl.stats.preemptions = 1
    tl.events = [
        RequestEvent("chunk", 3, T0 + 4_000_000, {"tokens": 20}),
        RequestEvent("preempted", 7, T0 + 8_000_000, {"recompute_tokens": 22}),
    ]
    tl.first_byte_ns, tl.last_byte_ns = T0 + 5_100_000, T0 + 12_100_000
    tl.metering_start_ns, tl.metering_end_ns = T0 + 12_200_000, T0 + 12_210_000
    tl.http_status = 200
    return tl


def _spans(tl: RequestTimeline):
    rows = []
    provider = make_tracer_provider({"service.name": "t"})
    provider.add_span_processor(StoreSpanProcessor(lambda table, row: rows.append(row)))
    trace_id, req, itl = emit_trace(provider.get_tracer("t"), tl)
    return trace_id, req, itl, {r["name"]: r for r in rows}


def test_completed_timeline_gives_root_and_eight_stations_with_engine_times():
    trace_id, req, itl, spans = _spans(_completed())
    assert set(spans) == {"chat m", *STATIONS}
    assert spans["schedule"]["start_ns"] == T0 + 400
    assert spans["prefill"]["end_ns"] == T0 + 5_000_000
    assert spans["decode"]["end_ns"] == T0 + 12_000_000
    assert itl == [2.0, 5.0] and req["tpot_ms"] == 3.5 and req["ttft_ms"] == 5.0
    assert abs(req["e2e_ms"] - 12.21) < 1e-9 and abs(req["queue_ms"] - 1.9996) < 1e-9
    assert "chunk" in [e["name"] for e in json.loads(spans["prefill"]["events"])]
    decode_events = json.loads(spans["decode"]["events"])
    assert [e["attributes"]["tokenmill.step_id"] for e in decode_events] == [7]  # preempted
    assert spans["chat m"]["trace_id"] == trace_id and spans["chat m"]["kind"] == "SERVER"
    attrs = json.loads(spans["chat m"]["attributes"])
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.usage.input_tokens"] == 20 and attrs["gen_ai.usage.output_tokens"] == 3
    # no content without --trace-content
    assert "gen_ai.input.messages" not in attrs and "gen_ai.output.messages" not in attrs


def test_root_span_follows_the_genai_conventions_with_content():
    """Root `chat {model}` / `text_completion {model}`, the request's sampling settings, the
    cached prompt tokens as cache reads, and under --trace-content the messages as sent and the
    answer, in the conventions' parts layout (what Phoenix and Langfuse read)."""
    tl = _completed()
    tl.record_content, tl.top_p, tl.seed, tl.stream = True, 0.9, 7, True
    tl.temperature, tl.max_tokens, tl.stats.cached_tokens = 0.5, 32, 16
    tl.input_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
    ]
    tl.output_text = ["Par", "is."]
    _, _, _, spans = _spans(tl)
    a = json.loads(spans["chat m"]["attributes"])
    assert (a["gen_ai.request.top_p"], a["gen_ai.request.seed"]) == (0.9, 7)
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (0.5, 32)
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.usage.cache_read.input_tokens"] == 16
    assert a["gen_ai.response.finish_reasons"] == ["stop"] and a["gen_ai.response.id"] == "cmpl-1"
    assert json.loads(a["gen_ai.input.messages"]) == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "content": "Capital of France?"}]},
    ]
    assert json.loads(a["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "Paris."}],
            "finish_reason": "stop",
        }
    ]

    plain = _completed()
    plain.endpoint, plain.path, plain.record_content = "completions", "/v1/completions", True
    plain.prompt_text, plain.output_text = "Once upon", [" a time"]
    _, _, _, spans = _spans(plain)
    a = json.loads(spans["text_completion m"]["attributes"])
    assert a["gen_ai.operation.name"] == "text_completion"
    assert json.loads(a["gen_ai.input.messages"])[0]["parts"][0]["content"] == "Once upon"


def test_tokens_of_one_step_are_one_arrival_for_itl():
    """Speculative decoding gives a request several tokens in one step, all with that step's
    time: ITL counts arrivals (no zero gaps, as vLLM's benchmark), TPOT still divides the decode
    time by every output token after the first."""
    tl = _completed()
    ms = 1_000_000
    # tokens 1-3 in one step (2 accepted drafts), 4, then 5-6 together
    tl.token_ns = [T0 + 5 * ms, T0 + 7 * ms, T0 + 7 * ms, T0 + 7 * ms, T0 + 9 * ms]
    tl.token_ns += [T0 + 12 * ms, T0 + 12 * ms]
    tl.stats.output_tokens = 7
    _, req, itl, spans = _spans(tl)
    assert itl == [2.0, 2.0, 3.0]
    assert req["itl_p50_ms"] == 2.0 and req["itl_max_ms"] == 3.0
    assert req["decode_ms"] == 7.0 and req["tpot_ms"] == 7.0 / 6
    attrs = json.loads(spans["decode"]["attributes"])
    assert attrs["tokenmill.decode.itl_ms"] == [2.0, 2.0, 3.0]
    assert attrs["tokenmill.decode.tpot_ms"] == 7.0 / 6
    assert spans["decode"]["end_ns"] == T0 + 12 * ms


def _disaggregated() -> RequestTimeline:
    """``_completed`` prefilled on one core, decoded on another: its KV (16 tokens' blocks) left
    at the first token (5 ms), took 2.5 ms, then waited 1.5 ms for room on the decode side,
    which adopted it at 9 ms; the second token came at 10 ms."""
    tl = _completed()
    ms = 1_000_000
    tl.token_ns = [T0 + 5 * ms, T0 + 10 * ms, T0 + 12 * ms]
    attrs = {"bytes": 737_280, "ms": 2.5, "waited_ms": 1.5, "from": "prefill", "to": "decode"}
    tl.events.append(RequestEvent("kv_transfer", 4, T0 + 9 * ms, attrs))
    return tl


def test_kv_transfer_is_a_child_span_of_prefill(tmp_path):
    """The transfer's span hangs off the prefill station, spans arrival minus the wait back to
    its start, carries the event's attributes, and reaches the store's ``spans`` table; the
    eight stations stay as they were."""
    _, req, _, spans = _spans(_disaggregated())
    assert set(spans) == {"chat m", *STATIONS, "kv_transfer"}
    moved = spans["kv_transfer"]
    assert moved["parent_span_id"] == spans["prefill"]["span_id"]
    assert moved["trace_id"] == spans["prefill"]["trace_id"]
    assert moved["start_ns"] == T0 + 5_000_000 and moved["end_ns"] == T0 + 7_500_000
    assert moved["duration_ns"] == 2_500_000 and moved["request_id"] == "cmpl-1"
    assert json.loads(moved["attributes"]) == {
        "tokenmill.kv_transfer.bytes": 737_280,
        "tokenmill.kv_transfer.ms": 2.5,
        "tokenmill.kv_transfer.waited_ms": 1.5,
        "tokenmill.kv_transfer.from": "prefill",
        "tokenmill.kv_transfer.to": "decode",
        "tokenmill.request_id": "cmpl-1",
    }
    assert json.loads(moved["events"]) == []  # the event itself stays on its station
    assert spans["prefill"]["end_ns"] == T0 + 5_000_000  # the station is unchanged
    assert "kv_transfer" in [e["name"] for e in json.loads(spans["decode"]["events"])]
    assert (req["kv_transfer_ms"], req["kv_transfer_bytes"], req["kv_wait_ms"]) == (
        2.5,
        737_280,
        1.5,
    )
    # not timed and no wait recorded: a point at the adoption
    tl = _disaggregated()
    tl.events[-1].attrs = {"bytes": 737_280, "ms": None, "waited_ms": None}
    assert kv_transfer_interval(tl) == (T0 + 9_000_000, T0 + 9_000_000, tl.events[-1].attrs)

    path = tmp_path / "t.duckdb"
    tel = Telemetry("m", trace_db=str(path), device_sample_interval_s=0)
    tel.on_request(_disaggregated())
    tel.store.flush(60)
    tel.close()
    with duckdb.connect(str(path), read_only=True) as con:
        rows = con.execute(
            "SELECT c.start_ns, c.end_ns, p.name FROM spans c JOIN spans p "
            "ON c.parent_span_id = p.span_id WHERE c.name = 'kv_transfer'"
        ).fetchall()
    assert rows == [(T0 + 5_000_000, T0 + 7_500_000, "prefill")]


def test_colocated_request_has_no_kv_transfer_span():
    tl = _completed()
    assert kv_transfer_interval(tl) is None
    _, req, _, spans = _spans(tl)
    assert "kv_transfer" not in spans and req["kv_transfer_ms"] is None


def _output(
    token_ns: list[int],
    n_out: int,
    drafts: int,
    draft_tokens: int,
    accepted: int,
    finished: bool = False,
) -> RequestOutput:
    return RequestOutput(
        request_id="cmpl-1",
        new_token_ids=[1] * len(token_ns),
        new_text="x",
        token_ns=token_ns,
        finished=finished,
        finish_reason="stop" if finished else None,
        stop_reason=None,
        error_type=None,
        error_message=None,
        stats=RequestStats(
            input_tokens=20,
            output_tokens=n_out,
            cached_tokens=0,
            preemptions=0,
            recomputed_tokens=0,
            queued_ns=T0 + 400,
            scheduled_ns=T0 + 2_000_000,
            first_token_ns=T0 + 5_000_000,
            spec_drafts=drafts,
            spec_draft_tokens=draft_tokens,
            spec_accepted_tokens=accepted,
        ),
        arrival_ns=T0,
        finished_ns=token_ns[-1] if finished else None,
    )


def test_speculative_counters_reach_the_decode_span_and_the_row():
    """The engine's cumulative draft counters (RequestOutput) fold into the timeline; the decode
    span and the requests row carry them, the span also the acceptance rate."""
    tl = RequestTimeline(arrival_ns=T0, method="POST", path="/v1/completions")
    tl.gateway_end_ns, tl.tokenize_end_ns, tl.admission_end_ns = T0 + 100, T0 + 200, T0 + 300
    ms = 1_000_000
    tl.observe(_output([T0 + 5 * ms], 1, 0, 0, 0))
    tl.observe(_output([T0 + 7 * ms] * 3, 4, 1, 3, 2))  # 3 drafts verified, 2 accepted
    tl.observe(_output([T0 + 9 * ms], 5, 2, 6, 2, finished=True))  # none accepted
    assert (tl.stats.spec_drafts, tl.stats.spec_draft_tokens, tl.stats.spec_accepted_tokens) == (
        2,
        6,
        2,
    )
    _, req, itl, spans = _spans(tl)
    assert itl == [2.0, 2.0] and req["tpot_ms"] == 1.0
    assert (req["spec_drafts"], req["spec_draft_tokens"], req["spec_accepted_tokens"]) == (2, 6, 2)
    attrs = json.loads(spans["decode"]["attributes"])
    assert attrs["tokenmill.decode.spec_drafts"] == 2
    assert attrs["tokenmill.decode.spec_draft_tokens"] == 6
    assert attrs["tokenmill.decode.spec_accepted_tokens"] == 2
    assert attrs["tokenmill.decode.spec_acceptance_rate"] == 2 / 6
    # speculation off: zero counts, no rate
    _, req, _, spans = _spans(_completed())
    attrs = json.loads(spans["decode"]["attributes"])
    assert req["spec_draft_tokens"] == 0 and attrs["tokenmill.decode.spec_draft_tokens"] == 0
    assert "tokenmill.decode.spec_acceptance_rate" not in attrs


def test_refused_request_fails_at_the_gateway():
    tl = RequestTimeline(arrival_ns=T0, method="POST", path="/v1/completions")
    tl.fail("rate_limit_exceeded", "over its rate")
    tl.first_byte_ns = tl.last_byte_ns = tl.gateway_end_ns + 10
    tl.http_status = 429
    _, req, _, spans = _spans(tl)
    assert set(spans) == {"text_completion", "gateway", "stream"}
    assert spans["gateway"]["error_type"] == "rate_limit_exceeded"
    assert spans["gateway"]["status_code"] == "ERROR" and spans["stream"]["status_code"] == "UNSET"
    assert req["http_status"] == 429 and req["output_tokens"] == 0 and req["ttft_ms"] is None


def _collect(
    timelines: list[RequestTimeline], metrics_out: list | None = None, **telemetry
) -> tuple[list, list[dict]]:
    """Record ``timelines`` through a Telemetry exporting to a local OTLP/HTTP collector:
    (the collector's resource spans, the store's span rows); the metric exports it received
    go to ``metrics_out`` (ExportMetricsServiceRequest messages)."""
    received: list[bytes] = []
    metric_bodies: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            (metric_bodies if self.path == "/v1/metrics" else received).append(body)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    stored: list[dict] = []
    try:
        tel = Telemetry(
            "m",
            trace_db=None,
            otlp_endpoint=f"http://127.0.0.1:{httpd.server_port}",
            device_sample_interval_s=0,
            **telemetry,
        )
        tel.provider.add_span_processor(StoreSpanProcessor(lambda t, row: stored.append(row)))
        for tl in timelines:
            tel.on_request(tl)
        assert tel.provider.force_flush(10_000)
        tel.close()
    finally:
        httpd.shutdown()
    out = []
    for body in received:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        out += list(msg.resource_spans)
    for body in metric_bodies if metrics_out is not None else ():
        msg = ExportMetricsServiceRequest()
        msg.ParseFromString(body)
        metrics_out.append(msg)
    return out, stored


def _histograms(messages: list) -> dict[str, list]:
    """metric name → its histogram data points, over every export received."""
    out: dict[str, list] = {}
    for msg in messages:
        for rm in msg.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out.setdefault(m.name, []).extend(m.histogram.data_points)
    return out


def test_ttft_tpot_and_e2e_leave_as_the_genai_server_metrics(monkeypatch):
    """One chat request (TTFT 5 ms, 3 output tokens over 7 ms of decode, E2E ~12 ms) reaches
    the collector as the conventions' three histograms, in seconds, with their advised
    buckets, the operation and provider attributes and the service's resource."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-eu")
    got: list = []
    _collect([_completed()], metrics_out=got)
    assert got, "no metric export reached the collector"
    assert {a.key: a.value.string_value for a in got[0].resource_metrics[0].resource.attributes}[
        "service.name"
    ] == "llm-eu"
    hist = _histograms(got)
    assert set(hist) == set(GENAI_SERVER_HISTOGRAMS), set(hist)
    (ttft,) = hist["gen_ai.server.time_to_first_token"]
    (tpot,) = hist["gen_ai.server.time_per_output_token"]
    (e2e,) = hist["gen_ai.server.request.duration"]
    assert (ttft.count, tpot.count, e2e.count) == (1, 1, 1)
    assert abs(ttft.sum - 0.005) < 1e-9 and abs(tpot.sum - 0.0035) < 1e-9
    assert 0.012 <= e2e.sum <= 0.0125
    assert list(ttft.explicit_bounds) == list(
        GENAI_SERVER_HISTOGRAMS["gen_ai.server.time_to_first_token"][1]
    )
    attrs = {a.key: a.value.string_value for a in ttft.attributes}
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "tokenmill",
        "gen_ai.request.model": "m",
    }


def test_a_failed_request_counts_only_in_the_duration_with_its_error_type():
    tl = RequestTimeline(arrival_ns=T0, method="POST", path="/v1/completions")
    tl.endpoint = "completions"
    tl.fail("rate_limit_exceeded", "over its rate")
    tl.first_byte_ns = tl.last_byte_ns = tl.gateway_end_ns + 10
    tl.http_status = 429
    got: list = []
    _collect([tl], metrics_out=got)
    hist = _histograms(got)
    assert set(hist) == {"gen_ai.server.request.duration"}, set(hist)
    (point,) = hist["gen_ai.server.request.duration"]
    attrs = {a.key: a.value.string_value for a in point.attributes}
    assert attrs["error.type"] == "rate_limit_exceeded"
    assert attrs["gen_ai.operation.name"] == "text_completion"


def test_an_unknown_otlp_protocol_is_one_line(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(OTLPConfigError) as err:
        Telemetry(
            "m", trace_db=None, otlp_endpoint="http://127.0.0.1:9", device_sample_interval_s=0
        )
    msg = str(err.value)
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in msg and "grpc" in msg and "\n" not in msg


def test_grpc_export_reaches_a_grpc_collector(monkeypatch):
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc: spans and metrics reach a real gRPC OTLP collector
    (grpcio serving the collector protos' services on 127.0.0.1)."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from concurrent import futures

    from opentelemetry.proto.collector.metrics.v1 import (
        metrics_service_pb2,
        metrics_service_pb2_grpc,
    )
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    spans, metrics = [], []

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            spans.extend(request.resource_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):
            metrics.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "grpc-svc")
    try:
        tel = Telemetry(
            "m", trace_db=None, otlp_endpoint=f"http://127.0.0.1:{port}", device_sample_interval_s=0
        )
        tel.on_request(_completed())
        tel.close()
    finally:
        server.stop(0)
    assert sorted(_names(spans)) == sorted(["chat m", *STATIONS])
    attrs = {a.key: a.value.string_value for a in spans[0].resource.attributes}
    assert attrs["service.name"] == "grpc-svc"
    assert _histograms(metrics)["gen_ai.server.time_to_first_token"][0].count == 1


def _names(resource_spans) -> list[str]:
    return [s.name for rs in resource_spans for ss in rs.scope_spans for s in ss.spans]


def test_otlp_export_reaches_a_collector():
    exported, _ = _collect([_completed()])
    assert sorted(_names(exported)) == sorted(["chat m", *STATIONS])


def test_the_standard_otel_variables_name_the_service(monkeypatch):
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES reach the exported resource; without
    them the service is ``tokenmill``."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-gateway-eu")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod")
    exported, _ = _collect([_completed()])
    attrs = {a.key: a.value.string_value for a in exported[0].resource.attributes}
    assert attrs["service.name"] == "llm-gateway-eu"
    assert attrs["deployment.environment"] == "prod"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    exported, _ = _collect([_completed()])
    attrs = {a.key: a.value.string_value for a in exported[0].resource.attributes}
    assert attrs["service.name"] == "tokenmill"


def test_an_unsampled_caller_keeps_its_waterfall_in_our_store_but_is_not_exported():
    """A traceparent with the sampled flag off: every span of the request is in our store (its
    waterfall), under the caller's trace id, and none is exported; a sampled caller's request
    is both."""
    off, on = _completed(), _completed()
    off.traceparent = parse_traceparent("00-" + "a" * 32 + "-" + "b" * 16 + "-00")
    on.traceparent = parse_traceparent("00-" + "c" * 32 + "-" + "d" * 16 + "-01")
    exported, stored = _collect([off, on])
    trace_ids = {s.trace_id.hex() for rs in exported for ss in rs.scope_spans for s in ss.spans}
    assert trace_ids == {"c" * 32}
    by_trace = {}
    for row in stored:
        by_trace.setdefault(row["trace_id"], []).append(row["name"])
    assert sorted(by_trace["a" * 32]) == sorted(["chat m", *STATIONS])
    assert sorted(by_trace["c" * 32]) == sorted(["chat m", *STATIONS])


def _with_caller(trace_id: str, sampled: bool) -> RequestTimeline:
    tl = _completed()
    tl.traceparent = parse_traceparent(f"00-{trace_id}-{'b' * 16}-{'01' if sampled else '00'}")
    return tl


def test_the_export_follows_otel_traces_sampler_and_the_store_keeps_every_trace(monkeypatch):
    """OTEL_TRACES_SAMPLER=traceidratio with _ARG=0.1: of 400 requests (trace ids drawn from a
    fixed seed, callers' flags ignored as the ratio sampler does) about a tenth leave, each trace
    whole (its root and eight stations), and the store keeps all 400. Before: the variables
    were overridden and every trace was exported."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    rng = random.Random(7)
    ids = [f"{rng.getrandbits(128):032x}" for _ in range(400)]
    exported, stored = _collect([_with_caller(t, sampled=True) for t in ids])
    spans_by_trace = collections.Counter(
        s.trace_id.hex() for rs in exported for ss in rs.scope_spans for s in ss.spans
    )
    assert 25 <= len(spans_by_trace) <= 55, len(spans_by_trace)
    assert set(spans_by_trace.values()) == {1 + len(STATIONS)}
    assert set(spans_by_trace) < set(ids)
    assert {row["trace_id"] for row in stored} == set(ids)
    assert len(stored) == 400 * (1 + len(STATIONS))


def test_parent_based_sampling_follows_the_caller_and_the_ratio_decides_the_rest(monkeypatch):
    """parentbased_traceidratio with a ratio of 0: a caller that sampled its request gets it
    exported, one that did not does not, and a request with no caller is left to the ratio."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    on, off = _with_caller("c" * 32, sampled=True), _with_caller("a" * 32, sampled=False)
    exported, stored = _collect([on, off, _completed()])
    assert {s.trace_id.hex() for rs in exported for ss in rs.scope_spans for s in ss.spans} == {
        "c" * 32
    }
    assert len({row["trace_id"] for row in stored}) == 3


def test_the_standard_variables_switch_each_export_off(monkeypatch):
    """OTEL_SDK_DISABLED=true: nothing exported; OTEL_TRACES_EXPORTER=none: no spans but the
    metrics; OTEL_METRICS_EXPORTER=none: spans but no metrics (before: --otlp-endpoint turned on
    both, and these variables were not read). The store keeps every span in each case."""

    def parts():
        tel = Telemetry(
            "m", trace_db=None, otlp_endpoint="http://127.0.0.1:9", device_sample_interval_s=0
        )
        try:
            return tel.otlp_export is not None, tel.genai_metrics is not None
        finally:
            tel.close(0)

    assert parts() == (True, True)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert parts() == (False, False)
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert parts() == (False, True)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    assert parts() == (True, False)
    exported, stored = _collect([_completed()])
    assert sorted(_names(exported)) == sorted(["chat m", *STATIONS])
    assert len(stored) == 1 + len(STATIONS)


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("OTEL_TRACES_SAMPLER", "jaeger_remote", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "2", "0..1"),
        ("OTEL_TRACES_SAMPLER_ARG", "a tenth", "0..1"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "'none'"),
        ("OTEL_METRICS_EXPORTER", "prometheus", "'none'"),
    ],
)
def test_a_sampler_or_exporter_we_do_not_have_is_one_line(monkeypatch, var, value, says):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv(var, value)
    with pytest.raises(OTLPConfigError) as err:
        Telemetry(
            "m", trace_db=None, otlp_endpoint="http://127.0.0.1:9", device_sample_interval_s=0
        )
    msg = str(err.value)
    assert f"{var}={value!r}" in msg and says in msg and "\n" not in msg
