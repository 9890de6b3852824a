"""The request-outcome type: one ``requests`` row, derived from a request's trace.

The ``requests`` table is generated from :class:`RequestRow` (``schema.py``). Its engine
counters come from :class:`~tokenmill.engine.messages.RequestStats`, which it inherits: a new
engine column is a field there and the engine line that sets it; a column derived at the API
(times, stations) is a field here plus the line in ``spans.request_row`` that fills it.
Required fields are ``NOT NULL`` columns; fields with a default are nullable. Terms (TTFT, ITL,
TPOT, E2E) are defined once in ``spans.py`` and README's Terms.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from tokenmill.engine.messages import Ns, NsOrNull, RequestStats

Ms = Annotated[float | None, msgspec.Meta(description="milliseconds")]
#: 63-bit content hashes, stored as BIGINT[]
Hashes = Annotated[list[int] | None, msgspec.Meta(extra={"sql": "BIGINT[]"})]


class RequestRow(RequestStats, kw_only=True):
    """One request's derived numbers, field for field the ``requests`` table: the engine's
    :class:`~tokenmill.engine.messages.RequestStats` (inherited, its columns first) and these."""

    request_id: str
    """the engine id (cmpl-...)"""
    client_request_id: str | None = None
    """x-request-id as the client sent it"""
    trace_id: str
    tenant: str | None = None
    model: str | None = None
    replica: int | None = None
    """the data-parallel replica (engine core) the router sent it to
    (``engine/api/replicas.py``; 0 with one engine core); NULL when no engine took it"""
    endpoint: str | None = None
    """chat | completions"""
    stream: bool | None = None
    http_status: int | None = None
    arrival_ns: Ns
    """gateway start"""
    last_token_ns: NsOrNull = None
    end_ns: Ns
    """the request span's end (after metering)"""
    ttft_ms: Ms = None
    """first_token_ns - arrival_ns"""
    queue_ms: Ms = None
    """scheduled_ns - queued_ns"""
    prefill_ms: Ms = None
    """first_token_ns - scheduled_ns"""
    decode_ms: Ms = None
    """last_token_ns - first_token_ns"""
    tpot_ms: Ms = None
    """decode_ms / (output_tokens - 1)"""
    itl_p50_ms: Ms = None
    itl_p99_ms: Ms = None
    itl_max_ms: Ms = None
    e2e_ms: Ms = None
    """end_ns - arrival_ns"""
    client_ttft_ms: Ms = None
    """filled by the load generator when it knows"""
    first_text_ns: NsOrNull = None
    """the engine released the first output text to the stream"""
    text_holdback_ms: Ms = None
    """first_text_ns - first_token_ns: how long the server itself withheld the first token's
    text (a tail that might become a stop string, an incomplete UTF-8 character)"""
    max_tokens: int | None = None
    prefill_chunks: int | None = None
    kv_transfer_ms: Ms = None
    """prefill/decode disaggregation: the request's KV on its way from the prefill core to the
    decode core (its ``kv_transfer`` event); NULL when colocated"""
    kv_transfer_bytes: NsOrNull = None
    """bytes of that KV: the prompt's blocks, K and V of every layer"""
    kv_wait_ms: Ms = None
    """ms the transferred KV waited on the decode side for room (back-pressure)"""
    finish_reason: str | None = None
    """stop | length | abort | error | NULL (rejected)"""
    error_type: str | None = None
    prompt_block_hashes: Hashes = None
    """per-block content hashes of the prompt's first 32 blocks (the engine's block size), not
    chained"""
    prompt_head_hashes: Hashes = None
    """content hashes of the prompt's first block_size/4, /2 and 3/4 tokens (prefixes shorter
    than one block, which the prefix cache cannot reuse)"""
    cache_misses: str | None = None
    """JSON: why each prompt block the prefix cache did not serve at admission was computed, as
    runs ``[{"reason", "first_block", "num_blocks", "time_ns"?, "by"?, "tenant"?}]``
    (``engine/messages.py``: ``CacheMiss``, ``CACHE_MISS_REASONS``); NULL when the engine never
    admitted the request"""


class WaitingSampleRow(msgspec.Struct, kw_only=True):
    """One request in flight whose first token had not reached the API (so not the client
    either) at one sample: field
    for field the ``waiting_samples`` table. The API takes a sample of every such request each
    ``WAITING_SAMPLE_S`` (``engine/api/app.py``), so a queue shows in the store while it stands,
    not only once its requests end (a ``requests`` row is written when the request ends, a step
    row when its step ends: a short request stuck behind a 10 s prefill is in neither)."""

    time_ns: Ns
    """when the sample was taken"""
    request_id: str
    """the engine id (cmpl-...)"""
    arrival_ns: Ns
    """the request reached the gateway (its ``requests.arrival_ns`` once it ends)"""
    wait_ms: float
    """time_ns - arrival_ns: its TTFT will be at least this"""
    prompt_tokens: int | None = None
    scheduled: bool | None = None
    """the engine had started its prefill (False: still queued)"""
    tenant: str | None = None
    replica: int | None = None
