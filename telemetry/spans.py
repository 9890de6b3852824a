"""From a finished :class:`RequestTimeline` to OpenTelemetry spans and a ``requests`` row.

One trace per request: a root ``request`` span (kind SERVER) and one child per station reached,
named exactly ``gateway``, ``tokenize``, ``admission``, ``schedule``, ``prefill``, ``decode``,
``stream``, ``metering`` (DESIGN.md §2). Span times are the timeline's wall-clock ns, so engine
stations carry the engine's own times. Engine events (prefill chunks, preemption, resume, abort)
become span events with their step id on the station whose interval holds them. A request
prefilled on one engine core and decoded on another (prefill/decode disaggregation) also gets a
``kv_transfer`` span, a child of ``prefill`` (not a station): its KV's trip between the cores.

The request's latencies (TTFT, queue, prefill, decode, TPOT, ITL, E2E) are defined once, in
``latency.py``; this module hands it the timeline's stamps."""

from __future__ import annotations

import contextvars
import json

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from tokenmill.engine.api.timeline import RequestTimeline
from tokenmill.engine.api.traceparent import TraceParent
from tokenmill.engine.messages import to_row

from . import latency, rows
from .rows import RequestRow
from .schema import STATIONS


def station_intervals(tl: RequestTimeline) -> dict[str, tuple[int, int]]:
    """``{station: (start_ns, end_ns)}`` for every station the request reached.

    A station's start is the previous station's end on the API side; the engine stations use
    the engine's times; ``stream`` is first → last byte sent; ``metering`` follows the stream.
    """
    out: dict[str, tuple[int, int]] = {}
    t0 = tl.arrival_ns
    if tl.gateway_end_ns is not None:
        out["gateway"] = (t0, tl.gateway_end_ns)
    if tl.tokenize_end_ns is not None:
        out["tokenize"] = (tl.gateway_end_ns or t0, tl.tokenize_end_ns)
    if tl.admission_end_ns is not None:
        out["admission"] = (tl.tokenize_end_ns or t0, tl.admission_end_ns)
    last_token = tl.token_ns[-1] if tl.token_ns else None
    if tl.stats.queued_ns is not None:
        sched_end = (
            tl.stats.scheduled_ns or tl.finished_ns or tl.client_disconnect_ns or tl.stats.queued_ns
        )
        out["schedule"] = (tl.stats.queued_ns, max(sched_end, tl.stats.queued_ns))
    if tl.stats.scheduled_ns is not None:
        pre_end = (
            tl.stats.first_token_ns
            or tl.finished_ns
            or tl.client_disconnect_ns
            or tl.stats.scheduled_ns
        )
        out["prefill"] = (tl.stats.scheduled_ns, max(pre_end, tl.stats.scheduled_ns))
    if tl.stats.first_token_ns is not None:
        out["decode"] = (tl.stats.first_token_ns, max(last_token or 0, tl.stats.first_token_ns))
    if tl.first_byte_ns is not None:
        out["stream"] = (tl.first_byte_ns, tl.last_byte_ns or tl.first_byte_ns)
    if tl.metering_start_ns is not None:
        out["metering"] = (tl.metering_start_ns, tl.metering_end_ns or tl.metering_start_ns)
    return out


def request_end_ns(tl: RequestTimeline, stations: dict[str, tuple[int, int]]) -> int:
    """The root span's end: the latest station end (metering, or wherever it stopped)."""
    return max([tl.arrival_ns, tl.last_byte_ns or 0] + [e for _, e in stations.values()])


