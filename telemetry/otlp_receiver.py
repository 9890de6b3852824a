"""Receive OTLP/HTTP traces (protobuf or JSON) from any engine into the trace store.

:func:`decode_export` reads an ``ExportTraceServiceRequest`` body (``application/x-protobuf``,
or ``application/json`` with OTLP's hex trace and span ids); :func:`span_rows` turns its spans
into ``spans`` rows as they were received. Known engine spans are also mapped onto tokenmill's
stations of the same trace (:func:`station_rows`): SGLang's stage spans map one to one, and
vLLM's ``llm_request`` span carries the
request's queue, prefill and decode times as attributes, which become its ``schedule``,
``prefill`` and ``decode`` child spans and a ``requests`` row, so the waterfall, ``explain`` and
the rules read another engine's requests as they read ours. Anything that does not decode is an
:class:`OTLPDecodeError` (the receiver's 400) and nothing of that body is stored.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from .latency import request_latencies
from .rows import RequestRow, span_row

# OTLP span kinds and status codes as the store names them (schema.sql)
_KIND = {v: k.removeprefix("SPAN_KIND_") for k, v in Span.SpanKind.items()}
_STATUS = {v: k.removeprefix("STATUS_CODE_") for k, v in Status.StatusCode.items()}

#: vLLM's request span (``vllm/tracing``: SpanAttributes; names in docs/engine_metrics.md)
VLLM_REQUEST_SPAN = "llm_request"
#: its latencies (seconds); its id, model and token counts reach the span's own columns through
#: ``rows.HOT_ATTRIBUTES``, where vLLM's names follow ours
VLLM_LATENCY = {
    "queue_s": "gen_ai.latency.time_in_queue",
    "ttft_s": "gen_ai.latency.time_to_first_token",
    "prefill_s": "gen_ai.latency.time_in_model_prefill",
    "decode_s": "gen_ai.latency.time_in_model_decode",
    "e2e_s": "gen_ai.latency.e2e",
}


#: SGLang's request-stage spans (``python/sglang/srt/tracing``) → our stations
SGLANG_STATIONS = {
    "prefill_waiting": "schedule",
    "prefill_forward": "prefill",
    "decode_loop": "decode",
}


class OTLPDecodeError(ValueError):
    """A body that is not an OTLP trace export (one-line reason): the receiver's 400."""


class OTLPUnsupportedMedia(OTLPDecodeError):
    """A content type or encoding the receiver does not read (one-line reason): its 415, as
    OTLP/HTTP asks for an unsupported content type."""


