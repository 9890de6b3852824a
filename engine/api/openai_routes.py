"""The OpenAI routes: chat and text completions through the stations, ``/v1/models``, the schema."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..async_engine import EngineDeadError, StreamStopped
from ..errors import RequestRejected
from ..messages import RequestOutput
from ..sampling_params import SamplingParams
from .errors import APIError
from .gateway import Tenant
from .protocol import ChatCompletionRequest, CompletionRequest
from .server_state import DRAIN_RETRY_S, DRAINING_MESSAGE, ServerState
from .stations import Tokenized, usage_of
from .timeline import RequestTimeline, block_hashes, head_hashes
from .worker import EngineUnavailable

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def register_model_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/models``: the one model this server serves (keyed like ``/v1/*``)."""

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


def register_openapi_route(app: FastAPI, state: ServerState) -> None:
    """``/openapi.json``, keyed like ``/v1/*``; its ``model`` fields name the served model."""

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


def register_completion_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/chat/completions`` and ``/v1/completions``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _complete(state, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(state, body, request, chat=False)


def _request_timeline(request: Request) -> RequestTimeline:
    """The timeline the timeline middleware opened for this request."""
    tl = getattr(request.state, "tm_timeline", None)
    if tl is None:  # a route reached without the middleware (tests building the app by hand)
        tl = RequestTimeline(
            arrival_ns=time.time_ns(), method=request.method, path=request.url.path
        )
        request.state.tm_timeline = tl
    return tl


class _Hold:
    """A request's hold on its tenant's limits (gateway) and, once admitted, on the admission
    station; :meth:`release` lets go of both, once, however the request ends."""

    def __init__(self, state: ServerState, tenant: Tenant):
        self.state = state
        self.tenant = tenant
        self.admitted = False
        self.released = False

    def admit(self) -> None:
        self.state.admission.enter()
        self.admitted = True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.gateway.release(self.tenant)
            if self.admitted:
                self.state.admission.leave()


async def _complete(state: ServerState, body, request: Request, chat: bool):
    """One completion request: gateway, tokenize, admission, the engine, then a stream or one
    JSON body (metering and telemetry follow in the timeline middleware)."""
    tl = _request_timeline(request)
    tl.stream = bool(body.stream)
    tl.temperature = body.temperature
    tl.top_p = body.top_p
    tl.seed = body.seed
    tenant = _pass_gateway(state, body, request, tl)
    hold = _Hold(state, tenant)
    # The engine's id is ours alone: a client-chosen x-request-id must never let two requests
    # (or two tenants) share an output stream.
    # OpenAI's prefixes: a chat completion's id starts chatcmpl-, a completion's cmpl-
    engine_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tl.request_id = engine_id
    try:
        tok, params = _tokenize(state, body, tenant, tl, chat)
        outputs = _admit(state, engine_id, tok, params, tenant, tl, hold)
    except BaseException:
        hold.release()
        raise
    created = int(time.time())
    outputs = _observed(outputs, tl, state.unsettled)
    if body.stream:
        gen = _stream(
            state,
            outputs,
            engine_id,
            chat,
            created,
            tenant,
            tok,
            body.include_usage,
            hold.release,
            tl,
        )
        return _streaming_response(gen, outputs, hold, tl)
    try:
        return await _collect_unless_gone(
            state, request, outputs, engine_id, chat, created, tenant, tok, tl
        )
    finally:
        hold.release()


def _pass_gateway(state: ServerState, body, request: Request, tl: RequestTimeline) -> Tenant:
    """The gateway station: refused while draining, the key, the model, the options, the
    tenant's limits (held until the request ends)."""
    if state.draining or state.shutting_down:
        tl.fail("server_shutdown", DRAINING_MESSAGE)
        raise APIError(503, DRAINING_MESSAGE, code="server_shutdown", retry_after=DRAIN_RETRY_S)
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
    return tenant


def _tokenize(
    state: ServerState, body, tenant: Tenant, tl: RequestTimeline, chat: bool
) -> tuple[Tokenized, SamplingParams]:
    """The tokenize station: the prompt's tokens and the request's sampling parameters,
    checked; the prompt's block hashes (and content, with ``--trace-content``) on the
    timeline."""
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
    return tok, params


def _admit(
    state: ServerState,
    engine_id: str,
    tok: Tokenized,
    params: SamplingParams,
    tenant: Tenant,
    tl: RequestTimeline,
    hold: _Hold,
) -> AsyncIterator[RequestOutput]:
    """The admission station, then the request to the engine: its outputs (the replica the
    router picked on the timeline)."""
    tl.queue_depth_seen = state.admission.queue_depth
    tl.in_flight_seen = state.admission.in_flight
    tl.pool = state.worker.name  # the replica's own name once the router picked it
    hold.admit()
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
    return outputs


def _streaming_response(gen, outputs, hold: _Hold, tl: RequestTimeline) -> StreamingResponse:
    """The SSE response over the stream ``gen``; a body closed before it began still records
    the disconnect, closes the engine's outputs and releases the hold."""

    async def close_unstarted():
        """The stream's own cleanup, for a body closed before it began (idempotent: a
        stream that ran has released already)."""
        if hold.released:
            return
        if tl.error_type is None:
            tl.client_disconnected = True
            tl.client_disconnect_ns = time.time_ns()
            tl.error_type = "client_disconnected"
        await outputs.aclose()
        hold.release()

    return _ClosingStreamingResponse(
        gen, on_close=close_unstarted, media_type="text/event-stream", headers=SSE_HEADERS
    )


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
