"""A stub OpenAI-style SSE server for the bench client tests (uvicorn in a thread).

Each streamed answer: a role-only frame (chat) at once, a ``: keep-alive`` comment, an empty
content frame, then after ``delay_s`` the first token, ``tokens - 1`` more every ``gap_s``, a
finish frame, a usage frame and ``[DONE]``. ``mode`` = ``"http500"`` answers 500,
``"stream_error"`` sends an error event instead of tokens, ``"no_done"`` ends without
``[DONE]``. Received ``x-request-id`` / ``traceparent`` headers are kept in ``seen``; the ids of
streams the client closed before the end in ``cut_short``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from server_proc import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


class StubServer:
    def __init__(self, delay_s: float = 0.3, gap_s: float = 0.1, tokens: int = 5):
        self.delay_s, self.gap_s, self.tokens = delay_s, gap_s, tokens
        self.mode = "ok"
        self.seen: list[dict] = []
        self.first_token_sent: dict[str, float] = {}  # request id -> seconds after arrival
        self.cut_short: set[str] = set()  # request ids whose client left before [DONE]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "stub server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def chat(self, request: Request):
        return await self._answer(request, chat=True)

    async def completions(self, request: Request):
        return await self._answer(request, chat=False)

    async def _answer(self, request: Request, chat: bool):
        arrived = time.perf_counter()
        body = await request.json()
        rid = request.headers.get("x-request-id", "")
        self.seen.append(
            {
                "x-request-id": rid,
                "traceparent": request.headers.get("traceparent"),
                "body": body,
            }
        )
        if self.mode == "http500":
            return JSONResponse({"error": {"message": "stub failure", "type": "x"}}, 500)
        is_probe = body.get("max_tokens") == 1 and not body.get("ignore_eos")
        n = 1 if is_probe else self.tokens
        delay, gap, mode = self.delay_s, self.gap_s, self.mode

        def frame(text, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

        async def gen():
            finished = False
            try:
                async for part in body_parts():
                    yield part
                finished = True
            finally:
                if not finished:
                    self.cut_short.add(rid)

        async def body_parts():
            if chat:
                yield frame("", role=True)
            yield ": keep-alive\n\n"
            yield frame("")  # an empty content frame: no token
            if mode == "stream_error" and not is_probe:
                yield 'data: {"error": {"message": "engine exploded", "type": "x"}}\n\n'
                yield "data: [DONE]\n\n"
                return
            await asyncio.sleep(delay)
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                if i == 0:
                    self.first_token_sent[rid] = time.perf_counter() - arrived
                yield frame(f"tok{i} ")
                if i == 0:
                    yield ": keep-alive\n\n"
            yield frame(None if chat else "", finish="length")
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            if mode == "no_done" and not is_probe:
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")
