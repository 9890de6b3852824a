"""The proxy's HTTP app: OpenAI's completion routes forwarded to an upstream server.

For each ``POST /v1/chat/completions`` or ``/v1/completions``: the body limit (``max_body_bytes``,
the server's own ``BodyLimitMiddleware``: 413 ``body_too_large`` while reading, never the whole
body held), the gateway (the same tenants and keys as ``tokenmill serve``), a body check (JSON,
an object, not nested past the parser's depth: 400 naming ``body``), then the request forwarded
with a ``traceparent`` of this request's trace, once: a request the upstream may have read is
never sent again. The upstream's status, body bytes and its headers (``Retry-After``,
``x-ratelimit-*``, ``Content-Encoding`` ...: all but the per-connection ones) go back unchanged,
a stream piece by piece as it arrives, while :class:`~.observe.Exchange` reads the events beside
the relay; what it cannot read is dropped and counted, never the client's problem. A stream the
upstream cuts (a close, a reset, no byte within ``first_byte_timeout_s``, an end without
``[DONE]``) ends in an error event ``upstream_stream_cut`` the client sees. A client that hangs
up closes the upstream request, streamed or not, and gives back its ``--max-in-flight`` slot.
What the upstream does wrong is answered in OpenAI's error shape, naming the upstream: 502 when
it cannot be reached or closes without an answer, 504 when its first byte takes longer than
``first_byte_timeout_s``; every request, failed or not, leaves its row and trace
(:class:`_Recorder`, outermost, whatever ended it).

Its own routes: ``/health``, ``/health/live``, ``/health/ready`` (whether the upstream answers:
:class:`UpstreamProbe`), ``/metrics``, ``/v1/models`` passed through and, over the store it
records into, the server's ``GET /admin/dump`` (``engine/api/admin.py``), so that ``diagnose
--url`` and the console attach to a proxy as to a server.

The upstream is asked through aiohttp's client (its HTTP parser is compiled): a request through
httpx's pure-Python stack cost about 1.5 ms more per request here, most of the proxy's share of
TTFT, while an upstream such as llama.cpp's server closes every streamed connection, so each
request pays a connection's setup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from tokenmill.engine.api.app import BodyLimitMiddleware
from tokenmill.engine.api.errors import APIError
from tokenmill.engine.api.gateway import Gateway, Tenant
from tokenmill.engine.api.stations import AdmissionStation
from tokenmill.engine.serve_config import ServeConfig

from .metrics import ProxyMetrics
from .observe import Exchange, new_trace

log = logging.getLogger("tokenmill.proxy")
#: how often the requests waiting for their first output are sampled (as the server does)
WAITING_SAMPLE_S = 1.0

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
#: the upstream's response headers that are not relayed: those of one connection (RFC 9110
#: 7.6.1) and those this server writes itself (framing, date, server); every other one goes back
NOT_RELAYED = frozenset(
    {
        "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
        "content-length", "date", "server",
    }
)  # fmt: skip
#: the largest request body forwarded: the server's own default (``serve --max-body-bytes``)
DEFAULT_MAX_BODY_BYTES = ServeConfig().max_body_bytes
#: idle upstream connections are let go sooner than common servers close them (uvicorn's 5 s),
#: so a request rarely meets a connection the upstream is closing (it is not sent again)
KEEPALIVE_S = 4.0
#: what a 503 from ``/health/ready`` asks a balancer to wait
READY_RETRY_S = 5
#: bytes a header value may not hold (uvicorn refuses to send them, which drops the connection
#: with no answer at all): an upstream header holding one is not relayed
_UNSENDABLE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_FLIGHT = "tokenmill.proxy.flight"  # the scope key of a request's :class:`_Flight`


class ProxyState:
    """What the routes share.

    Args:
        upstream: the upstream server's base URL (``http://host:port``).
        record: called with ``(table, row)`` for every row (``TraceStore.submit``).
        first_byte_timeout_s: longest wait for the upstream's first byte, and for each later
            one of a stream.
        upstream_api_key: sent upstream as the bearer key (else the client's header is).
        max_in_flight: requests forwarded at once; one more is refused with 429 and
            ``Retry-After`` (the admission station), recorded; 0: no limit.
        tokenizer: the upstream model's Hugging Face tokenizer (``--tokenizer``): the tokenize
            station counts each prompt (chat template included) and holds the tenant's prompt
            limit; None: prompt sizes from the upstream's ``usage`` only.
        max_body_bytes: the largest request body; past it a 413 while reading.
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
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.upstream = upstream.rstrip("/")
        self.record = record
        self.gateway = gateway or Gateway()
        self.first_byte_timeout_s = first_byte_timeout_s
        self.upstream_api_key = upstream_api_key
        self.max_body_bytes = max_body_bytes
        # each read waits first_byte_timeout_s at most (the first byte, and every later one)
        self.timeout = aiohttp.ClientTimeout(sock_connect=10.0, sock_read=first_byte_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0
        self.open_requests = 0  # completion requests the proxy holds now (a drain waits on them)
        self.draining = False  # a stop signal came: new requests get 503, open ones finish
        # the drain is over (or a second signal came): what is still open ends now
        self.stopping = asyncio.Event()
        self.relays: set[_Relay] = set()  # streams being relayed now
        self.metrics = ProxyMetrics(self.upstream)
        # completion requests between arrival and their row (the waiting samples read them)
        self.in_flight: dict[int, Exchange] = {}
        self.dropped: Counter = Counter()  # what could not be recorded, by reason
        self.tokenizer = tokenizer
        self.admission = (
            AdmissionStation(max_in_flight, 0, limit_flag="--max-in-flight")
            if max_in_flight > 0
            else None
        )

    def stop(self, cause: str = "stop") -> None:
        """The drain is over: every stream still relayed ends with a ``server_shutdown`` error
        event and ``[DONE]`` (its upstream request closed), and a request still waiting for
        the upstream's answer gets 503 ``server_shutdown``; each row says so."""
        self.stopping.set()
        for relay in list(self.relays):
            relay.stop()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream client, made on first use inside the server's event loop; the body is
        passed on as the upstream sent it (no decompression), and no cookies are kept. Its
        connections are not capped (aiohttp's default is 100): a cap there would queue requests
        unseen, where ``--max-in-flight`` is the proxy's one limit, refused and recorded. A
        POST is never retried (aiohttp retries only idempotent methods)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=self.timeout,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def save(self, ex: Exchange) -> None:
        """The request's row, spans and metrics, once. Never raises: what cannot be recorded is
        dropped and counted (:meth:`count_drops`)."""
        if ex.saved:
            return
        ex.saved = True
        self.in_flight.pop(id(ex), None)
        ex.end_ns = ex.end_ns or time.time_ns()
        self.requests += 1
        self.metrics.left()
        try:
            row = ex.request_row()
            spans = ex.span_rows()
            self.metrics.answered(ex, row)
            self.record("requests", row)
            for span in spans:
                self.record("spans", span)
        except Exception as exc:  # the observer never fails the observed
            ex.dropped["record_failed"] += 1
            self.count_drops(ex.dropped, f"{type(exc).__name__}: {exc}")
            return
        self.count_drops(ex.dropped)

    def waiting_rows(self, now_ns: int) -> list[dict]:
        """A ``waiting_samples`` row for each request in flight without its first output
        (as the server samples its queue): an upstream that stops answering shows in the store
        while it stands, not only once its requests end."""
        return [
            {
                "time_ns": now_ns,
                "request_id": f"proxy-{ex.span_id}",
                "arrival_ns": ex.arrival_ns,
                "wait_ms": (now_ns - ex.arrival_ns) / 1e6,
                "prompt_tokens": ex.counted_prompt_tokens,
                "tenant": ex.tenant,
            }
            for ex in list(self.in_flight.values())
            if not ex.token_ns and ex.end_ns is None
        ]

    def stream_rows(self, now_ns: int) -> list[dict]:
        """A ``stream_samples`` row for each stream in flight that has made its first output
        and not ended: the upstream's pace shows while its streams run, not only once they
        end."""
        return [
            {
                "time_ns": now_ns,
                "request_id": ex.response_id or f"proxy-{ex.span_id}",
                "first_token_ns": ex.token_ns[0],
                "last_token_ns": ex.token_ns[-1],
                "output_tokens": len(ex.token_ns),
                "tenant": ex.tenant,
            }
            for ex in list(self.in_flight.values())
            if ex.token_ns and ex.end_ns is None
        ]

    async def sample_waiting(self, interval_s: float = WAITING_SAMPLE_S) -> None:
        """Record the waiting requests and the open streams every ``interval_s`` until
        cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                now = time.time_ns()
                for row in self.waiting_rows(now):
                    self.record("waiting_samples", row)
                for row in self.stream_rows(now):
                    self.record("stream_samples", row)
            except Exception:  # the observer never fails the observed
                log.exception("waiting sample failed")

    def count_drops(self, drops: Counter, detail: str | None = None) -> None:
        """Counts what a request could not record (``tokenmill_proxy_telemetry_dropped_total``,
        ``/health``); each reason is logged once, when first seen."""
        for reason, n in drops.items():
            if n <= 0:
                continue
            if reason not in self.dropped:
                log.warning(
                    "proxy: left out of the trace store: %s%s (counted from now on in "
                    "tokenmill_proxy_telemetry_dropped_total; the answers are relayed unchanged)",
                    reason,
                    f" ({detail})" if detail else "",
                )
            self.dropped[reason] += n
            self.metrics.dropped(reason, n)


class _Flight:
    """One request between the :class:`_Recorder` and the route: its exchange, the
    ``traceparent`` sent upstream, its ``--max-in-flight`` slot and its place in its tenant's
    limits (each given back once)."""

    def __init__(self, ex: Exchange, traceparent: str):
        self.ex = ex
        self.traceparent = traceparent
        self.slot: AdmissionStation | None = None
        self.tenant: Tenant | None = None

    def release(self) -> None:
        if self.slot is not None:
            self.slot, slot = None, self.slot
            slot.leave()
        if self.tenant is not None:
            self.tenant, tenant = None, self.tenant
            Gateway.release(tenant)


class _Recorder:
    """Outermost around the completion routes: each request gets its :class:`Exchange` here
    and leaves its row here, once, whatever ended it (an answer, the end of its stream, a 413
    from the body limit before the route ran, a client that hung up, the proxy's own error);
    its ``--max-in-flight`` slot is given back here too. The body limit (the server's
    ``BodyLimitMiddleware``) guards these routes only."""

    def __init__(self, app, state: ProxyState):
        self.app = app
        self.state = state
        self.limited = BodyLimitMiddleware(app, limit=state.max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in ROUTES or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        state = self.state
        headers = Headers(scope=scope)
        trace_id, span_id, traceparent = new_trace(headers.get("traceparent"))
        ex = Exchange(time.time_ns(), ROUTES[scope["path"]], trace_id, span_id, state.upstream)
        ex.client_request_id = headers.get("x-request-id")
        flight = scope[_FLIGHT] = _Flight(ex, traceparent)
        state.in_flight[id(ex)] = ex
        state.metrics.arrived()
        sent: list[int] = []

        def done() -> None:
            flight.release()
            status = sent[-1] if sent else None
            if status == 413 and ex.http_status is None:
                ex.http_status = 413
                limit = state.max_body_bytes
                ex.fail("body_too_large", f"request body is over the {limit}-byte limit")
            elif ex.http_status is None and ex.error_type != "client_disconnected":
                ex.http_status = status
            state.save(ex)

        async def watched_send(message):
            if message["type"] == "http.response.start":
                await send(message)
                sent.append(message["status"])  # once sent: a start refused is no answer
                return
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                done()  # before the client sees the end: its slot and its row are settled
            await send(message)

        state.open_requests += 1
        try:
            await self.limited(scope, receive, watched_send)
        except Exception as exc:  # the server's error handler answers 500
            if ex.error_type is None:
                # what the client got: the 500, unless the answer had started already
                ex.http_status = sent[-1] if sent else 500
                ex.fail("internal_error", type(exc).__name__)
            raise
        finally:
            state.open_requests -= 1
            done()  # once: a no-op when the answer's end did it


class _Relay(StreamingResponse):
    """The upstream's event stream, relayed piece by piece and read beside. A stream that
    breaks off ends in an error event (``upstream_stream_cut``) and ``[DONE]``; the upstream
    response is closed whenever the relay did not reach its end (the client left)."""

    def __init__(self, resp: aiohttp.ClientResponse, ex: Exchange, state: ProxyState):
        super().__init__(self._pieces(), status_code=resp.status)
        _relay_headers(self, resp)
        self.upstream, self.ex, self.state = resp, ex, state
        self.finished = False
        self.stopped = False  # the proxy is stopping: the stream ends here
        state.relays.add(self)

    def stop(self) -> None:
        self.stopped = True
        self.upstream.close()  # the upstream stops generating; the read below ends

    async def _pieces(self):
        ex, resp = self.ex, self.upstream
        cut = None
        tail = b"\n\n"
        try:
            async for piece in resp.content.iter_any():
                if self.stopped:
                    break
                ex.on_bytes(piece)
                tail = (tail + piece)[-4:]
                yield piece
        except Exception as exc:
            if not self.stopped and isinstance(exc, TimeoutError):
                # aiohttp's read timeouts are TimeoutErrors
                cut = f"sent nothing for {self.state.first_byte_timeout_s:g} s mid-stream"
            elif not self.stopped and isinstance(exc, aiohttp.ClientError):
                cut = f"broke off its stream ({type(exc).__name__})"
            elif not self.stopped:
                raise
        if self.stopped:
            self.finished = True
            self.state.relays.discard(self)
            message = "the proxy is shutting down: the stream was stopped before its end"
            ex.fail("server_shutdown", message)
            if "content-encoding" not in resp.headers:
                end = b"" if tail.endswith((b"\n\n", b"\r\n\r\n")) else b"\n\n"
                err = APIError(503, message, code="server_shutdown").body()
                yield end + b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
            return
        if cut is None and not (
            ex.saw_done or ex.finish_reason or ex.upstream_error or resp.status >= 400
        ):
            cut = "ended its stream without [DONE]"
        rest = _unread(resp.content) if cut is not None else b""
        if rest:  # what came before the cut still goes to the client
            ex.on_bytes(rest)
            tail = (tail + rest)[-4:]
            yield rest
        if cut is None:
            resp.release()  # the connection may serve the next request
        else:
            resp.close()
            message = f"upstream {self.state.upstream} {cut}: the answer is incomplete"
            ex.fail("upstream_stream_cut", message)
            if "content-encoding" not in resp.headers:  # plain text can be added to it
                end = b"" if tail.endswith((b"\n\n", b"\r\n\r\n")) else b"\n\n"
                err = APIError(502, message, code="upstream_stream_cut").body()
                yield end + b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        self.finished = True

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.state.relays.discard(self)
            if not self.finished:
                self.upstream.close()  # the upstream's sign that the client cancelled
                if self.ex.error_type is None:
                    self.ex.fail("client_disconnected", "the client closed the stream")


def _unread(content: aiohttp.StreamReader) -> bytes:
    """The bytes aiohttp had received when a stream broke: its reader raises the error before
    it hands them out, so they are taken from its buffer (a private method: nothing if gone)."""
    read = getattr(content, "_read_nowait", None)
    if read is None or not getattr(content, "_buffer", None):
        return b""
    try:
        return read(-1)
    except Exception:
        return b""


def _relay_headers(response: Response, upstream: aiohttp.ClientResponse) -> None:
    """The upstream's headers onto ``response``, each value's bytes as they came (see
    NOT_RELAYED): taken raw, so a value that is not Latin-1 text once decoded (UTF-8, stray
    bytes) goes back unchanged instead of failing the answer."""
    named = {
        t.strip().lower() for v in upstream.headers.getall("connection", []) for t in v.split(",")
    }
    for key, value in upstream.raw_headers:
        low = key.decode("latin-1").lower()
        if _UNSENDABLE.search(value):  # a control byte: no HTTP server may send it on
            continue
        if low not in NOT_RELAYED and low not in named:
            response.raw_headers.append((low.encode("latin-1"), value))


async def _client_left(receive) -> None:
    """Returns when the client hangs up (its body already read, only that can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(
    request: Request, ex: Exchange, work, stop: asyncio.Event | None = None
) -> Response:
    """``work``'s answer; cancelled when the client hangs up first, which closes the upstream
    request: the upstream stops generating and the slot is free. ``stop`` set first (the proxy
    is stopping): 503 ``server_shutdown``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_left(request.receive))
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    waits = {task, gone} | ({stopping} if stopping is not None else set())
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for f in waits:
            f.cancel()
        raise
    gone.cancel()
    if stopping is not None:
        stopping.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if stopping is not None and stopping in done and gone not in done:
        err = APIError(503, "the proxy is shutting down: the request was stopped before its "
                       "answer", code="server_shutdown", retry_after=5)  # fmt: skip
        ex.http_status = 503
        ex.fail("server_shutdown", err.message)
        return err.response()
    ex.fail("client_disconnected", "the client hung up before the answer; the upstream "
            "request was closed")  # fmt: skip
    return Response(status_code=499)  # nobody reads it


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


def _refuse(ex: Exchange, exc: APIError, error_type: str) -> Response:
    ex.http_status = exc.status
    ex.fail(error_type, exc.message)
    return exc.response()


def _upstream_auth(state: ProxyState, request: Request | None, headers: dict) -> dict:
    """``headers`` with the key sent upstream: ``--upstream-api-key``, else the client's own
    (the proxy's own request, ``request`` None: only the first)."""
    if state.upstream_api_key:
        headers["authorization"] = f"Bearer {state.upstream_api_key}"
    elif request is not None and request.headers.get("authorization"):
        headers["authorization"] = request.headers["authorization"]
    return headers


class _Completions:
    """The completion routes (:data:`ROUTES`): the checks a request passes (:meth:`forward`),
    then its one forward upstream and the answer relayed back (:meth:`send_upstream`)."""

    def __init__(self, state: ProxyState):
        self.state = state

    async def forward(self, request: Request) -> Response:
        flight: _Flight = request.scope[_FLIGHT]
        ex = flight.ex
        refused = self._admit(request, flight)
        if refused is not None:
            return refused
        try:
            body = await request.body()  # within max_body_bytes (the body limit)
        except ClientDisconnect:  # or past it: then the limit answers 413
            ex.fail("client_disconnected", "the client left before its body was read")
            return Response(status_code=499)
        doc = _json_object(ex, body)
        if isinstance(doc, Response):
            return doc
        refused = await self._check_prompt(ex, doc)
        if refused is not None:
            return refused
        _note_request(ex, doc)
        return await _unless_client_leaves(
            request,
            ex,
            self.send_upstream(request, ex, body, flight.traceparent),
            self.state.stopping,
        )

    def _admit(self, request: Request, flight: _Flight) -> Response | None:
        """The refusal of a request the proxy does not take (draining, its key, no free
        ``--max-in-flight`` slot), or None with its tenant noted and its slot taken."""
        state, ex = self.state, flight.ex
        if state.draining:
            err = APIError(503, "the proxy is shutting down; retry", code="server_shutdown",
                           retry_after=5)  # fmt: skip
            return _refuse(ex, err, "server_shutdown")
        try:
            tenant = state.gateway.authenticate(request.headers.get("authorization"))
        except APIError as exc:
            return _refuse(ex, exc, "unauthorized")
        ex.tenant = tenant.name
        ex.tenant_limit = tenant.max_prompt_tokens
        try:  # the tenant's requests per minute and requests in flight, as serve holds them
            state.gateway.acquire(tenant)
        except APIError as exc:
            return _refuse(ex, exc, exc.code or "rate_limited")
        flight.tenant = tenant
        if state.admission is not None:
            try:
                state.admission.enter()
            except APIError as exc:
                return _refuse(ex, exc, "queue_full")
            flight.slot = state.admission
        return None

    async def _check_prompt(self, ex: Exchange, doc: dict) -> Response | None:
        """With ``--tokenizer``: the prompt counted (off the event loop) and held to the
        tenant's limit; the refusal, or None."""
        state = self.state
        if state.tokenizer is None:
            return None
        t0 = time.time_ns()
        counted = await asyncio.to_thread(count_prompt, state.tokenizer, doc, ex.endpoint)
        ex.tokenized_ns = (t0, time.time_ns())
        if counted is not None:
            ex.counted_prompt_tokens, param = counted
            limit = ex.tenant_limit
            if limit and counted[0] > limit:
                exc = _error(400, f"{param} is {counted[0]} tokens; tenant {ex.tenant!r} "
                             f"allows {limit}", param=param, code="prompt_too_long")  # fmt: skip
                return _refuse(ex, exc, "invalid_request")
        return None

    async def send_upstream(self, request: Request, ex: Exchange, body: bytes, traceparent: str):
        state = self.state
        # identity: the body goes back byte for byte, so the upstream should not compress it
        # for a client that did not ask (one that does anyway is relayed with its encoding)
        headers = {
            "content-type": "application/json",
            "traceparent": traceparent,
            "accept-encoding": "identity",
        }
        _upstream_auth(state, request, headers)
        if ex.client_request_id:
            headers["x-request-id"] = ex.client_request_id
        url = state.upstream + request.url.path
        ex.forwarded_ns = time.time_ns()
        up = state.upstream
        try:  # once: a request the upstream may have read is never sent again
            resp = await state.session.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            reason = f"could not be reached: {type(exc).__name__}"
            return _failed(ex, 502, f"upstream {up} {reason}", "upstream_unreachable")
        except TimeoutError:
            message = f"upstream {up} sent no first byte in {state.first_byte_timeout_s:g} s"
            return _failed(ex, 504, message, "upstream_timeout")
        except aiohttp.ClientError as exc:
            message = (f"upstream {up} closed the connection without an answer "
                       f"({type(exc).__name__}); the request was not sent again: the upstream "
                       "may have read it")  # fmt: skip
            return _failed(ex, 502, message, "upstream_broken")
        if not 200 <= resp.status <= 599:  # no final HTTP status: nothing to relay
            resp.close()
            message = f"upstream {up} answered an invalid HTTP status {resp.status}"
            return _failed(ex, 502, message, "upstream_broken")
        try:
            return await self._relay(resp, ex)
        except BaseException:  # cancelled (the client left): close the upstream request
            resp.close()
            raise

    async def _relay(self, resp: aiohttp.ClientResponse, ex: Exchange) -> Response:
        """The upstream's answer going back: a stream as a :class:`_Relay`, else its body
        read whole."""
        ex.http_status = resp.status
        ex.set_encoding(resp.headers.get("content-encoding"))
        if resp.status >= 400:
            ex.fail("upstream_error", f"upstream answered HTTP {resp.status}")
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return _Relay(resp, ex, self.state)
        try:
            data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            resp.close()
            message = f"upstream {self.state.upstream} broke off its answer: {type(exc).__name__}"
            return _failed(ex, 502, message, "upstream_broken")
        resp.release()
        ex.on_body(data)
        out = Response(data, status_code=resp.status)
        _relay_headers(out, resp)
        return out


def _json_object(ex: Exchange, body: bytes) -> dict | Response:
    """The body read as a JSON object, or the 400 naming ``body``."""
    try:
        doc = json.loads(body)
    except RecursionError:
        err = _error(400, "the body is JSON nested too deeply to read", param="body")
        return _refuse(ex, err, "invalid_request")
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        err = _error(400, "the body must be a JSON object", param="body")
        return _refuse(ex, err, "invalid_request")
    return doc


def _note_request(ex: Exchange, doc: dict) -> None:
    """What the row says of the request's body: streamed, model, token cap."""
    ex.stream = doc.get("stream") is True
    ex.model = doc.get("model") if isinstance(doc.get("model"), str) else None
    mt = doc.get("max_completion_tokens", doc.get("max_tokens"))
    ex.max_tokens = mt if isinstance(mt, int) and not isinstance(mt, bool) else None


#: how long ``/health/ready`` keeps the upstream's last answer, and waits for a new one
READY_CACHE_S = 2.0
READY_TIMEOUT_S = 2.0


class UpstreamProbe:
    """Whether the upstream answers, for ``/health/ready``: its ``GET /health`` asked at most
    once per :data:`READY_CACHE_S` (readiness checks from many balancers share one probe).
    Any HTTP answer under 500 is an upstream that answers (an engine without ``/health`` says
    404); a 5xx (an engine still loading), no connection or no answer in
    :data:`READY_TIMEOUT_S` is not."""

    def __init__(self, state: ProxyState):
        self.state = state
        self.checked = -READY_CACHE_S  # monotonic time of the last answer
        self.problem: str | None = None
        self._probe: asyncio.Future | None = None

    async def check(self) -> str | None:
        """Why the upstream is not ready (one line), or None."""
        if time.monotonic() - self.checked < READY_CACHE_S:
            return self.problem
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ask())
        self.problem = await asyncio.shield(self._probe)
        self.checked = time.monotonic()
        return self.problem

    async def _ask(self) -> str | None:
        state = self.state
        headers = _upstream_auth(state, None, {"accept-encoding": "identity"})
        timeout = aiohttp.ClientTimeout(total=READY_TIMEOUT_S)
        try:
            async with state.session.get(
                state.upstream + "/health", headers=headers, timeout=timeout
            ) as r:
                status = r.status
        except TimeoutError:
            return f"upstream {state.upstream} did not answer in {READY_TIMEOUT_S:g} s"
        except aiohttp.ClientError as exc:
            return f"upstream {state.upstream} could not be reached: {type(exc).__name__}"
        if status >= 500:
            return f"upstream {state.upstream} answered /health with HTTP {status}"
        return None


def _add_service_routes(app: FastAPI, state: ProxyState, store=None) -> None:
    """The proxy's own routes: ``/health``, ``/health/live``, ``/health/ready`` and
    ``/metrics``; with ``store``, ``/health`` carries its ``telemetry`` block."""
    probe = UpstreamProbe(state)

    @app.get("/health")
    async def health():
        body = {
            "status": "draining" if state.draining else "ok",
            "upstream": state.upstream,
            "requests": state.requests,
            "open_requests": state.open_requests,
            "telemetry_dropped": dict(state.dropped),
        }
        if store is not None:
            from tokenmill.telemetry.collect import store_telemetry

            body["telemetry"] = store_telemetry(store)
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/health/live")
    async def live():
        """The proxy answers (its event loop runs), whatever the upstream does."""
        return {"status": "alive"}

    @app.get("/health/ready")
    async def ready():
        """For a load balancer: 200 while the upstream answers; 503 with the reason (and
        Retry-After) while draining or while the upstream does not answer."""
        problem = "draining" if state.draining else await probe.check()
        if problem is None:
            return JSONResponse({"status": "ready", "upstream": state.upstream})
        status = "draining" if state.draining else "upstream_unavailable"
        return JSONResponse(
            {"status": status, "reason": problem, "upstream": state.upstream},
            status_code=503,
            headers={"Retry-After": str(READY_RETRY_S)},
        )

    @app.get("/metrics")
    async def metrics():
        """The proxy's own series (``metrics.py``): no tenant names in them."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_models_route(app: FastAPI, state: ProxyState) -> None:
    """``/v1/models``, passed through from the upstream."""

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The upstream's model list, passed through (clients ask it before anything else)."""
        try:
            state.gateway.authenticate(request.headers.get("authorization"))
        except APIError as exc:
            return exc.response()
        headers = _upstream_auth(state, request, {"accept-encoding": "identity"})
        try:
            async with state.session.get(state.upstream + "/v1/models", headers=headers) as r:
                out = Response(await r.read(), status_code=r.status)
                _relay_headers(out, r)
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
        return out


def build_proxy_app(state: ProxyState, store=None) -> FastAPI:
    """The proxy's app over ``state``; with the ``TraceStore`` it records into (``store``),
    also ``GET /admin/dump`` (the server's own route, behind the admin key: ``diagnose --url``
    and ``dashboard --source`` attach to the proxy as to a server) and ``/health``'s telemetry
    block."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        waiting = asyncio.create_task(state.sample_waiting())
        try:
            yield
        finally:
            waiting.cancel()
            await state.close()

    app = FastAPI(title="tokenmill proxy", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(_Recorder, state=state)
    _add_service_routes(app, state, store)
    _add_models_route(app, state)
    if store is not None:
        from tokenmill.engine.api.admin import register_admin_routes
        from tokenmill.telemetry.hub import LiveDumps

        register_admin_routes(app, state, LiveDumps(lambda: store))
    completions = _Completions(state)
    for path in ROUTES:
        app.add_api_route(path, completions.forward, methods=["POST"])
    return app


def _failed(ex: Exchange, status: int, message: str, kind: str):
    ex.http_status = status
    ex.fail(kind, message)
    return JSONResponse(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": kind}},
        status_code=status,
    )
