"""The FastAPI application: middleware, error handlers, and the route families (the OpenAI
routes, health and metrics, admin) over the gateway, tokenize, admission, (engine), stream and
metering stations."""

from __future__ import annotations

import logging
import math
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .admin import register_admin_routes
from .errors import APIError
from .health_routes import register_health_routes
from .openai_routes import (
    _ClosingStreamingResponse as _ClosingStreamingResponse,  # importable from here, as before
)
from .openai_routes import (
    register_completion_routes,
    register_model_routes,
    register_openapi_route,
)
from .server_state import WAITING_SAMPLE_S as WAITING_SAMPLE_S  # importable from here, as before
from .server_state import ServerState
from .timeline import RequestTimeline
from .traceparent import parse_traceparent

log = logging.getLogger(__name__)
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
UNION_TAG_RE = re.compile(
    r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|constrained-\w+|function-\w+\[.*\]"
    r"|json-or-python\[.*\]|lax-or-strict\[.*\]|nullable\[.*\]|union\[.*\]|tagged-union\[.*\])$"
)


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
        tl = RequestTimeline(
            arrival_ns=time.time_ns(),
            method=scope.get("method", ""),
            path=scope["path"],
            traceparent=parse_traceparent(headers.get(b"traceparent")),
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


class _CountedBody:
    """One request's ASGI channels under :class:`BodyLimitMiddleware`: the body bytes seen; past
    the limit the app is told the client left (``over``: the 413 is the middleware's) and its
    answer is dropped unless it had ``started``."""

    def __init__(self, receive, send, limit: int):
        self._receive = receive
        self._send = send
        self.limit = limit
        self.seen = 0
        self.over = False
        self.started = False

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                self.over = True  # tell the app the client left; we answer 413 ourselves
                return {"type": "http.disconnect"}
        return message

    async def send(self, message):
        if self.over:
            return  # the app's answer to a truncated body is dropped
        self.started = True
        await self._send(message)


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
        body = _CountedBody(receive, send, self.limit)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if not body.over:
                raise
        if body.over and not body.started:
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
    register_error_handlers(app)

    register_model_routes(app, state)
    register_health_routes(app, state)
    register_openapi_route(app, state)
    register_admin_routes(app, state, state.telemetry.dumps)
    register_completion_routes(app, state)
    return app


def register_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's shape with the request id; 404 and 405 in one place;
    an error of a completion request is its timeline's outcome."""

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
