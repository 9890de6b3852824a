"""The collector: another engine's traces and metrics into a tokenmill trace store.

An HTTP app with OTLP/HTTP's trace route (``POST /v1/traces``, protobuf or JSON: point the
engine's ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` at it) and ``GET /health``, plus one
:class:`~.scrape.MetricsScraper` per ``/metrics`` URL. ``tokenmill collect`` runs it; the store
it fills is read by ``diagnose``, ``explain`` and the console like any other.

A body that does not decode is a 400 naming the reason and stores nothing; a body larger than
:data:`MAX_BODY_BYTES`, on the wire or once inflated, is a 413, refused while it is read or
inflated (a chunked body or a gzip bomb is never held whole). A span that cannot be stored (ids
of the wrong length, a string token count, a time past 2^63) is left out and the rest of its
export stored; OTLP's ``partial_success`` says how many were rejected and why (an export whose
every span is rejected is a 400), as it does for rows the store could not queue: never silently
lost.
"""

from __future__ import annotations

import zlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)
from starlette.concurrency import run_in_threadpool

from .otlp_receiver import OTLPDecodeError, decode_export, received_rows
from .scrape import MetricsScraper
from .store import TraceStore

MAX_BODY_BYTES = 32 * 1024 * 1024


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": "body"}},
        status_code=status,
    )


class BodyTooLarge(ValueError):
    """A body past :data:`MAX_BODY_BYTES` (the 413's one line)."""


async def read_capped(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused (:class:`BodyTooLarge`) as soon as it passes ``limit``:
    a declared ``Content-Length`` before reading, a chunked body while it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"body of {int(declared)} bytes; at most {limit}")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body of more than {limit} bytes; at most {limit}")
        parts.append(chunk)
    return b"".join(parts)


def inflate(body: bytes, encoding: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """``body`` decoded per its ``Content-Encoding`` (gzip, deflate or none), refused
    (:class:`BodyTooLarge`) as soon as the output passes ``limit``: a bomb is never inflated
    whole. Raises OTLPDecodeError for an unknown encoding or a body that does not inflate."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc == "gzip":
        return _inflate(body, 16 + zlib.MAX_WBITS, limit, enc)
    if enc == "deflate":  # zlib-wrapped as HTTP says, or raw as some clients send it
        try:
            return _inflate(body, zlib.MAX_WBITS, limit, enc)
        except OTLPDecodeError:
            return _inflate(body, -zlib.MAX_WBITS, limit, enc)
    raise OTLPDecodeError(f"content-encoding {encoding!r}: send gzip, deflate or none")


def _inflate(body: bytes, wbits: int, limit: int, enc: str) -> bytes:
    out, size, data = [], 0, body
    try:
        while data:  # a gzip body may hold several members, one after another
            d = zlib.decompressobj(wbits)
            while True:
                chunk = d.decompress(data, limit + 1 - size)
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"body inflates past {limit} bytes; at most {limit}")
                out.append(chunk)
                data = d.unconsumed_tail
                if d.eof or not (chunk or data):
                    break
            if not d.eof and wbits > 0:
                raise OTLPDecodeError(f"{enc} body is cut short")
            data = d.unused_data if wbits > zlib.MAX_WBITS else b""
    except zlib.error as exc:
        raise OTLPDecodeError(f"not a {enc} body ({exc})") from None
    return b"".join(out)


def _receive(body: bytes, content_type: str, store: TraceStore):
    return received_rows(decode_export(body, content_type), store.check_rows)


def make_app(store: TraceStore, scrapers: list[MetricsScraper] | None = None) -> FastAPI:
    """The collector's HTTP app over ``store`` (the scrapers only show in ``/health``)."""
    app = FastAPI(title="tokenmill collector", docs_url=None, redoc_url=None)
    scrapers = scrapers or []
    add_receiver(app, store)

    @app.get("/health")
    async def health():
        problems = [s.status for s in scrapers if s.status["problem"]]
        return {
            "status": "ok" if store.writer_alive and not problems else "degraded",
            "store": store.health(),
            "scrapers": [s.status for s in scrapers],
        }

    return app


def add_receiver(
    app: FastAPI, store: TraceStore, *, request_rows: bool = True, authenticate=None
) -> None:
    """Add OTLP/HTTP's ``POST /v1/traces`` into ``store`` to ``app`` (the collector's; the
    proxy's or the server's with ``--otlp-receiver``: spans of other services in their own
    store). ``request_rows=False``: keep the spans only (the proxy and the server write each
    request's row themselves, so an engine's request span must not add a second one).
    ``authenticate(request)`` answers a caller it refuses (401/403), None for one it lets in."""

    @app.post("/v1/traces")
    async def traces(request: Request):
        refusal = authenticate(request) if authenticate is not None else None
        if refusal is not None:
            return refusal
        try:
            body = await read_capped(request)
            body = await run_in_threadpool(inflate, body, request.headers.get("content-encoding"))
        except BodyTooLarge as exc:
            return _error(413, str(exc))
        except OTLPDecodeError as exc:
            return _error(400, str(exc))
        content_type = request.headers.get("content-type", "")
        try:  # off the event loop: the server's and the proxy's loop also serve requests
            received = await run_in_threadpool(_receive, body, content_type, store)
        except OTLPDecodeError as exc:
            return _error(400, str(exc))
        del body
        if received.spans and len(received.rejected) == received.spans:
            store.drop("spans", "bad_value", received.spans)
            return _error(400, f"no span could be stored: {received.rejected[0]}")
        rows = received.rows
        if not request_rows:
            rows.pop("requests", None)
        rejected = len(received.rejected)
        store.drop("spans", "bad_value", rejected)
        reasons = [f"{rejected} span(s) rejected: {received.rejected[0]}"] if rejected else []
        unqueued = 0
        for table, table_rows in rows.items():
            for row in table_rows:
                if not store.submit(table, row) and table == "spans":
                    unqueued += 1
        if unqueued:
            reasons.append(f"{unqueued} span(s) not queued: the trace store's queue is full")
        reply = ExportTraceServiceResponse()
        if rejected + unqueued:
            reply.partial_success.rejected_spans = rejected + unqueued
            reply.partial_success.error_message = "; ".join(reasons)
        if content_type.split(";")[0].strip().lower() == "application/json":
            doc = {}
            if rejected + unqueued:
                doc = {
                    "partialSuccess": {
                        "rejectedSpans": str(rejected + unqueued),
                        "errorMessage": reply.partial_success.error_message,
                    }
                }
            return JSONResponse(doc)
        return Response(reply.SerializeToString(), media_type="application/x-protobuf")
