"""The FastAPI application: routes, middleware, and the path of one request through the
gateway, tokenize, admission, (engine), stream and metering stations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import EngineDeadError, StreamStopped
from ..errors import RequestRejected
from ..messages import IDLE_KV_LEAK_SHARE, RequestOutput
from .admin import register_admin_routes
from .errors import APIError
from .gateway import Gateway, Tenant
from .handle import EngineHandle
from .protocol import ChatCompletionRequest, CompletionRequest
from .stations import (
    AdmissionStation,
    MeteringStation,
    TokenizeStation,
    billed_usage,
    usage_of,
)
from .timeline import RequestTimeline, block_hashes, head_hashes
from .worker import (
    ENGINE_STALL_DEGRADED_S,
    ENGINE_STALL_UNAVAILABLE_S,
    EngineUnavailable,
)

log = logging.getLogger(__name__)
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
UNION_TAG_RE = re.compile(
    r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|constrained-\w+|function-\w+\[.*\]"
    r"|json-or-python\[.*\]|lax-or-strict\[.*\]|nullable\[.*\]|union\[.*\]|tagged-union\[.*\])$"
)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: How long (s) a request cut before its end (client gone, server shutdown) waits for the
#: engine's final record of it (sent in the step the abort arrives) before it is recorded
#: with the tokens seen so far.
ENGINE_FINAL_WAIT_S = 5.0
#: Engine final records kept for responses not over yet (a bound, never reached in practice).
MAX_EARLY_FINALS = 4096
SHUTDOWN_MESSAGE = "the server is shutting down; this request was stopped"
DRAINING_MESSAGE = "the server is shutting down and takes no new requests; retry on another server"
#: Retry-After (s) of a request refused while the server drains
DRAIN_RETRY_S = 5
# the requests in flight without their first token are sampled this often into the trace store
# (waiting_samples): a queue shows there while it stands, not only once its requests end
WAITING_SAMPLE_S = 1.0


@dataclass
class ServerState:
    """Everything the routes share."""

    worker: EngineHandle  # one engine core, replicas, or prefill/decode pools
    gateway: Gateway
    tokenize: TokenizeStation
    admission: AdmissionStation
    metering: MeteringStation
    model_name: str
    max_body_bytes: int
    block_size: int  # the engine's tokens per KV block (prompt hashes use the same blocks)
    # telemetry (tokenmill.telemetry.Telemetry): on_request(timeline), on_step(record),
    # metrics.render()/set_engine_state(), health(). The API depends only on these calls.
    telemetry: object
    started: float = field(default_factory=time.time)
    trace_content: bool = False
    fault_stream_delay_s: float = (
        0.0  # fault drill (case C03): wait before each chunk but the first
    )
    # /health: an engine silent this long (s) is degraded, and unavailable (503) past the second
    engine_stall_degraded_s: float = ENGINE_STALL_DEGRADED_S
    engine_stall_unavailable_s: float = ENGINE_STALL_UNAVAILABLE_S
    # /metrics renders in a worker thread; False renders on the event loop (the behaviour before,
    # kept only so benchmarks/metrics_scrape.py can measure the difference in one run)
    metrics_off_loop: bool = True
    shutting_down: bool = False
    # SIGTERM's drain: /health/ready answers 503 and new requests 503 + Retry-After while the
    # requests in flight finish (shutdown.DrainingServer)
    draining: bool = False
    access_log: bool = False  # --access-log: one tokenmill.access line per completion request
    open_requests: int = 0  # completion requests whose response is not over yet
    # engine ids of requests whose stream was left (client gone, shutdown) before the engine's
    # final record of them: finish() waits for that record (see on_engine_final)
    unsettled: set[str] = field(default_factory=set)
    _early_finals: dict[str, RequestOutput] = field(default_factory=dict)
    _awaiting: dict[str, tuple] = field(default_factory=dict)
    # the timelines of the completion requests whose response is not over yet
    live: dict[int, RequestTimeline] = field(default_factory=dict)

    def waiting_rows(self, now_ns: int) -> list[dict]:
        """``waiting_samples`` rows (``telemetry/rows.py``: ``WaitingSampleRow``): every live
        request past tokenize without its first token yet, and how long it has waited."""
        return [
            {
                "time_ns": now_ns,
                "request_id": tl.request_id,
                "arrival_ns": tl.arrival_ns,
                "wait_ms": (now_ns - tl.arrival_ns) / 1e6,
                "prompt_tokens": tl.stats.input_tokens,
                "scheduled": tl.stats.scheduled_ns is not None,
                "tenant": tl.tenant,
                "replica": tl.replica,
            }
            for tl in list(self.live.values())
            if tl.request_id is not None
            and tl.tokenize_end_ns is not None
            and tl.stats.first_token_ns is None
            and tl.error_type is None
        ]

    async def sample_waiting(self, interval_s: float = WAITING_SAMPLE_S) -> None:
        """Hand telemetry a ``waiting_samples`` sample every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                rows = self.waiting_rows(time.time_ns())
                if rows:
                    self.telemetry.on_waiting(rows)
            except Exception:  # telemetry must never stop serving
                log.exception("waiting sample failed")

    def finish(self, tl: RequestTimeline) -> None:
        """The response is over: meter the request and hand its timeline to telemetry.

        A request cut before the engine's final record of it (the client left, the server is
        shutting down) is recorded when that record arrives (:meth:`on_engine_final`: the tokens
        made up to the step the abort arrived in), or after :data:`ENGINE_FINAL_WAIT_S` seconds
        with the tokens seen so far. Must run in the event loop."""
        rid = tl.request_id
        final = self._early_finals.pop(rid, None) if rid else None
        if final is not None:
            tl.observe(final)
        elif rid in self.unsettled:
            loop = asyncio.get_running_loop()
            self._awaiting[rid] = (tl, loop.call_later(ENGINE_FINAL_WAIT_S, self._settle, rid))
            return
        self._record(tl)

    def on_engine_final(self, out: RequestOutput) -> None:
        """Abandoned-output listener (the engine worker's): the engine's final record of a
        request whose stream was left early; its timeline is recorded with it."""
        rid = out.request_id
        if rid not in self.unsettled:
            return
        if rid in self._awaiting:
            self._settle(rid, out)
            return
        self.unsettled.discard(rid)  # the response is not over yet: finish() takes it
        self._early_finals[rid] = out
        while len(self._early_finals) > MAX_EARLY_FINALS:
            self._early_finals.pop(next(iter(self._early_finals)))

    def _settle(self, rid: str, out: RequestOutput | None = None) -> None:
        self.unsettled.discard(rid)
        entry = self._awaiting.pop(rid, None)
        if entry is None:
            return
        tl, timer = entry
        timer.cancel()
        if out is not None:
            tl.observe(out)
        self._record(tl)

    @property
    def unrecorded(self) -> int:
        """Completion requests not recorded yet: responses still open, and finished ones
        waiting for the engine's final record of their request."""
        return self.open_requests + len(self._awaiting)

    def record_awaiting(self) -> None:
        """Record every request still waiting for its engine record, with what it has (the
        engine is stopping)."""
        for rid in list(self._awaiting):
            self._settle(rid)

    def begin_shutdown(self, reason: str = SHUTDOWN_MESSAGE) -> int | None:
        """Stop serving: new requests get 503, every open stream ends now with a
        ``server_shutdown`` error (its request aborted in the engine and recorded with error
        type ``server_shutdown``). Returns the number of requests stopped, or None when the
        shutdown had already begun."""
        if self.shutting_down:
            return None
        self.shutting_down = True
        return self.worker.stop_streams(reason)

    def _record(self, tl: RequestTimeline) -> None:
        """Metering, then the finished timeline to telemetry (which must never fail us).

        Every request the engine queued gets one usage (its metering record), also when it was
        cut (:func:`billed_usage`); one that never reached the engine gets none."""
        tl.metering_start_ns = time.time_ns()
        if tl.usage is None and tl.stats.queued_ns is not None:
            tl.usage = billed_usage(
                tl.stats.input_tokens or 0,
                tl.stats.output_tokens if tl.stats.first_token_ns is not None else 0,
                tl.stats.cached_tokens,
                prefill_started=tl.stats.scheduled_ns is not None,
            )
        if tl.usage is not None and tl.tenant is not None:
            u = tl.usage
            self.metering.record(
                tl.tenant,
                u["prompt_tokens"],
                u["completion_tokens"],
                u["prompt_tokens_details"]["cached_tokens"],
            )
        tl.metering_end_ns = time.time_ns()
        if tl.usage is None:
            tl.metering_start_ns = tl.metering_end_ns = None  # nothing was metered
        try:
            self.telemetry.on_request(tl)
        except Exception:
            log.exception("telemetry failed on request %s", tl.request_id)
        if self.access_log:
            _log_access(tl)


