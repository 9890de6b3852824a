"""RequestTimeline: what one HTTP request did at each station, in wall-clock ns.

The API stations fill it as the request passes (gateway → tokenize → admission), the engine's
outputs add the engine's own timestamps (queued, scheduled, every token, finished) and events,
and the ASGI layer adds the first and last byte sent. When the response is over, metering runs
and the finished timeline goes to a :class:`TimelineSink` (telemetry turns it into spans and a
``requests`` row). The API knows nothing of how it is stored.

All ``*_ns`` fields are ``time.time_ns()`` values from the process that saw the moment: the API
process for stations and bytes, the engine core process for queue/schedule/token times (same
host, same clock).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from ..messages import CacheMiss, RequestEvent, RequestOutput, RequestStats, is_completed
from .traceparent import TraceParent


@dataclass(slots=True)
class RequestTimeline:
    """One request's station times and outcome. ``None`` means the station was not reached."""

    arrival_ns: int
    method: str
    path: str
    client_request_id: str | None = None
    traceparent: TraceParent | None = None  # the caller's, when it sent a valid one
    endpoint: str | None = None  # chat | completions
    request_id: str | None = None  # the engine id (cmpl-...)
    tenant: str | None = None
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    prompt_text: str | None = None  # only with --trace-content
    # a chat's messages as sent, [{"role", "content"}] (only with --trace-content)
    input_messages: list[dict] | None = None
    output_text: list[str] = field(default_factory=list)  # only with --trace-content
    # API stations
    gateway_end_ns: int | None = None
    tokenize_end_ns: int | None = None
    admission_end_ns: int | None = None
    prompt_block_hashes: list[int] | None = None
    prompt_head_hashes: list[int] | None = None
    queue_depth_seen: int | None = None
    in_flight_seen: int | None = None
    pool: str | None = None
    replica: int | None = None  # the data-parallel replica the router picked
    # engine (from RequestOutput): its counters and milestones as the last output left them
    # (input_tokens from the tokenize station until then; queued_ns None: the engine never took it)
    stats: RequestStats = field(default_factory=RequestStats)
    finished_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)
    # engine time of the first output that carried text: later than first_token_ns when the
    # detokenizer withheld the start (a possible stop string, an incomplete UTF-8 character)
    first_text_ns: int | None = None
    finish_reason: str | None = None
    events: list[RequestEvent] = field(default_factory=list)
    # why its prompt blocks missed the prefix cache at admission (RequestOutput.cache_misses)
    cache_misses: list[CacheMiss] | None = None
    # response
    http_status: int | None = None
    first_byte_ns: int | None = None
    last_byte_ns: int | None = None
    client_disconnected: bool = False
    client_disconnect_ns: int | None = None
    error_type: str | None = None
    error_message: str | None = None
    usage: dict | None = None  # set when the request is to be metered
    metering_start_ns: int | None = None
    metering_end_ns: int | None = None
    record_content: bool = False
    trace_id: str | None = None  # set by telemetry when it records the trace (the access log)

    def observe(self, out: RequestOutput) -> None:
        """Fold one engine output (a delta) into the timeline."""
        self.stats = out.stats
        self.token_ns.extend(out.token_ns)
        if self.first_text_ns is None and out.new_text:
            self.first_text_ns = (out.token_ns or [out.finished_ns or time.time_ns()])[-1]
        self.events.extend(out.events)
        if out.cache_misses is not None:
            self.cache_misses = out.cache_misses
        if self.record_content and out.new_text:
            self.output_text.append(out.new_text)
        if out.finished:
            self.finished_ns = out.finished_ns
            self.finish_reason = out.finish_reason
            if out.finish_reason == "error" and self.error_type is None:
                self.error_type = out.error_type or "engine_error"
                self.error_message = out.error_message

    def fail(self, error_type: str, message: str | None = None) -> None:
        """Record why the request was refused or failed (the first reason wins)."""
        now = time.time_ns()
        if self.gateway_end_ns is None:
            self.gateway_end_ns = now
        if self.error_type is None:
            self.error_type = error_type
            self.error_message = message

    @property
    def completed(self) -> bool:
        """Finished with ``stop`` or ``length`` and answered without error."""
        return is_completed(self.finish_reason, self.error_type)


def block_hashes(token_ids: list[int], block_size: int, max_blocks: int = 32) -> list[int]:
    """Content hash (signed 63-bit, blake2b) of each full ``block_size``-token block of a prompt,
    each block on its own (not chained), for the first ``max_blocks`` blocks. Lets the diagnoser
    see prompts that share a long prefix but differ in an early block, without storing text."""
    out = []
    for i in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        digest = hashlib.blake2b(array("q", token_ids[i : i + block_size]).tobytes(), digest_size=8)
        out.append(int.from_bytes(digest.digest(), "little", signed=True) >> 1)
    return out


def head_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Content hashes (signed 63-bit, blake2b) of the prompt's first ``k`` tokens for
    ``k = block_size/4, block_size/2, 3*block_size/4`` (steps of at least one token, only
    ``k <= len(token_ids)``): prefixes shorter than one block. Prompts that share such a prefix
    but no full block get nothing from the prefix cache, which reuses whole blocks; these
    hashes let the diagnoser say so without storing text."""
    step = max(1, block_size // 4)
    out = []
    for k in range(step, min(block_size - 1, len(token_ids)) + 1, step):
        digest = hashlib.blake2b(array("q", token_ids[:k]).tobytes(), digest_size=8)
        out.append(int.from_bytes(digest.digest(), "little", signed=True) >> 1)
    return out


class TimelineSink(Protocol):
    """Where finished timelines and engine step records go (telemetry implements it)."""

    def on_request(self, timeline: RequestTimeline) -> None: ...

    def on_step(self, record) -> None: ...