def request_row(
    tl: RequestTimeline, trace_id: str, stations: dict[str, tuple[int, int]], end_ns: int
) -> dict:
    """The ``requests`` row (:class:`~.rows.RequestRow` as a dict, column → value) derived from
    the same numbers as the spans."""
    s = tl.stats
    moved = next((e.attrs for e in tl.events if e.name == "kv_transfer"), {})
    times = latency.request_latencies(
        arrival=tl.arrival_ns,
        end=end_ns,
        output_tokens=s.output_tokens,
        token_times=tl.token_ns,
        first_token=s.first_token_ns,
        queued=s.queued_ns,
        scheduled=s.scheduled_ns,
    )
    row = RequestRow(
        **msgspec.structs.asdict(s),  # the engine's counters, a column each
        **times,
        request_id=tl.request_id or tl.client_request_id or trace_id,
        client_request_id=tl.client_request_id,
        trace_id=trace_id,
        tenant=tl.tenant,
        model=tl.model,
        replica=tl.replica,
        endpoint=tl.endpoint,
        stream=tl.stream,
        http_status=tl.http_status,
        arrival_ns=tl.arrival_ns,
        last_token_ns=tl.token_ns[-1] if tl.token_ns else None,
        end_ns=end_ns,
        first_text_ns=tl.first_text_ns,
        text_holdback_ms=latency.elapsed_ms(s.first_token_ns, tl.first_text_ns),
        max_tokens=tl.max_tokens,
        prefill_chunks=sum(1 for e in tl.events if e.name == "chunk"),
        kv_transfer_ms=moved.get("ms"),
        kv_transfer_bytes=moved.get("bytes"),
        kv_wait_ms=moved.get("waited_ms"),
        finish_reason=tl.finish_reason or ("abort" if tl.client_disconnected else None),
        error_type=tl.error_type,
        prompt_block_hashes=tl.prompt_block_hashes,
        prompt_head_hashes=tl.prompt_head_hashes,
        cache_misses=_cache_misses_json(tl),
    )
    return to_row(row)


def _cache_misses_json(tl: RequestTimeline) -> str | None:
    """The ``cache_misses`` column: the runs as JSON objects, unset fields left out."""
    if tl.cache_misses is None:
        return None
    runs = [{k: v for k, v in to_row(m).items() if v is not None} for m in tl.cache_misses]
    return json.dumps(runs)


def kv_transfer_interval(tl: RequestTimeline) -> tuple[int, int, dict] | None:
    """The request's KV transfer from its ``kv_transfer`` event: ``(start_ns, end_ns, attrs)``
    in wall-clock ns, or None when it has no such event (colocated).

    The decode core stamps the event when it adopts the request, after the wait for room
    (``waited_ms``, from the KV's arrival to the adoption); the transfer ended at that arrival
    and took ``ms`` before it. A missing ``ms`` or ``waited_ms`` counts as 0.
    """
    ev = next((e for e in tl.events if e.name == "kv_transfer"), None)
    if ev is None:
        return None
    end = ev.time_ns - round((ev.attrs.get("waited_ms") or 0.0) * 1e6)
    return end - round((ev.attrs.get("ms") or 0.0) * 1e6), end, ev.attrs


def _attrs(d: dict) -> dict:
    """Drop None values (OTel attributes cannot be None)."""
    return {k: v for k, v in d.items() if v is not None}


def emit_trace(tracer: trace.Tracer, tl: RequestTimeline) -> tuple[str, dict, list[float]]:
    """Start and end the request's spans (they reach the provider's processors on end).

    Returns:
        (trace_id hex, the ``requests`` row, the ITL list in ms).
    """
    stations = station_intervals(tl)
    end_ns = request_end_ns(tl, stations)
    parent_ctx = caller_context(tl.traceparent)
    token = CALLER_CONTEXT.set(parent_ctx)
    try:
        return _emit(tracer, tl, stations, end_ns, parent_ctx)
    finally:
        CALLER_CONTEXT.reset(token)