def _hex_ids_to_base64(node):
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping wants base64."""
    if isinstance(node, dict):
        for key in ("traceId", "spanId", "parentSpanId"):
            v = node.get(key)
            if isinstance(v, str) and v:
                try:
                    node[key] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise OTLPDecodeError(f"{key} {v[:40]!r} is not hex") from None
        for v in node.values():
            _hex_ids_to_base64(v)
    elif isinstance(node, list):
        for v in node:
            _hex_ids_to_base64(v)
    return node


def decode_export(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """Decode an OTLP/HTTP trace export.

    Raises:
        OTLPDecodeError: an unsupported content type, or a body that does not decode.
    """
    kind = (content_type or "").split(";")[0].strip().lower()
    req = ExportTraceServiceRequest()
    if kind == "application/x-protobuf":
        try:
            req.ParseFromString(body)
        except (DecodeError, RuntimeWarning) as exc:
            raise OTLPDecodeError(f"not an OTLP protobuf trace export ({exc})") from None
    elif kind == "application/json":
        try:
            doc = json.loads(body)
        except RecursionError:
            raise OTLPDecodeError(_TOO_DEEP) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise OTLPDecodeError(f"not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise OTLPDecodeError("not an OTLP trace export (the JSON is not an object)")
        if _depth_over(doc, MAX_JSON_DEPTH):
            raise OTLPDecodeError(_TOO_DEEP)
        problem = shape_problem(doc, req.DESCRIPTOR)
        if problem is not None:
            raise OTLPDecodeError(f"not an OTLP trace export ({problem})")
        try:  # OTLP/JSON receivers ignore fields of unknown names (the spec's MUST)
            json_format.ParseDict(_hex_ids_to_base64(doc), req, ignore_unknown_fields=True)
        except RecursionError:
            raise OTLPDecodeError(_TOO_DEEP) from None
        except (json_format.ParseError, binascii.Error) as exc:
            raise OTLPDecodeError(f"not an OTLP trace export ({parse_reason(exc)})") from None
    else:
        raise OTLPUnsupportedMedia(
            f"content type {content_type!r}: send application/x-protobuf or application/json"
        )
    return req


def shape_problem(node: dict, desc, where: str = "") -> str | None:
    """Where the JSON has something else than an object for a message field (one line), or
    None. protobuf's parser would read a string there as the field names of its characters,
    which, unknown names being ignored, keeps an empty message: a value silently lost."""
    names = {f.json_name: f for f in desc.fields} | {f.name: f for f in desc.fields}
    for key, value in node.items():
        f = names.get(key)
        if f is None or f.message_type is None or value is None:
            continue
        repeated = f.is_repeated and isinstance(value, list)
        for i, item in enumerate(value if repeated else [value]):
            at = f"{where}.{key}" + (f"[{i}]" if repeated else "")
            if not isinstance(item, dict):
                return f"{at.lstrip('.')}: expected an object, got {type(item).__name__}"
            problem = shape_problem(item, f.message_type, at)
            if problem is not None:
                return problem
    return None


_FIELD = re.compile(r"Failed to parse (\w+) field: ")
_WHERE = re.compile(r' at "?ExportTraceServiceRequest\.?([^"\s]*)"?')


def parse_reason(exc: Exception, limit: int = 240) -> str:
    """protobuf's JSON parse error as one line: the field where it failed (with its indices
    when protobuf gives them, ``resourceSpans[0].scopeSpans[0].spans[0].kind``) and why."""
    text = str(exc)
    path = []
    while m := _FIELD.match(text):
        path.append(m.group(1))
        text = text[m.end() :]
    detail = (text.strip().splitlines() or [""])[0].rstrip(". ")
    where = ".".join(path)
    if m := _WHERE.search(detail):
        where, detail = m.group(1) or where, detail[: m.start()]
    line = f"{where}: {detail}" if where else detail
    return line if len(line) <= limit else line[: limit - 3] + "..."


#: nesting an OTLP/JSON export may have (an attribute's kvlist/array values nest; protobuf's
#: own parser stops at 100 levels)
MAX_JSON_DEPTH = 64
_TOO_DEEP = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"


def _depth_over(doc, limit: int) -> bool:
    """Whether ``doc`` nests deeper than ``limit`` (iterative: no recursion to run out of)."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
    return False


def span_problem(sp: Span) -> str | None:
    """Why one received span cannot be stored as a span (one line), or None."""
    if len(sp.trace_id) != 16 or len(sp.span_id) != 8:
        return (
            f"trace id must be 16 bytes and span id 8 (got {len(sp.trace_id)} and "
            f"{len(sp.span_id)})"
        )
    if sp.end_time_unix_nano < sp.start_time_unix_nano:
        return "ends before it starts"
    return None


def _value(v: AnyValue):
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def span_rows(req: ExportTraceServiceRequest) -> list[dict]:
    """``spans`` rows, one per received span, as received (attributes and events as JSON);
    a span that cannot be one is left out (:func:`received_rows` says why)."""
    return [row for _, row, _ in _spans(req) if row is not None]


def _spans(req: ExportTraceServiceRequest):
    """Per received span: its name, its ``spans`` row or None, and why not (one line)."""
    for rs in req.resource_spans:
        try:
            service = _attrs(rs.resource.attributes).get("service.name")
        except RecursionError:
            service = None
        for ss in rs.scope_spans:
            for sp in ss.spans:
                problem = span_problem(sp)
                if problem is None:
                    try:
                        yield sp.name, _span_row(sp, service), None
                        continue
                    except (TypeError, ValueError, KeyError, IndexError, RecursionError) as exc:
                        problem = f"{type(exc).__name__}: {str(exc)[:120]}"
                yield sp.name, None, problem


