"""What the proxy sees of one request, and the rows it leaves in the trace store.

:class:`Exchange` collects the client-side times of one forwarded request: arrival, when the
upstream was asked, its first byte, each streamed event that carried output, the end. The
upstream's OpenAI-style server-sent events are read beside the relay (never changed): a
``data:`` line's JSON gives the response id, the content deltas and the final ``usage``; a
line that is not JSON marks the stream malformed. A compressed body (``Content-Encoding`` gzip
or deflate, relayed as it came) is read from a decoded copy. What cannot be recorded (a
``usage`` count that is not a whole number in the store's range, a field of the wrong type, an
event that fails to parse) is left out of the row and counted in :attr:`Exchange.dropped` by
reason, never raised: watching a request must never fail it. :meth:`Exchange.rows` turns it into a
``requests`` row (TTFT, ITL, TPOT, E2E as ``telemetry/spans.py`` defines them, measured at the
proxy) and the trace: a ``request`` root with the ``gateway`` (arrival → forwarded) and
``stream`` (first byte → last) stations of the proxy, and ``tokenize`` where the proxy counted
the prompt with the upstream model's tokenizer (``--tokenizer``: the row's prompt size when the
upstream's ``usage`` never came); the upstream's own spans join the same
trace through the ``traceparent`` the proxy sent.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from tokenmill.engine.api.traceparent import new_traceparent, parse_traceparent
from tokenmill.engine.sampling_params import MAX_TOKEN_INT
from tokenmill.telemetry.latency import itl_ms, request_latencies
from tokenmill.telemetry.rows import RequestRow, span_row
from tokenmill.telemetry.spans import operation_name, root_span_name

#: the most of an event stream's unfinished line, or of a decoded body, kept for reading: past
#: it the rest is relayed unread (an upstream's one endless line must not grow the proxy)
MAX_READ_BYTES = 4 << 20
#: the body encodings read from a decoded copy (zlib's window bits: gzip, zlib deflate)
#: an event stream's line ends: CRLF, LF or a lone CR
_LINE_END = re.compile(rb"\r\n|\r|\n")
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def token_count(value) -> int | None:
    """``value`` as a token count the store holds (a whole number in 0..2^31-1), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_INT:
        return value
    return None


def _text(value, limit: int = 200) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def new_trace(traceparent: str | None) -> tuple[str, str, str]:
    """``(trace id, this request's span id, the traceparent to send upstream)``: the caller's
    trace when its ``traceparent`` is valid, else a new one; always sampled upstream."""
    caller = parse_traceparent(traceparent)
    ours = new_traceparent(caller.trace_id if caller else None)
    return ours.trace_id, ours.span_id, ours.header()