def caller_context(tp: TraceParent | None) -> Context | None:
    """The OTel context of the caller's span (its ``traceparent``), the parent of our root;
    None when it sent none."""
    if tp is None:
        return None
    ctx = SpanContext(
        trace_id=int(tp.trace_id, 16),
        span_id=int(tp.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(tp.flags),
    )
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def operation_name(endpoint: str | None) -> str:
    """The GenAI conventions' ``gen_ai.operation.name`` of an endpoint (chat | completions)."""
    return "chat" if endpoint == "chat" else "text_completion"


def root_span_name(endpoint: str | None, model: str | None) -> str:
    """The request's root span, as the GenAI conventions name it: ``chat {model}`` or
    ``text_completion {model}``. Readers find the root by its kind (``SERVER``), never by name:
    stores written before this naming call it ``request``."""
    op = operation_name(endpoint)
    return f"{op} {model}" if model else op


def genai_messages(tl: RequestTimeline) -> tuple[str | None, str | None]:
    """``(gen_ai.input.messages, gen_ai.output.messages)`` as the GenAI conventions write them
    (JSON lists of ``{"role", "parts": [{"type": "text", "content"}]}``), or ``(None, None)``
    without ``--trace-content``."""
    if not tl.record_content:
        return None, None
    if tl.input_messages is not None:
        sent = [(m["role"], m["content"]) for m in tl.input_messages]
    else:
        sent = [("user", tl.prompt_text or "")]
    inputs = [{"role": r, "parts": [{"type": "text", "content": c}]} for r, c in sent]
    output = {
        "role": "assistant",
        "parts": [{"type": "text", "content": "".join(tl.output_text)}],
        "finish_reason": tl.finish_reason or "error",
    }
    return json.dumps(inputs, ensure_ascii=False), json.dumps([output], ensure_ascii=False)


def _emit(tracer, tl: RequestTimeline, stations, end_ns: int, parent_ctx):
    finish_reasons = [tl.finish_reason] if tl.finish_reason else None
    started = tl.stats.queued_ns is not None
    input_messages, output_messages = genai_messages(tl)
    root_attrs = _attrs(
        {
            "gen_ai.operation.name": operation_name(tl.endpoint),
            # the current GenAI conventions name the provider; gen_ai.system is their older name
            "gen_ai.provider.name": "tokenmill",
            "gen_ai.system": "tokenmill",
            "gen_ai.request.model": tl.model,
            "gen_ai.request.max_tokens": tl.max_tokens,
            "gen_ai.request.temperature": tl.temperature,
            "gen_ai.request.top_p": tl.top_p,
            "gen_ai.request.seed": tl.seed,
            "gen_ai.request.stream": tl.stream,
            "gen_ai.response.id": tl.request_id,
            "gen_ai.response.model": tl.model if tl.finish_reason else None,
            "gen_ai.response.finish_reasons": finish_reasons,
            "gen_ai.usage.input_tokens": tl.stats.input_tokens,
            "gen_ai.usage.output_tokens": tl.stats.output_tokens
            if tl.stats.first_token_ns
            else None,
            "gen_ai.usage.cache_read.input_tokens": tl.stats.cached_tokens if started else None,
            "gen_ai.input.messages": input_messages,
            "gen_ai.output.messages": output_messages,
            "http.request.method": tl.method,
            "url.path": tl.path,
            "http.response.status_code": tl.http_status,
            "error.type": tl.error_type,
            "tokenmill.request_id": tl.request_id,
            "tokenmill.client_request_id": tl.client_request_id,
            "tokenmill.tenant": tl.tenant,
            "tokenmill.replica": tl.replica,
            "tokenmill.stream": tl.stream,
            "tokenmill.usage.cached_tokens": tl.stats.cached_tokens if started else None,
            "tokenmill.preemptions": tl.stats.preemptions if started else None,
        }
    )
    root = tracer.start_span(
        root_span_name(tl.endpoint, tl.model),
        context=parent_ctx,
        kind=SpanKind.SERVER,
        start_time=tl.arrival_ns,
        attributes=root_attrs,
    )
    if tl.error_type:
        root.set_status(Status(StatusCode.ERROR, tl.error_message or tl.error_type))
    ctx = trace.set_span_in_context(root)
    trace_id = format(root.get_span_context().trace_id, "032x")
    row = request_row(tl, trace_id, stations, end_ns)
    itl = latency.itl_ms(tl.token_ns)
    station_attrs = _station_attributes(tl, itl, row)
    error_station = _error_station(tl, stations)
    for name in STATIONS:
        if name not in stations:
            continue
        start, end = stations[name]
        attrs = station_attrs.get(name, {})
        if tl.request_id:
            attrs["tokenmill.request_id"] = tl.request_id
        span = tracer.start_span(name, context=ctx, start_time=start, attributes=attrs)
        for ev in tl.events:
            if _event_station(ev.time_ns, ev.name, stations) == name:
                span.add_event(
                    ev.name,
                    attributes={"tokenmill.step_id": ev.step_id, **_event_attrs(ev.attrs)},
                    timestamp=ev.time_ns,
                )
        if name == "stream" and tl.client_disconnected:
            span.add_event(
                "client_disconnect", timestamp=tl.client_disconnect_ns or tl.last_byte_ns or end
            )
        if name == error_station:
            span.set_attribute("error.type", tl.error_type)
            span.set_status(Status(StatusCode.ERROR, tl.error_message or tl.error_type))
        span.end(end_time=end)
        if name == "prefill":
            _emit_kv_transfer(tracer, tl, trace.set_span_in_context(span))
    root.end(end_time=end_ns)
    return trace_id, row, itl


def _emit_kv_transfer(tracer: trace.Tracer, tl: RequestTimeline, ctx) -> None:
    """The ``kv_transfer`` child of the prefill span (``ctx``), when the request had one; it
    may end after its parent."""
    moved = kv_transfer_interval(tl)
    if moved is None:
        return
    start, end, attrs = moved
    keys = ("bytes", "ms", "waited_ms", "from", "to")
    span_attrs = _attrs({f"tokenmill.kv_transfer.{k}": attrs.get(k) for k in keys})
    if tl.request_id:
        span_attrs["tokenmill.request_id"] = tl.request_id
    tracer.start_span("kv_transfer", context=ctx, start_time=start, attributes=span_attrs).end(
        end_time=end
    )


def _event_attrs(attrs: dict) -> dict:
    return {f"tokenmill.{k}": v for k, v in attrs.items() if isinstance(v, (int, float, str, bool))}


def _event_station(t: int, name: str, stations: dict[str, tuple[int, int]]) -> str | None:
    """The station an engine event belongs to: chunks to prefill, others by time."""
    if name == "chunk" and "prefill" in stations:
        return "prefill"
    for st in ("decode", "prefill", "schedule"):
        if st in stations and stations[st][0] <= t <= stations[st][1]:
            return st
    for st in ("decode", "prefill", "schedule"):
        if st in stations:
            return st
    return None


def _error_station(tl: RequestTimeline, stations: dict) -> str | None:
    """The last station reached is where a failed request failed."""
    if not tl.error_type:
        return None
    if tl.client_disconnected:
        return "stream" if "stream" in stations else None
    # the error answer's own bytes make a stream span; the failure is where work stopped
    reached = [s for s in STATIONS if s in stations and s not in ("stream", "metering")]
    return reached[-1] if reached else None


def _station_attributes(tl: RequestTimeline, itl: list[float], row: dict) -> dict[str, dict]:
    """Each station's attributes; the decode span's latencies are the ``requests`` row's."""
    n = tl.stats.output_tokens
    usage = tl.usage
    return {
        "gateway": _attrs({"tokenmill.tenant": tl.tenant}),
        "tokenize": _attrs({"gen_ai.usage.input_tokens": tl.stats.input_tokens}),
        "admission": _attrs(
            {
                "tokenmill.pool": tl.pool,
                "tokenmill.replica": tl.replica,
                "tokenmill.admission.queue_depth": tl.queue_depth_seen,
                "tokenmill.admission.in_flight": tl.in_flight_seen,
            }
        ),
        "schedule": _attrs({"tokenmill.preemptions": tl.stats.preemptions}),
        "prefill": _attrs(
            {
                "tokenmill.usage.cached_tokens": tl.stats.cached_tokens,
                "tokenmill.prefill.chunks": sum(1 for e in tl.events if e.name == "chunk"),
                "tokenmill.recomputed_tokens": tl.stats.recomputed_tokens,
            }
        ),
        "decode": _attrs(
            {
                "gen_ai.usage.output_tokens": n,
                "tokenmill.decode.itl_ms": itl,
                "tokenmill.decode.itl_p50_ms": row["itl_p50_ms"],
                "tokenmill.decode.itl_p99_ms": row["itl_p99_ms"],
                "tokenmill.decode.tpot_ms": row["tpot_ms"],
                "tokenmill.decode.spec_drafts": tl.stats.spec_drafts,
                "tokenmill.decode.spec_draft_tokens": tl.stats.spec_draft_tokens,
                "tokenmill.decode.spec_accepted_tokens": tl.stats.spec_accepted_tokens,
                "tokenmill.decode.spec_acceptance_rate": (
                    tl.stats.spec_accepted_tokens / tl.stats.spec_draft_tokens
                    if tl.stats.spec_draft_tokens
                    else None
                ),
            }
        ),
        "stream": _attrs(
            {"tokenmill.stream": tl.stream, "http.response.status_code": tl.http_status}
        ),
        # what was billed: the metered usage (a cut request's prompt counts only once its
        # prefill began, see engine/api/stations.billed_usage)
        "metering": _attrs(
            {
                "gen_ai.usage.input_tokens": usage["prompt_tokens"],
                "gen_ai.usage.output_tokens": usage["completion_tokens"],
                "tokenmill.usage.cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", tl.stats.cached_tokens
                ),
            }
            if usage
            else {
                "gen_ai.usage.input_tokens": tl.stats.input_tokens,
                "gen_ai.usage.output_tokens": n,
                "tokenmill.usage.cached_tokens": tl.stats.cached_tokens,
            }
        ),
    }


