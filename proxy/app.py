"""The proxy's HTTP app: OpenAI's completion routes forwarded to an upstream server.

For each ``POST /v1/chat/completions`` or ``/v1/completions``: the gateway (the same tenants
and keys as ``tokenmill serve``), a body check (JSON, an object), then the request forwarded
with a ``traceparent`` of this request's trace; the upstream's status, headers that describe the
body, and body bytes go back unchanged (a stream relayed piece by piece as it arrives), while
:class:`~.observe.Exchange` reads the events beside the relay. A client that goes away closes
the upstream request too. What the upstream does wrong is answered in OpenAI's error shape,
naming the upstream: 502 when it cannot be reached, 504 when its first byte takes longer than
``first_byte_timeout_s``; every request, failed or not, leaves its row and trace.

The upstream is asked through aiohttp's client (its HTTP parser is compiled): a request through
httpx's pure-Python stack cost about 1.5 ms more per request here, most of the proxy's share of
TTFT, while an upstream such as llama.cpp's server closes every streamed connection, so each
request pays a connection's setup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.api.errors import APIError
from tokenmill.engine.api.gateway import Gateway
from tokenmill.engine.api.stations import AdmissionStation

from .metrics import ProxyMetrics
from .observe import Exchange, new_trace

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# response headers that describe the body the client gets (framing headers are the server's)
PASS_HEADERS = ("content-type", "x-request-id", "openai-processing-ms")


class ProxyState:
    """What the routes share.

    Args:
        upstream: the upstream server's base URL (``http://host:port``).
        record: called with ``(table, row)`` for every row (``TraceStore.submit``).
        first_byte_timeout_s: longest wait for the upstream's first byte.
        upstream_api_key: sent upstream as the bearer key (else the client's header is).
        max_in_flight: requests forwarded at once; one more is refused with 429 and
            ``Retry-After`` (the admission station), recorded; 0: no limit.
        tokenizer: the upstream model's Hugging Face tokenizer (``--tokenizer``): the tokenize
            station counts each prompt (chat template included) and holds the tenant's prompt
            limit; None: prompt sizes from the upstream's ``usage`` only.
    """

    def __init__(
        self,
        upstream: str,
        record: Callable[[str, dict], bool],
        *,
        gateway: Gateway | None = None,
        first_byte_timeout_s: float = 60.0,
        upstream_api_key: str | None = None,
        max_in_flight: int = 0,
        tokenizer=None,
    ):
        self.upstream = upstream.rstrip("/")
        self.record = record
        self.gateway = gateway or Gateway()
        self.first_byte_timeout_s = first_byte_timeout_s
        self.upstream_api_key = upstream_api_key
        # each read waits first_byte_timeout_s at most (the first byte, and every later one)
        self.timeout = aiohttp.ClientTimeout(sock_connect=10.0, sock_read=first_byte_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0
        self.metrics = ProxyMetrics(self.upstream)
        self.tokenizer = tokenizer
        self.admission = (
            AdmissionStation(max_in_flight, 0, limit_flag="--max-in-flight")
            if max_in_flight > 0
            else None
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream client, made on first use inside the server's event loop; the body is
        passed on as the upstream sent it (no decompression), and no cookies are kept. Its
        connections are not capped (aiohttp's default is 100): a cap there would queue requests
        unseen, where ``--max-in-flight`` is the proxy's one limit, refused and recorded."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=self.timeout,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def save(self, ex: Exchange) -> None:
        ex.end_ns = ex.end_ns or time.time_ns()
        row = ex.request_row()
        self.record("requests", row)
        self.metrics.answered(ex, row)
        for span in ex.span_rows():
            self.record("spans", span)
        self.requests += 1


def count_prompt(tokenizer, doc: dict, endpoint: str) -> tuple[int, str] | None:
    """The prompt's size in the upstream model's tokens and the field it came from, or None
    where the body does not say (an odd message shape, token ids, a template that fails: the
    upstream answers those itself)."""
    from tokenmill.engine.tokenizer import encode_chat

    try:
        if endpoint == "chat":
            msgs = doc.get("messages")
            if not isinstance(msgs, list):
                return None
            messages = []
            for m in msgs:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # content parts: their text
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if not isinstance(content, str):
                    return None
                messages.append({"role": str(m.get("role", "user")), "content": content})
            return len(encode_chat(tokenizer, messages)), "messages"
        prompt = doc.get("prompt")
        if isinstance(prompt, str):
            return len(tokenizer.encode(prompt)), "prompt"
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt), "prompt"
    except Exception:  # the tokenizer's or the template's own errors on odd input
        return None
    return None


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None):
    return APIError(status, message, param=param, code=code)


def build_proxy_app(state: ProxyState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await state.close()

    app = FastAPI(title="tokenmill proxy", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok", "upstream": state.upstream, "requests": state.requests}

    async def forward(request: Request) -> Response:
        arrival = time.time_ns()
        endpoint = ROUTES[request.url.path]
        trace_id, span_id, traceparent = new_trace(request.headers.get("traceparent"))
        ex = Exchange(arrival, endpoint, trace_id, span_id, state.upstream)
        state.metrics.arrived()
        ex.client_request_id = request.headers.get("x-request-id")
        try:
            tenant = state.gateway.authenticate(request.headers.get("authorization"))
        except APIError as exc:
            ex.http_status = exc.status
            ex.fail("unauthorized", exc.message)
            state.save(ex)
            return exc.response()
        ex.tenant = tenant.name
        ex.tenant_limit = tenant.max_prompt_tokens
        admission = state.admission
        if admission is not None:
            try:
                admission.enter()
            except APIError as exc:
                ex.http_status = exc.status
                ex.fail("queue_full", exc.message)
                state.save(ex)
                return exc.response()
        held = [admission is not None]

        def release() -> None:  # once: when the answer (or the stream) is over
            if held[0]:
                held[0] = False
                admission.leave()

        try:
            resp = await _forward(request, ex, traceparent, release)
        except BaseException:
            release()
            raise
        if not isinstance(resp, StreamingResponse):
            release()
        return resp

    async def _forward(request: Request, ex: Exchange, traceparent: str, release) -> Response:
        body = await request.body()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            exc = _error(400, "the body must be a JSON object", param="body")
            ex.http_status = 400
            ex.fail("invalid_request", exc.message)
            state.save(ex)
            return exc.response()
        if state.tokenizer is not None:
            t0 = time.time_ns()
            counted = await asyncio.to_thread(count_prompt, state.tokenizer, doc, ex.endpoint)
            ex.tokenized_ns = (t0, time.time_ns())
            if counted is not None:
                ex.counted_prompt_tokens, param = counted
                limit = ex.tenant_limit
                if limit and counted[0] > limit:
                    exc = _error(400, f"{param} is {counted[0]} tokens; tenant {ex.tenant!r} "
                                 f"allows {limit}", param=param, code="prompt_too_long")  # fmt: skip
                    ex.http_status = 400
                    ex.fail("invalid_request", exc.message)
                    state.save(ex)
                    return exc.response()
        ex.stream = doc.get("stream") is True
        ex.model = doc.get("model") if isinstance(doc.get("model"), str) else None
        mt = doc.get("max_completion_tokens", doc.get("max_tokens"))
        ex.max_tokens = mt if isinstance(mt, int) else None
        # identity: the body goes back byte for byte, so the upstream must not compress it
        # for a client that did not ask
        headers = {
            "content-type": "application/json",
            "traceparent": traceparent,
            "accept-encoding": "identity",
        }
        if state.upstream_api_key:
            headers["authorization"] = f"Bearer {state.upstream_api_key}"
        elif request.headers.get("authorization"):
            headers["authorization"] = request.headers["authorization"]
        if ex.client_request_id:
            headers["x-request-id"] = ex.client_request_id
        url = state.upstream + request.url.path
        ex.forwarded_ns = time.time_ns()
        try:
            resp = await _post(state.session, url, body, headers)
        except TimeoutError:
            return _failed(
                state,
                ex,
                504,
                f"upstream {state.upstream} sent no first byte in {state.first_byte_timeout_s:g} s",
                "upstream_timeout",
            )
        except aiohttp.ClientError as exc:
            return _failed(
                state,
                ex,
                502,
                f"upstream {state.upstream} could not be reached: {type(exc).__name__}",
                "upstream_unreachable",
            )
        ex.http_status = resp.status
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS}
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if resp.status >= 400:
            ex.fail("upstream_error", f"upstream answered HTTP {resp.status}")
        if not is_sse:
            try:
                data = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                resp.close()
                return _failed(
                    state,
                    ex,
                    502,
                    f"upstream {state.upstream} broke off its answer: {type(exc).__name__}",
                    "upstream_broken",
                )
            resp.release()
            ex.on_body(data)
            state.save(ex)
            return Response(data, status_code=resp.status, headers=out_headers)

        async def relay():
            finished = False
            try:
                async for piece in resp.content.iter_any():
                    ex.on_bytes(piece)
                    yield piece
                finished = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                ex.fail("upstream_broken", f"the upstream stream broke: {type(exc).__name__}")
            except BaseException:  # the client went away (the response was cancelled)
                ex.fail("client_disconnected", "the client closed the stream")
                raise
            finally:
                if finished:
                    resp.release()  # the connection may serve the next request
                else:  # closed: the upstream's sign that the client cancelled
                    resp.close()
                release()
                state.save(ex)

        return StreamingResponse(relay(), status_code=resp.status, headers=out_headers)

    @app.get("/metrics")
    async def metrics():
        """The proxy's own series (``metrics.py``): no tenant names in them."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The upstream's model list, passed through (clients ask it before anything else)."""
        try:
            state.gateway.authenticate(request.headers.get("authorization"))
        except APIError as exc:
            return exc.response()
        headers = {"accept-encoding": "identity"}
        if state.upstream_api_key:
            headers["authorization"] = f"Bearer {state.upstream_api_key}"
        elif request.headers.get("authorization"):
            headers["authorization"] = request.headers["authorization"]
        try:
            async with state.session.get(state.upstream + "/v1/models", headers=headers) as r:
                content, status = await r.read(), r.status
                out = {k: v for k, v in r.headers.items() if k.lower() in PASS_HEADERS}
        except (aiohttp.ClientError, TimeoutError) as exc:
            message = f"upstream {state.upstream} could not be reached: {type(exc).__name__}"
            return JSONResponse(
                {
                    "error": {
                        "message": message,
                        "type": "upstream_error",
                        "param": None,
                        "code": "upstream_unreachable",
                    }
                },
                status_code=502,
            )
        return Response(content, status_code=status, headers=out)

    for path in ROUTES:
        app.add_api_route(path, forward, methods=["POST"])
    return app


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict):
    """POST, once more on a new connection when the first try's connection was closed under
    it before any answer: an upstream may close a kept-alive connection just as it is reused
    (llama.cpp's server closes each one after a streamed answer; about one request in fifty
    here found it closed too late to be left out of the pool). A closed connection carried no
    answer, so the request is sent again rather than failed."""
    try:
        return await session.post(url, data=body, headers=headers)
    except aiohttp.ClientConnectorError:  # no connection made: nothing to retry
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return await session.post(url, data=body, headers=headers)


def _failed(state: ProxyState, ex: Exchange, status: int, message: str, kind: str):
    ex.http_status = status
    ex.fail(kind, message)
    state.save(ex)
    return JSONResponse(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": kind}},
        status_code=status,
    )