@dataclass
class Exchange:
    """One request through the proxy (client-side times, wall-clock ns)."""

    arrival_ns: int
    endpoint: str  # chat | completions
    trace_id: str
    span_id: str
    upstream: str
    tenant: str | None = None
    tenant_limit: int | None = None  # the tenant's prompt-token limit
    model: str | None = None
    stream: bool = False
    client_request_id: str | None = None
    max_tokens: int | None = None
    forwarded_ns: int | None = None
    first_byte_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)  # events that carried output
    end_ns: int | None = None
    http_status: int | None = None
    response_id: str | None = None
    finish_reason: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # the proxy's own count of the prompt (``--tokenizer``) and when it was made
    counted_prompt_tokens: int | None = None
    tokenized_ns: tuple[int, int] | None = None
    saved: bool = False  # its row written (once)
    saw_done: bool = False  # the stream's ``data: [DONE]``
    upstream_error: bool = False  # the upstream sent an error event of its own
    # what could not be recorded, by reason (``ProxyMetrics`` counts it)
    dropped: Counter = field(default_factory=Counter)
    _pending: bytearray = field(default_factory=bytearray)  # the unfinished line
    _skipping: bool = False  # inside a line past MAX_READ_BYTES: skipped to its end
    _after_cr: bool = False  # the last piece ended in CR (a LF next ends no second line)
    _decoder: object = None  # a zlib decoder for a compressed body; False: not readable

    def set_encoding(self, encoding: str | None) -> None:
        """The upstream's ``Content-Encoding``: a body in gzip or deflate is read decoded, one
        in another encoding is not read (counted once as ``encoded_body``)."""
        enc = (encoding or "identity").strip().lower()
        if enc in ("", "identity"):
            return
        if enc in _DECODERS:
            self._decoder = zlib.decompressobj(_DECODERS[enc])
        else:
            self._decoder = False
            self.dropped["encoded_body"] += 1

    def _decoded(self, data: bytes) -> bytes:
        dec = self._decoder
        if dec is None:
            return data
        if dec is False:
            return b""
        try:
            out = dec.decompress(data, MAX_READ_BYTES)
        except zlib.error:
            out = None
        if out is None or dec.unconsumed_tail:  # not the encoding it says, or a bomb
            self._decoder = False
            self.dropped["encoded_body"] += 1
            return b""
        return out

    def on_bytes(self, data: bytes, now_ns: int | None = None) -> None:
        """Read a relayed piece of the upstream's event stream (side effects only; never
        raises: what fails to read is counted in :attr:`dropped`). Lines end in LF, CRLF or a
        lone CR (the event-stream format allows all three). A piece with no line end only
        grows the unfinished line, so a long line arriving in small pieces costs time linear
        in its length; past :data:`MAX_READ_BYTES` the rest of that line is skipped unread."""
        now = now_ns or time.time_ns()
        if self.first_byte_ns is None:
            self.first_byte_ns = now
        try:
            data = self._decoded(data)
            if self._after_cr and data.startswith(b"\n"):  # the LF of a CRLF split in two
                data = data[1:]
            self._after_cr = False
            if not data:
                return
            self._after_cr = data.endswith(b"\r")
            if b"\n" not in data and b"\r" not in data:  # the unfinished line grows
                if not self._skipping:
                    self._pending += data
                    if len(self._pending) > MAX_READ_BYTES:
                        self._too_long()
                return
            *lines, rest = _LINE_END.split(data)
            if self._skipping:  # the end of a line too long to read
                self._skipping = False
                lines[0] = b""
            elif self._pending:
                lines[0] = bytes(self._pending) + lines[0]
            self._pending = bytearray(rest)
            if len(self._pending) > MAX_READ_BYTES:
                self._too_long()
            for line in lines:
                self._on_line(line.strip(), now)
        except Exception:  # a reader's fault is counted, the relay goes on
            self.dropped["unreadable_event"] += 1

    def _too_long(self) -> None:
        self._pending = bytearray()
        self._skipping = True
        self.dropped["event_too_long"] += 1

    def _on_line(self, line: bytes, now: int) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.saw_done = True
            return
        if not payload:
            return
        try:
            event = json.loads(payload)
        except RecursionError:
            self.dropped["unreadable_event"] += 1
            return
        except ValueError:
            self.error_type = self.error_type or "upstream_malformed_stream"
            self.error_message = f"a data line that is not JSON: {payload[:80]!r}"
            return
        if not isinstance(event, dict):
            self.error_type = self.error_type or "upstream_malformed_stream"
            return
        self._read_event(event, now)

    def _read_event(self, event: dict, now: int) -> None:
        self.response_id = self.response_id or _text(event.get("id"))
        self.model = _text(event.get("model")) or self.model
        if isinstance(event.get("error"), dict):
            self.upstream_error = True
            self.error_type = self.error_type or "upstream_error"
            self.error_message = str(event["error"].get("message"))[:200]
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            text = choice.get("text") if "text" in choice else delta.get("content")
            if text:
                self.token_ns.append(now)
            if choice.get("finish_reason"):
                self.finish_reason = _text(choice["finish_reason"], 40) or self.finish_reason
        usage = event.get("usage")
        if isinstance(usage, dict):
            for key in ("prompt_tokens", "completion_tokens"):
                value = usage.get(key)
                if value is None:  # absent: nothing to record
                    continue
                count = token_count(value)
                if count is None:
                    self.dropped["usage_not_a_count"] += 1
                elif key == "prompt_tokens":
                    self.prompt_tokens = count
                else:
                    self.completion_tokens = count
        elif usage is not None:
            self.dropped["usage_not_a_count"] += 1

    def on_body(self, body: bytes, now_ns: int | None = None) -> None:
        """Read a whole (non-streamed) JSON answer (never raises, as :meth:`on_bytes`)."""
        now = now_ns or time.time_ns()
        self.first_byte_ns = self.first_byte_ns or now
        try:
            self._on_body(self._decoded(body), now)
        except Exception:  # a reader's fault is counted, the answer goes back
            self.dropped["unreadable_body"] += 1

    def _on_body(self, body: bytes, now: int) -> None:
        if self._decoder is False:
            return
        try:
            event = json.loads(body)
        except RecursionError:
            self.dropped["unreadable_body"] += 1
            return
        except ValueError:
            if self.http_status and self.http_status < 400:
                self.error_type = self.error_type or "upstream_malformed_response"
            return
        if isinstance(event, dict):
            self._read_event(event, now)
            if self.token_ns:  # one answer: the whole output arrives at once
                self.token_ns = [now]

    def fail(self, error_type: str, message: str) -> None:
        self.error_type, self.error_message = error_type, message

    # ---- rows -------------------------------------------------------------------------------

    def itl_ms(self) -> list[float]:
        """The request's ITL samples (ms): the gaps between the events that carried output."""
        return itl_ms(self.token_ns)

    def request_row(self) -> dict:
        end = self.end_ns or time.time_ns()
        out_tokens = self.completion_tokens
        if out_tokens is None:
            out_tokens = len(self.token_ns)  # one event, one token, when usage is absent
        finish = self.finish_reason
        if self.error_type == "client_disconnected":
            finish = "abort"
        elif self.error_type is not None:
            finish = "error"
        times = request_latencies(
            arrival=self.arrival_ns, end=end, output_tokens=out_tokens, token_times=self.token_ns
        )
        row = RequestRow(
            **times,
            request_id=self.response_id or f"proxy-{self.span_id}",
            client_request_id=self.client_request_id,
            trace_id=self.trace_id,
            tenant=self.tenant,
            model=self.model,
            endpoint=self.endpoint,
            stream=self.stream,
            http_status=self.http_status,
            arrival_ns=self.arrival_ns,
            last_token_ns=self.token_ns[-1] if self.token_ns else None,
            end_ns=end,
            input_tokens=self.prompt_tokens or self.counted_prompt_tokens or 0,
            output_tokens=out_tokens or 0,
            first_token_ns=self.token_ns[0] if self.token_ns else None,
            max_tokens=self.max_tokens,
            finish_reason=finish,
            error_type=self.error_type,
        )
        return msgspec.structs.asdict(row)

    def span_rows(self) -> list[dict]:
        end = self.end_ns or time.time_ns()
        attrs = {
            "gen_ai.operation.name": operation_name(self.endpoint),
            "gen_ai.request.model": self.model,
            "gen_ai.request.stream": self.stream,
            "tokenmill.upstream": self.upstream,
            "tokenmill.request_id": self.response_id,
            "http.response.status_code": self.http_status,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
        }
        if self.error_message:
            attrs["tokenmill.error_message"] = self.error_message
        # the proxy's own values, where its attributes do not carry them
        base = {
            "trace_id": self.trace_id,
            "service_name": "tokenmill-proxy",
            "request_id": self.response_id,
            "tenant": self.tenant,
            "model": self.model,
        }
        spans = [
            span_row(
                **base,
                span_id=self.span_id,
                parent_span_id=None,
                name=root_span_name(self.endpoint, self.model),
                kind="SERVER",
                start_ns=self.arrival_ns,
                end_ns=end,
                status_code="ERROR" if self.error_type else "OK",
                status_message=self.error_message,
                attributes={k: v for k, v in attrs.items() if v is not None},
                finish_reason=self.finish_reason,
                error_type=self.error_type,
            )
        ]
        stations = [("gateway", self.arrival_ns, self.forwarded_ns)]
        if self.tokenized_ns is not None:
            stations.append(("tokenize", *self.tokenized_ns))
        stations.append(("stream", self.first_byte_ns, end if self.first_byte_ns else None))
        for name, start, stop in stations:
            if start is None or stop is None:
                continue
            spans.append(
                span_row(
                    **base,
                    span_id=secrets.token_hex(8),
                    parent_span_id=self.span_id,
                    name=name,
                    kind="INTERNAL",
                    start_ns=start,
                    end_ns=stop,
                    status_code="UNSET",
                )
            )
        return spans
