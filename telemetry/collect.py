"""The collector: another engine's traces and metrics into a tokenmill trace store.

An HTTP app with OTLP/HTTP's trace route (``POST /v1/traces``, protobuf or JSON: point the
engine's ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` at it) and ``GET /health``, plus one
:class:`~.scrape.MetricsScraper` per ``/metrics`` URL. ``tokenmill collect`` runs it; the store
it fills is read by ``diagnose``, ``explain`` and the console like any other.

A body that does not decode is a 400 naming the reason and stores nothing; a body larger than
:data:`MAX_BODY_BYTES` is a 413. Rows the store could not queue are reported back as OTLP's
``partial_success`` (rejected spans), never silently lost.
"""

from __future__ import annotations

import gzip
import zlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)

from .otlp_receiver import OTLPDecodeError, decode_export, received_rows
from .scrape import MetricsScraper
from .store import TraceStore

MAX_BODY_BYTES = 32 * 1024 * 1024


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": "body"}},
        status_code=status,
    )


def _inflate(body: bytes, encoding: str) -> bytes:
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc == "gzip":
        return gzip.decompress(body)
    if enc == "deflate":
        return zlib.decompress(body)
    raise OTLPDecodeError(f"content-encoding {encoding!r}: send gzip, deflate or none")


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
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"body of {len(body)} bytes; at most {MAX_BODY_BYTES}")
        content_type = request.headers.get("content-type", "")
        try:
            body = _inflate(body, request.headers.get("content-encoding", ""))
            export = decode_export(body, content_type)
            rows = received_rows(export)
            if not request_rows:
                rows.pop("requests", None)
        except (OTLPDecodeError, OSError, EOFError, zlib.error) as exc:
            return _error(400, str(exc))
        rejected = 0
        for table, table_rows in rows.items():
            for row in table_rows:
                if not store.submit(table, row) and table == "spans":
                    rejected += 1
        reply = ExportTraceServiceResponse()
        if rejected:
            reply.partial_success.rejected_spans = rejected
            reply.partial_success.error_message = "the trace store's queue is full"
        if content_type.split(";")[0].strip().lower() == "application/json":
            body = {}
            if rejected:
                body = {
                    "partialSuccess": {
                        "rejectedSpans": str(rejected),
                        "errorMessage": reply.partial_success.error_message,
                    }
                }
            return JSONResponse(body)
        return Response(reply.SerializeToString(), media_type="application/x-protobuf")