def _span_row(sp: Span, service) -> dict:
    """One span as its ``spans`` row."""
    return span_row(
        trace_id=sp.trace_id.hex(),
        span_id=sp.span_id.hex(),
        parent_span_id=sp.parent_span_id.hex() or None,
        name=sp.name,
        kind=_KIND.get(sp.kind, "UNSPECIFIED"),
        start_ns=sp.start_time_unix_nano,
        end_ns=sp.end_time_unix_nano,
        status_code=_STATUS.get(sp.status.code, "UNSET"),
        status_message=sp.status.message or None,
        service_name=service,
        attributes=_attrs(sp.attributes),
        events=[
            {"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attrs(e.attributes)}
            for e in sp.events
        ],
    )


def _child(parent: dict, name: str, start_ns: int, end_ns: int, attrs: dict) -> dict:
    # a station span id derived from its parent's, so a re-sent export maps to the same ids
    sid = format((int(parent["span_id"], 16) ^ zlib.crc32(name.encode())) or 1, "016x")
    return span_row(
        **{k: parent[k] for k in ("trace_id", "service_name", "request_id", "model")},
        span_id=sid,
        parent_span_id=parent["span_id"],
        name=name,
        kind="INTERNAL",
        start_ns=start_ns,
        end_ns=end_ns,
        status_code="UNSET",
        attributes={"tokenmill.mapped_from": parent["name"], **attrs},
        input_tokens=None,
        output_tokens=None,
    )


def station_rows(span: dict) -> tuple[list[dict], dict | None]:
    """A known engine span → its station child spans and a ``requests`` row; for any other
    span ``([], None)``. SGLang's stage spans (``prefill_waiting``, ``prefill_forward``,
    ``decode_loop``) each become the station of the same interval.

    vLLM's ``llm_request`` span starts at the request's arrival and ends when it finished; its
    latency attributes (seconds) lay the stations end to end: ``schedule`` (time in queue),
    ``prefill`` (scheduled → first token), ``decode`` (first → last token).
    """
    station = SGLANG_STATIONS.get(span["name"])
    if station is not None:  # one stage span, one station: the same interval
        return [_child(span, station, span["start_ns"], span["end_ns"], {})], None
    if span["name"] != VLLM_REQUEST_SPAN:
        return [], None
    a = json.loads(span["attributes"])

    def sec(key):
        v = a.get(VLLM_LATENCY[key])
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok and v >= 0 else None  # NaN, ±Inf and a negative are no time

    start = span["start_ns"]
    queue, prefill, decode = sec("queue_s"), sec("prefill_s"), sec("decode_s")
    ttft, e2e = sec("ttft_s"), sec("e2e_s")
    children = []
    t = start
    for name, s, attrs in (
        ("schedule", queue, {}),
        ("prefill", prefill, {"gen_ai.usage.input_tokens": span["input_tokens"]}),
        ("decode", decode, {"gen_ai.usage.output_tokens": span["output_tokens"]}),
    ):
        if s is None:
            continue
        end = min(t + int(s * 1e9), span["end_ns"])
        children.append(_child(span, name, t, end, {k: v for k, v in attrs.items() if v}))
        t = end
    out_tokens = span["output_tokens"]
    stamps = vllm_stamps(start, queue, prefill, ttft, decode)
    e2e_end = start + round(e2e * 1e9) if e2e is not None else span["end_ns"]
    row = {
        "request_id": span["request_id"] or span["span_id"],
        "trace_id": span["trace_id"],
        "model": span["model"],
        "arrival_ns": start,
        "end_ns": span["end_ns"],
        "input_tokens": span["input_tokens"],
        "output_tokens": out_tokens,
        "finish_reason": span["finish_reason"],
        "error_type": span["error_type"],
        "first_token_ns": stamps["first_token"],
        "queued_ns": stamps["queued"],
        "scheduled_ns": stamps["scheduled"],
        **request_latencies(arrival=start, end=e2e_end, output_tokens=out_tokens or 0, **stamps),
    }
    if stamps["first_token"] is None and decode is not None:
        # a decode time with no usable TTFT to place it after: its window laid from arrival
        alone = request_latencies(
            arrival=start,
            end=e2e_end,
            output_tokens=out_tokens or 0,
            first_token=start,
            last_token=start + round(decode * 1e9),
        )
        row.update(decode_ms=alone["decode_ms"], tpot_ms=alone["tpot_ms"])
    try:
        request = RequestRow(**{k: v for k, v in row.items() if v is not None})
    except (TypeError, msgspec.ValidationError) as exc:
        raise OTLPDecodeError(f"span {span['name']!r}: {exc}") from None
    return children, msgspec.structs.asdict(request)


def vllm_stamps(start: int, queue, prefill, ttft, decode) -> dict:
    """The stamps (ns) behind vLLM's request latencies (seconds, None where absent), so that
    ``latency.request_latencies`` gives them back: the first token ``ttft`` after arrival,
    scheduled ``prefill`` before it (or ``queue`` after arrival when vLLM gave no prefill
    time), queued ``queue`` before that, the last token ``decode`` after the first."""

    def ns(seconds) -> int:
        return round(seconds * 1e9)

    first = start + ns(ttft) if ttft is not None else None
    if first is not None and prefill is not None:
        scheduled = first - ns(prefill)
    else:
        scheduled = start + ns(queue) if queue is not None else None
    queued = scheduled - ns(queue) if scheduled is not None and queue is not None else None
    last = first + ns(decode) if first is not None and decode is not None else None
    return {"first_token": first, "last_token": last, "queued": queued, "scheduled": scheduled}


@dataclass
class Received:
    """What one export adds to the store, and what of it could not be stored."""

    rows: dict[str, list[dict]]
    """``{"spans": [...], "requests": [...]}``"""
    spans: int = 0
    """spans in the export"""
    rejected: list[str] = field(default_factory=list)
    """one line per span left out: its name and why"""


def received_rows(
    req: ExportTraceServiceRequest,
    check: Callable[[str, list[dict]], list[str | None]] | None = None,
) -> Received:
    """Everything one export adds to the store, span by span: a span that cannot be stored
    (ids of the wrong length, an end before its start, a mapping that fails, or a value
    ``check(table, rows)`` refuses: the store's ``TraceStore.check_rows``) is left out with
    the rows it maps to, and named in :attr:`Received.rejected`; the others are kept."""
    groups: list[dict[str, list[dict]]] = []
    out = Received(rows={"spans": [], "requests": []})
    for name, span, problem in _spans(req):
        out.spans += 1
        group: dict[str, list[dict]] = {}
        if span is not None:
            try:
                children, request = station_rows(span)
                group = {"spans": [span, *children], "requests": [request] if request else []}
            except (OTLPDecodeError, ValueError, TypeError, OverflowError) as exc:
                problem = str(exc) if isinstance(exc, OTLPDecodeError) else f"{exc}"
        if problem is not None:
            out.rejected.append(f"span {name!r}: {problem}")
        else:
            groups.append(group)
    if check is not None and groups:
        bad = set()
        for table in ("spans", "requests"):
            owners = [i for i, g in enumerate(groups) for _ in g[table]]
            rows = [row for g in groups for row in g[table]]
            for i, why in zip(owners, check(table, rows), strict=True):
                if why is not None and i not in bad:
                    bad.add(i)
                    name = groups[i]["spans"][0]["name"]
                    out.rejected.append(f"span {name!r}: {why}")
        groups = [g for i, g in enumerate(groups) if i not in bad]
    for g in groups:
        for table, rows in g.items():
            out.rows[table] += rows
    return out