access = logging.getLogger("tokenmill.access")


def _log_access(tl: RequestTimeline) -> None:
    """One access-log line: method, path, status, duration, ids and tenant (``engine/logs.py``
    puts the ids in a JSON line's own keys)."""
    end = tl.last_byte_ns or tl.metering_end_ns or time.time_ns()
    ms = (end - tl.arrival_ns) / 1e6
    rid = tl.request_id or tl.client_request_id
    access.info(
        "%s %s %s %.0f ms request_id=%s tenant=%s",
        tl.method, tl.path, tl.http_status, ms, rid, tl.tenant,
        extra={"request_id": rid, "trace_id": tl.trace_id, "tenant": tl.tenant,
               "method": tl.method, "path": tl.path, "status": tl.http_status,
               "duration_ms": round(ms, 1)},
    )  # fmt: skip


TRACED_PATHS = ("/v1/chat/completions", "/v1/completions")


class TimelineMiddleware:
    """Outermost layer: opens a :class:`RequestTimeline` at arrival for the completion routes,
    records the status and the first/last body byte sent, and finishes the request (metering,
    telemetry) once the response is over."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in TRACED_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        tp = headers.get(b"traceparent", b"").decode("latin-1")
        tl = RequestTimeline(
            arrival_ns=time.time_ns(),
            method=scope.get("method", ""),
            path=scope["path"],
            traceparent=tp if TRACEPARENT_RE.match(tp) else None,
            endpoint="chat" if scope["path"].endswith("chat/completions") else "completions",
            model=self.state.model_name,
            record_content=self.state.trace_content,
        )
        scope.setdefault("state", {})["tm_timeline"] = tl

        async def timed_send(message):
            if message["type"] == "http.response.start":
                tl.http_status = message["status"]
            elif message["type"] == "http.response.body":
                now = time.time_ns()
                if tl.first_byte_ns is None and message.get("body"):
                    tl.first_byte_ns = now
                if not message.get("more_body", False):
                    tl.last_byte_ns = now
            await send(message)

        self.state.open_requests += 1
        self.state.live[id(tl)] = tl
        try:
            await self.app(scope, receive, timed_send)
        except BaseException:
            tl.http_status = tl.http_status or 500
            tl.fail("internal_error")
            raise
        finally:
            self.state.open_requests -= 1
            self.state.live.pop(id(tl), None)
            if tl.http_status and tl.http_status >= 400 and tl.error_type is None:
                tl.fail(f"http_{tl.http_status}")
            self.state.finish(tl)


def memory_fields(model_info: dict) -> dict:
    """``/health``'s memory fields from ``EngineReady.model_info``: ``weight_bytes_total``,
    ``weight_bytes_by_dtype`` (bytes by storage dtype, int4 as ``int4``) and
    ``kv_cache_bytes`` (the KV pool); None while no engine has reported them."""
    return {
        "weight_bytes_total": model_info.get("weight_bytes_total"),
        "weight_bytes_by_dtype": model_info.get("weight_bytes_by_dtype"),
        "kv_cache_bytes": model_info.get("kv_cache_bytes"),
    }


def _timeline(request: Request) -> RequestTimeline:
    tl = getattr(request.state, "tm_timeline", None)
    if tl is None:  # a route reached without the middleware (tests building the app by hand)
        tl = RequestTimeline(
            arrival_ns=time.time_ns(), method=request.method, path=request.url.path
        )
        request.state.tm_timeline = tl
    return tl


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes with 413 (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = APIError(
            413, f"request body is over the {self.limit}-byte limit", code="body_too_large"
        )
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big.response()(scope, receive, send)
        seen = 0
        over = False
        started = False

        async def limited_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True  # tell the app the client left; we answer 413 ourselves
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if over:
                return  # the app's answer to a truncated body is dropped
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not started:
            await too_big.response()(scope, receive, send)


#: request headers a client may send: their count and their total size (names, values and
#: the ": " and CRLF around them), as HTTP front ends bound them (nginx's default buffers hold
#: 32 KiB of headers); over either the answer is 431, before any body is read
MAX_HEADER_COUNT = 100
MAX_HEADER_BYTES = 32 * 1024


class HeaderLimitMiddleware:
    """Refuses requests with more than :data:`MAX_HEADER_COUNT` headers or more than
    :data:`MAX_HEADER_BYTES` of them with 431 ``headers_too_large``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            size = sum(len(k) + len(v) + 4 for k, v in headers)
            if len(headers) > MAX_HEADER_COUNT or size > MAX_HEADER_BYTES:
                err = APIError(
                    431,
                    f"request headers over the limit: {len(headers)} headers of {size} bytes "
                    f"(at most {MAX_HEADER_COUNT} headers, {MAX_HEADER_BYTES} bytes)",
                    code="headers_too_large",
                )
                return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Gives every response an ``x-request-id``: the client's own (when it is 1-64 characters of
    ``[A-Za-z0-9._:-]``) or a new ``req-<hex>``, kept in ``request.state.request_id`` (and the
    timeline) for the error handlers. It sits outside the body limit, so a 413 carries it too.

    Pure ASGI on purpose: an ``@app.middleware("http")`` layer (``BaseHTTPMiddleware``) hides the
    client's disconnect from the route, and a non-streamed request would run on after its
    client left."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        incoming = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = incoming if REQUEST_ID_RE.match(incoming) else f"req-{uuid.uuid4().hex}"
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        tp = headers.get(b"traceparent", b"").decode("latin-1")
        state["traceparent"] = tp if TRACEPARENT_RE.match(tp) else None
        tl = state.get("tm_timeline")
        if tl is not None:
            tl.client_request_id = rid
        header = (b"x-request-id", rid.encode("latin-1"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers") or [] if h[0].lower() != header[0]]
                message = {**message, "headers": [*kept, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _ClosingStreamingResponse(StreamingResponse):
    """A :class:`StreamingResponse` that closes its body iterator however the response ends.
    Starlette leaves an iterator cut off while a chunk was being sent to the garbage collector,
    so the stream's own cleanup (abort, the disconnect record) would run after the request was
    recorded."""

    def __init__(self, content, *, on_close=None, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                # closing a generator that never started skips its finally (Python's rule):
                # a client gone before the first chunk leaves the cleanup to on_close
                if self.on_close is not None:
                    await self.on_close()


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    # drop pydantic's union-branch labels so the param is the field path
    path = [p for p in loc if not UNION_TAG_RE.match(p)]
    param = ".".join(path) or None
    msg = err.get("msg", "invalid value")
    if param is None:  # the body itself: not an object, empty, or sent as another type
        return APIError(
            400,
            "the request body must be a JSON object (Content-Type: application/json)",
            code="invalid_body",
        )
    if isinstance(err.get("input"), float) and math.isnan(err["input"]):
        return APIError(
            400, f"{param} must be a number, not NaN", param=param, code="invalid_value"
        )
    if err.get("type") == "missing":
        return APIError(400, f"missing required field {param!r}", param=param, code="missing_field")
    return APIError(400, f"invalid value for {param!r}: {msg}", param=param, code="invalid_value")


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app over a started :class:`~.handle.EngineHandle`."""
    # /openapi.json is our own route below: on a keyed server it needs a key like /v1/*
    app = FastAPI(
        title="tokenmill", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.tm = state

    # outermost first: timeline (arrival), request id (every response, 413 and 431 included),
    # header limit, body limit
    app.add_middleware(BodyLimitMiddleware, limit=state.max_body_bytes)
    app.add_middleware(HeaderLimitMiddleware)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(TimelineMiddleware, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        tl = getattr(request.state, "tm_timeline", None)
        if tl is not None:
            tl.fail(exc.code or exc.type, exc.message)
        return exc.response(getattr(request.state, "request_id", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = _validation_error(exc)
        tl = getattr(request.state, "tm_timeline", None)
        if tl is not None:
            tl.fail(err.code or err.type, err.message)
        return err.response(getattr(request.state, "request_id", None))

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in str(exc.detail):
            message = "request body could not be parsed as JSON (malformed, too deeply nested, or not UTF-8)"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response(
            getattr(request.state, "request_id", None)
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        tl = getattr(request.state, "tm_timeline", None)
        if tl is not None:
            tl.fail("internal_error", type(exc).__name__)
        err = APIError(
            500,
            f"internal error ({type(exc).__name__}); the request was not completed",
            code="internal_error",
        )
        return err.response(getattr(request.state, "request_id", None))

    @app.get("/v1/models")
    async def models(request: Request):
        state.gateway.authenticate(request.headers.get("authorization"))
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "tokenmill",
                }
            ],
        }

    @app.get("/health/live")
    async def live():
        """Liveness: the API process answers (its event loop runs). Never restart on
        anything else: an engine restarting or a drain is not a dead process."""
        return {"status": "alive"}

    @app.get("/health/ready")
    async def ready():
        """Readiness, for a load balancer: 200 while new requests can be served; 503
        ``draining`` from SIGTERM on, ``starting``/``restarting``/``down`` while no engine
        core serves, ``stalled`` when every serving core is silent past
        ``--engine-stall-unavailable``."""
        can = state.worker.can_serve
        if state.draining or state.shutting_down:
            status = "draining"
        elif not can:
            status = state.worker.health()["state"]
        else:
            stall = state.worker.stall(
                state.engine_stall_degraded_s, state.engine_stall_unavailable_s
            )
            status = "stalled" if stall is not None and stall[0] == "unavailable" else "ready"
        code = 200 if status == "ready" else 503
        headers = {"Retry-After": str(DRAIN_RETRY_S)} if code == 503 else None
        return JSONResponse({"status": status}, status_code=code, headers=headers)

    @app.get("/health")
    async def health():
        w = state.worker.health()
        stats = w["stats"]
        status = (
            "ok" if state.worker.ready else ("degraded" if w["state"] == "restarting" else "down")
        )
        reasons = []
        http_status = 200 if status != "down" else 503
        stall = state.worker.stall(state.engine_stall_degraded_s, state.engine_stall_unavailable_s)
        # checked while any replica serves: with one replica restarting, a silent other is
        # the difference between degraded and serving nothing
        if status != "down" and stall is not None:
            severity, reason = stall  # a frozen or hung engine process (still alive)
            status = "degraded"
            reasons.append(reason)
            if severity == "unavailable":
                http_status = 503
        used, total = stats.get("kv_blocks_used") or 0, stats.get("kv_blocks_total") or 0
        idle = not stats.get("num_running") and not stats.get("num_waiting")
        if status == "ok" and idle and total and used / total > IDLE_KV_LEAK_SHARE:
            status = "degraded"  # nothing runs, yet KV blocks stay taken: a leak (case C05)
            reasons.append(f"{used} of {total} KV blocks in use with nothing running or waiting")
        body = {
            "status": status,
            "model": state.model_name,
            "engine": w,
            "queue_depth": state.admission.queue_depth + stats.get("num_waiting", 0),
            "in_flight": state.admission.in_flight,
            "kv_usage": stats.get("kv_usage"),
            "kv_blocks_used": stats.get("kv_blocks_used"),
            "kv_blocks_total": stats.get("kv_blocks_total"),
            **memory_fields(state.worker.info.get("model_info") or {}),
            "telemetry": state.telemetry.health(),
            "reasons": reasons,
            "draining": state.draining,
        }
        body["telemetry_dropped"] = body["telemetry"]["dropped_total"]
        return JSONResponse(body, status_code=http_status)

    metrics_render = asyncio.Lock()  # one render at a time; a scrape waiting renders its own

    @app.get("/metrics")
    async def metrics(request: Request):
        """The Prometheus exposition, rendered per scrape (current: nothing is cached).

        The gauges read from the worker are set here on the event loop; the text is rendered in
        a worker thread, since with many tenants (1,853 series) it takes 16-48 ms that would
        otherwise stall every stream. prometheus_client is thread-safe for this (each metric's
        children and each value sit behind their own locks); a histogram observed during the
        render may show its new count before its new sum, as with any threaded exporter.
        Renders are serialized so concurrent scrapers never hold several threads at once.
        With ``--metrics-key`` a scrape needs that key (the series name tenants).
        """
        state.gateway.authenticate_metrics(request.headers.get("authorization"))
        w = state.worker.health()
        stats = w["stats"]
        m = state.telemetry.metrics
        for r in w.get("replicas", ()):
            # a replica that is not serving (restarting, down) runs nothing and holds no KV:
            # zeros, not the last values it reported before it went
            up = r.get("state") == "ready"
            rs = r["stats"] if up else {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}
            m.set_replica_state(
                r["replica"],
                running=rs.get("num_running"),
                waiting=rs.get("num_waiting"),
                kv_usage=rs.get("kv_usage"),
                outstanding_tokens=r["outstanding_tokens"],
            )
        m.set_engine_state(
            running=stats.get("num_running", 0),
            waiting=stats.get("num_waiting", 0),
            kv_usage=stats.get("kv_usage") or 0.0,
            restarts=state.worker.restarts,
            in_flight=state.admission.in_flight,
        )
        m.set_heartbeat_age(state.worker.heartbeat_age_s)
        if not state.metrics_off_loop:
            body, content_type = m.render()
        else:
            async with metrics_render:
                body, content_type = await run_in_threadpool(m.render)
        return Response(body, media_type=content_type)

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for name in ("ChatCompletionRequest", "CompletionRequest"):
                props = (
                    schema.get("components", {})
                    .get("schemas", {})
                    .get(name, {})
                    .get("properties", {})
                )
                if "model" in props:
                    props["model"]["enum"] = [state.model_name]  # the one model this server serves
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request):
        state.gateway.authenticate(request.headers.get("authorization"))
        return JSONResponse(openapi())

    register_admin_routes(app, state, state.telemetry.dumps)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _complete(state, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(state, body, request, chat=False)

    return app


async def _complete(state: ServerState, body, request: Request, chat: bool):
    tl = _timeline(request)
    tl.stream = bool(body.stream)
    tl.temperature = body.temperature
    tl.top_p = body.top_p
    tl.seed = body.seed
    if state.draining or state.shutting_down:
        tl.fail("server_shutdown", DRAINING_MESSAGE)
        raise APIError(503, DRAINING_MESSAGE, code="server_shutdown", retry_after=DRAIN_RETRY_S)
    # gateway
    tenant = state.gateway.authenticate(request.headers.get("authorization"))
    request.state.tenant = tenant.name
    tl.tenant = tenant.name
    if body.model != state.model_name:
        raise APIError(
            404,
            f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    body.check_supported()
    state.gateway.acquire(tenant)
    tl.gateway_end_ns = time.time_ns()
    admitted = False
    released = False

    def release():
        nonlocal released
        if not released:
            released = True
            state.gateway.release(tenant)
            if admitted:
                state.admission.leave()

    # The engine's id is ours alone: a client-chosen x-request-id must never let two requests
    # (or two tenants) share an output stream.
    # OpenAI's prefixes: a chat completion's id starts chatcmpl-, a completion's cmpl-
    engine_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tl.request_id = engine_id
    try:
        # tokenize, then admission
        tok = state.tokenize.run(body, tenant)
        params = body.sampling_params(tok.max_tokens)
        try:
            params.validate()
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        tl.tokenize_end_ns = time.time_ns()
        tl.stats.input_tokens = len(tok.prompt_token_ids)
        tl.prompt_block_hashes = block_hashes(tok.prompt_token_ids, state.block_size)
        tl.prompt_head_hashes = head_hashes(tok.prompt_token_ids, state.block_size)
        tl.max_tokens = tok.max_tokens
        if tl.record_content:
            tl.prompt_text = state.tokenize.tokenizer.decode(tok.prompt_token_ids)
            if chat:
                tl.input_messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tl.queue_depth_seen = state.admission.queue_depth
        tl.in_flight_seen = state.admission.in_flight
        tl.pool = state.worker.name  # the replica's own name once the router picked it
        state.admission.enter()
        admitted = True
        try:
            outputs = state.worker.generate(
                engine_id,
                tok.prompt_token_ids,
                params,
                priority=tenant.priority,
                tenant=tenant.name,
            )
        except EngineUnavailable as exc:
            code = "server_shutdown" if state.shutting_down else "engine_unavailable"
            raise APIError(503, str(exc), code=code, retry_after=exc.retry_after) from None
        except RequestRejected as exc:  # it can never fit (a P/D pool's decode side says so)
            param = tok.max_param if exc.blame == "max_tokens" else tok.prompt_param
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        routed = state.worker.replica_of(engine_id)  # the replica the router picked
        if routed is not None:
            tl.pool, tl.replica = routed.name, routed.replica
        tl.admission_end_ns = time.time_ns()
    except BaseException:
        release()
        raise
    created = int(time.time())
    outputs = _observed(outputs, tl, state.unsettled)
    if body.stream:
        gen = _stream(
            state, outputs, engine_id, chat, created, tenant, tok, body.include_usage, release, tl
        )

        async def close_unstarted():
            """The stream's own cleanup, for a body closed before it began (idempotent: a
            stream that ran has released already)."""
            if released:
                return
            if tl.error_type is None:
                tl.client_disconnected = True
                tl.client_disconnect_ns = time.time_ns()
                tl.error_type = "client_disconnected"
            await outputs.aclose()
            release()

        return _ClosingStreamingResponse(
            gen, on_close=close_unstarted, media_type="text/event-stream", headers=SSE_HEADERS
        )
    try:
        return await _collect_unless_gone(
            state, request, outputs, engine_id, chat, created, tenant, tok, tl
        )
    finally:
        release()


async def _observed(outputs: AsyncIterator[RequestOutput], tl: RequestTimeline, unsettled: set):
    """The engine's outputs, each folded into the timeline on the way through. A stream left
    before the request's final output (client gone, server shutdown) adds its engine id to
    ``unsettled``: the engine's final record of it is still to come (see ServerState.finish)."""
    settled = False
    try:
        async for out in outputs:
            tl.observe(out)
            settled = out.finished
            yield out
    except (EngineDeadError, RequestRejected, ValueError):
        settled = True  # the engine refused the request or died: no final record will come
        raise
    finally:
        if not settled and tl.request_id:
            unsettled.add(tl.request_id)
        await outputs.aclose()


async def _collect_unless_gone(
    state, request: Request, outputs, rid, chat, created, tenant, tok, tl: RequestTimeline
):
    """Collect a non-streamed answer; if the client goes away first, abort the engine request
    at once (the body is read, so the next ASGI message can only be the disconnect)."""
    collect = asyncio.ensure_future(_collect(state, outputs, rid, chat, created, tenant, tok, tl))

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not collect.done():
        # cancel until it is done: a cancel that lands as an output arrives can be lost in
        # the stream's own waits, and the request would run on to its last token
        while not collect.done():
            collect.cancel()
            await asyncio.wait({collect}, timeout=0.5)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            collect.result()
        await outputs.aclose()  # the engine aborts the request in its next step
        tl.client_disconnected = True
        tl.client_disconnect_ns = time.time_ns()
        tl.error_type = tl.error_type or "client_disconnected"
        return Response(status_code=499)  # nobody is listening
    return collect.result()


def _chunk(
    rid: str,
    chat: bool,
    created: int,
    model: str,
    text: str | None,
    finish: str | None,
    role: bool = False,
) -> dict:
    if chat:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def _finish_reason(out: RequestOutput) -> str:
    return out.finish_reason if out.finish_reason in ("stop", "length") else "stop"


def _engine_error(out: RequestOutput) -> APIError | None:
    if out.finish_reason == "error":
        return APIError(
            500,
            f"the engine failed this request: {out.error_message or out.error_type}",
            code=out.error_type,
        )
    return None


async def _stream(
    state,
    outputs: AsyncIterator[RequestOutput],
    rid,
    chat,
    created,
    tenant: Tenant,
    tok,
    include_usage,
    release,
    tl: RequestTimeline,
):
    model = state.model_name
    done = False
    sse = lambda obj: f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"  # noqa: E731
    try:
        first = True
        sent_text = False
        async for out in outputs:
            if first and chat:
                yield sse(_chunk(rid, chat, created, model, "", None, role=True))
            first = False
            err = _engine_error(out)
            if err is not None:
                yield sse(err.body())
                break
            if out.new_text:
                if sent_text and state.fault_stream_delay_s:  # drill: a per-token output cost
                    await asyncio.sleep(state.fault_stream_delay_s)
                sent_text = True
                yield sse(_chunk(rid, chat, created, model, out.new_text, None))
            if out.finished:
                yield sse(
                    _chunk(rid, chat, created, model, None if chat else "", _finish_reason(out))
                )
                usage = tl.usage = usage_of(out)
                if include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
        yield "data: [DONE]\n\n"
        done = True
    except StreamStopped as exc:  # the server is shutting down
        err = APIError(503, str(exc), code="server_shutdown")
        tl.fail("server_shutdown", err.message)
        yield sse(err.body())
        yield "data: [DONE]\n\n"
        done = True
    except (EngineDeadError, RequestRejected, ValueError) as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 400
        err = APIError(status, str(exc), code="engine_died" if status == 503 else None)
        tl.fail(err.code or err.type, err.message)
        yield sse(err.body())
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done and tl.error_type is None:  # the client went away mid-stream
            tl.client_disconnected = True
            tl.client_disconnect_ns = time.time_ns()
            tl.error_type = "client_disconnected"
        await outputs.aclose()  # a client that went away: the engine aborts the request now
        release()


async def _collect(state, outputs, rid, chat, created, tenant: Tenant, tok, tl: RequestTimeline):
    text, last = [], None
    try:
        async for out in outputs:
            text.append(out.new_text)
            last = out
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_died", retry_after=5) from None
    except StreamStopped as exc:
        raise APIError(503, str(exc), code="server_shutdown", retry_after=5) from None
    except RequestRejected as exc:
        raise APIError(
            400, str(exc), param=tok.prompt_param, code="context_length_exceeded"
        ) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param=tok.prompt_param) from None
    except asyncio.CancelledError:
        raise
    err = _engine_error(last)
    if err is not None:
        raise err
    usage = tl.usage = usage_of(last)
    content = "".join(text)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": None,
            "finish_reason": _finish_reason(last),
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": content,
            "logprobs": None,
            "finish_reason": _finish_reason(last),
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": state.model_name,
        "choices": [choice],
        "usage": usage,
    }