class StoreSpanProcessor(SpanProcessor):
    """Turns each ended span into a ``spans`` row for the trace store (schema.sql).

    Args:
        submit: ``submit("spans", row) -> bool``, non-blocking (TraceStore.submit).
    """

    def __init__(self, submit):
        self._submit = submit

    def on_end(self, span: ReadableSpan) -> None:
        self._submit("spans", sdk_span_row(span))

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def sdk_span_row(span: ReadableSpan) -> dict:
    """A ``spans`` row from an ended SDK span."""
    ctx = span.get_span_context()
    return rows.span_row(
        trace_id=format(ctx.trace_id, "032x"),
        span_id=format(ctx.span_id, "016x"),
        parent_span_id=format(span.parent.span_id, "016x") if span.parent else None,
        name=span.name,
        kind=span.kind.name,
        start_ns=span.start_time,
        end_ns=span.end_time,
        status_code=span.status.status_code.name,
        status_message=span.status.description,
        service_name=span.resource.attributes.get("service.name"),
        attributes=dict(span.attributes or {}),
        events=[
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    )


def make_tracer_provider(resource_attrs: dict) -> TracerProvider:
    """A TracerProvider with tokenmill's resource. The standard variables win over
    ``resource_attrs``: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the SDK merges
    them in; a ``service.name`` given here only fills in when neither names one).

    Every request's spans are recorded (``ALWAYS_ON``), whatever the caller's sampled flag or
    ``OTEL_TRACES_SAMPLER``: our own store keeps them all, and :class:`SampledExport` applies
    the sampling to the export alone."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    return TracerProvider(resource=make_resource(resource_attrs), sampler=ALWAYS_ON)


def make_resource(resource_attrs: dict):
    """tokenmill's OTel resource (spans and metrics alike): ``resource_attrs`` under the
    standard ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``, which win."""
    import os

    from opentelemetry.sdk.resources import Resource

    attrs = dict(resource_attrs)
    env_attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in env_attrs:
        attrs.pop("service.name", None)
    return Resource.create(attrs)


#: The caller's context (its ``traceparent``) while :func:`emit_trace` ends a request's spans,
#: None when it sent none: the export's sampler decides the whole trace on it
CALLER_CONTEXT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "tokenmill_caller_context", default=None
)


class SampledExport(SpanProcessor):
    """Wraps an exporting processor: passes on the spans of the traces ``sampler`` exports
    (``otlp.export_sampler``: ``OTEL_TRACES_SAMPLER``/``_ARG``, parent-based by default, so a
    caller that did not sample its request keeps it out of the export). Each span of a request is
    judged on the request's trace id and its caller's context, never its own parent, so a trace
    leaves whole or not at all; sampling governs what leaves the server, never what our store
    keeps."""

    def __init__(self, inner: SpanProcessor, sampler):
        self.inner = inner
        self.sampler = sampler

    def on_start(self, span, parent_context=None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        verdict = self.sampler.should_sample(CALLER_CONTEXT.get(), span.context.trace_id, span.name)
        if verdict.decision.is_sampled():
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
