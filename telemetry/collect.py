"""The collector: another engine's traces and metrics into a tokenmill trace store.

An HTTP app with OTLP/HTTP's trace route (``POST /v1/traces``, protobuf or JSON: point the
engine's ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` at it), ``GET /admin/dump`` (the server's own
route, ``engine/api/admin.py``: ``diagnose --url`` and ``dashboard --source`` attach to a collector
as to a server), ``GET /health`` and ``/health/ready``, plus one :class:`~.scrape.MetricsScraper`
per ``/metrics`` URL. ``tokenmill collect`` runs it; the store it fills is read by ``diagnose``,
``explain`` and the console like any other.

Keys (:class:`CollectorState`'s gateway, :func:`key_check`): with an API or admin key, an
export needs one of them and a dump the admin key. A body that does not decode is a 400 naming
the reason and stores nothing; a content type or encoding it does not read is a 415; a body
larger than ``max_body_bytes`` (default :data:`MAX_BODY_BYTES`), on the wire or once inflated,
is a 413, refused while it is read or inflated (a chunked body or a gzip bomb is never held
whole). A span that cannot be stored (ids of the wrong length, a string token count, a time
past 2^63) is left out whole, with the station spans and the request row it maps to, and the
rest of its export stored; OTLP's ``partial_success`` says how many were rejected and why (an
export whose every span is rejected is a 400), as it does for rows the store could not queue:
never silently lost. While the collector drains (a stop signal), an export gets 503 with
``Retry-After`` (the exporter sends it again) and those in hand finish.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)
from starlette.concurrency import run_in_threadpool

from tokenmill.engine.api.errors import APIError
from tokenmill.engine.api.gateway import Gateway

from .otlp_receiver import OTLPDecodeError, OTLPUnsupportedMedia, decode_export, received_rows
from .scrape import MetricsScraper
from .store import TraceStore

MAX_BODY_BYTES = 32 * 1024 * 1024
#: what a refused export waits before it is sent again (a drain)
DRAIN_RETRY_S = 5


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": "body"}},
        status_code=status,
        headers=headers,
    )


class CollectorState:
    """What the collector's routes share: its keys (``gateway``: an open one without keys),
    the exports in hand (``open_exports``: what a drain waits for) and the drain."""

    def __init__(self, gateway: Gateway | None = None):
        self.gateway = gateway or Gateway()
        self.open_exports = 0
        self.draining = False


def key_check(gateway: Gateway) -> Callable:
    """``add_receiver``'s ``authenticate`` over ``gateway``: the admin key or a client's API
    key; a gateway without keys (open mode: a loopback bind, or ``--allow-unauthenticated``)
    lets everyone in. Returns the refusal (401/403 in OpenAI's shape) or None."""

    def check(request: Request) -> Response | None:
        if gateway.open_mode:
            return None
        auth = request.headers.get("authorization")
        try:
            gateway.authenticate_admin(auth)
            return None
        except APIError:
            pass
        try:
            gateway.authenticate(auth)
            return None
        except APIError as exc:
            return exc.response(getattr(request.state, "request_id", None))

    return check


def admin_check(gateway: Gateway) -> Callable:
    """An ``authenticate(request)`` for admin routes (``GET /v1/findings``) over ``gateway``:
    the admin key only (open mode lets everyone in, as ``/admin/dump``). Returns the refusal
    (401/403 in OpenAI's shape) or None."""

    def check(request: Request) -> Response | None:
        try:
            client = request.client.host if request.client else None
            gateway.authenticate_admin(request.headers.get("authorization"), client)
            return None
        except APIError as exc:
            return exc.response(getattr(request.state, "request_id", None))

    return check


def store_telemetry(store: TraceStore) -> dict:
    """The ``telemetry`` block of a live source's ``/health`` (as the server's: the console's
    live view warns from its store ``problem`` and ``dropped_by_reason``)."""
    return {
        "store": store.health(),
        "dropped_total": store.dropped_total,
        "dropped_by_reason": store.dropped_by_reason(),
    }


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
    raise OTLPUnsupportedMedia(f"content-encoding {encoding!r}: send gzip, deflate or none")


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


def make_app(
    store: TraceStore,
    scrapers: list[MetricsScraper] | None = None,
    state: CollectorState | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    registry=None,
) -> FastAPI:
    """The collector's HTTP app over ``store``: the receiver, ``/admin/dump`` and health, with
    ``state``'s keys and drain (the scrapers only show in ``/health``); with a Prometheus
    ``registry`` (the live diagnosis' series), ``/metrics`` over it."""
    from tokenmill.engine.api.admin import register_admin_routes

    from .hub import LiveDumps

    app = FastAPI(title="tokenmill collector", docs_url=None, redoc_url=None)
    state = state or CollectorState()
    check = key_check(state.gateway)
    add_receiver(app, store, authenticate=check, max_body_bytes=max_body_bytes, state=state)
    register_admin_routes(app, state, LiveDumps(lambda: store))
    _add_health_routes(app, store, scrapers or [], state)
    if registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_health_routes(
    app: FastAPI, store: TraceStore, scrapers: list[MetricsScraper], state: CollectorState
) -> None:
    """``/health`` (the store, the scrapers, the telemetry block) and ``/health/ready``: 503
    while draining, or once the store's writer is gone."""

    @app.get("/health")
    async def health():
        problems = [s.status for s in scrapers if s.status["problem"]]
        ok = store.writer_alive and not problems
        body = {
            "status": "draining" if state.draining else "ok" if ok else "degraded",
            "store": store.health(),
            "scrapers": [s.status for s in scrapers],
            "open_exports": state.open_exports,
            "telemetry": store_telemetry(store),
        }
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/health/ready")
    async def ready():
        status = "draining" if state.draining else "ready" if store.writer_alive else "down"
        headers = {"Retry-After": str(DRAIN_RETRY_S)} if status != "ready" else None
        return JSONResponse(
            {"status": status}, status_code=200 if status == "ready" else 503, headers=headers
        )


def add_receiver(
    app: FastAPI,
    store: TraceStore,
    *,
    request_rows: bool = True,
    authenticate=None,
    max_body_bytes: int = MAX_BODY_BYTES,
    state: CollectorState | None = None,
) -> None:
    """Add OTLP/HTTP's ``POST /v1/traces`` into ``store`` to ``app`` (the collector's; the
    proxy's or the server's with ``--otlp-receiver``: spans of other services in their own
    store). ``request_rows=False``: keep the spans only (the proxy and the server write each
    request's row themselves, so an engine's request span must not add a second one).
    ``authenticate(request)`` answers a caller it refuses (401/403), None for one it lets in.
    ``max_body_bytes``: the largest body, on the wire or inflated (413 past it). ``state``
    (the collector's): exports in hand counted, and refused with 503 while it drains."""

    @app.post("/v1/traces")
    async def traces(request: Request):
        refusal = authenticate(request) if authenticate is not None else None
        if refusal is not None:
            return refusal
        if state is None:
            return await _export(request, store, request_rows, max_body_bytes)
        if state.draining:
            message = "the collector is shutting down; send the export again"
            return _error(503, message, {"Retry-After": str(DRAIN_RETRY_S)})
        state.open_exports += 1
        try:
            return await _export(request, store, request_rows, max_body_bytes)
        finally:
            state.open_exports -= 1


async def _export(request: Request, store: TraceStore, request_rows: bool, limit: int):
    """One export: read (capped), inflated (capped), decoded, stored; OTLP's answer."""
    try:
        body = await read_capped(request, limit)
        encoding = request.headers.get("content-encoding")
        body = await run_in_threadpool(inflate, body, encoding, limit)
        content_type = request.headers.get("content-type", "")
        # off the event loop: the server's and the proxy's loop also serve requests
        received = await run_in_threadpool(_receive, body, content_type, store)
    except BodyTooLarge as exc:
        return _error(413, str(exc))
    except OTLPUnsupportedMedia as exc:
        return _error(415, str(exc))
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
    unqueued = _submit(store, rows)
    if unqueued:
        reasons.append(f"{unqueued} span(s) not queued: the trace store's queue is full")
    return _reply(content_type, rejected + unqueued, "; ".join(reasons))


def _submit(store: TraceStore, rows: dict[str, list[dict]]) -> int:
    """Queue ``rows``; the spans the store's full queue refused."""
    unqueued = 0
    for table, table_rows in rows.items():
        for row in table_rows:
            if not store.submit(table, row) and table == "spans":
                unqueued += 1
    return unqueued


def _reply(content_type: str, rejected: int, message: str) -> Response:
    """OTLP's success answer, in the export's encoding, with its ``partial_success``."""
    if content_type.split(";")[0].strip().lower() == "application/json":
        doc = {}
        if rejected:
            doc = {"partialSuccess": {"rejectedSpans": str(rejected), "errorMessage": message}}
        return JSONResponse(doc)
    reply = ExportTraceServiceResponse()
    if rejected:
        reply.partial_success.rejected_spans = rejected
        reply.partial_success.error_message = message
    return Response(reply.SerializeToString(), media_type="application/x-protobuf")
