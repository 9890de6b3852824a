"""The store's row types written by every producer: :class:`RequestRow` (one ``requests``
row, derived from a request's trace) and :class:`SpanRow` (one ``spans`` row); the
``requests`` and ``spans`` tables are generated from them (``schema.py``).

The server, the proxy, the OTLP receiver and the planner each fill a ``RequestRow``. Its engine
counters come from :class:`~tokenmill.engine.messages.RequestStats`, which it inherits: a new
engine column is a field there and the engine line that sets it. Its latencies come from
``latency.request_latencies``, the one derivation all four producers call: a new latency
column is a field here and its formula there (docs/how-to-add.md). Required fields are
``NOT NULL`` columns; fields with a default are nullable.
"""

from __future__ import annotations

import json
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


Json = Annotated[str | None, msgspec.Meta(extra={"sql": "JSON"})]


class SpanRow(msgspec.Struct, kw_only=True):
    """One span, field for field the ``spans`` table (the OTLP span model; every attribute kept
    as JSON, the hot ones copied into typed columns). Every producer builds it with
    :func:`span_row`: the server's own spans, the proxy's, and spans another engine exported to
    the OTLP receiver."""

    trace_id: str
    """32 hex digits"""
    span_id: str
    """16 hex digits"""
    parent_span_id: str | None = None
    """NULL for the root span (kind SERVER)"""
    name: str
    """the root: ``chat {model}`` | ``text_completion {model}`` (``request`` in older stores);
    the stations: gateway | tokenize | admission | schedule | prefill | decode | stream |
    metering"""
    kind: str
    """SERVER | INTERNAL | CLIENT | ..."""
    start_ns: Ns
    end_ns: Ns
    duration_ns: Ns
    status_code: str
    """UNSET | OK | ERROR"""
    status_message: str | None = None
    service_name: str | None = None
    attributes: Json = None
    """every attribute, by its OTel name"""
    events: Json = None
    """``[{"name", "time_ns", "attributes"}]``"""
    request_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error_type: str | None = None


#: the hot columns of a span, each from the first of its attributes present: ours (the GenAI
#: conventions' and ``tokenmill.*``), then the names vLLM's request span uses (``llm_request``,
#: read by ``otlp_receiver.py``)
HOT_ATTRIBUTES = {
    "request_id": ("tokenmill.request_id", "gen_ai.request.id"),
    "tenant": ("tokenmill.tenant",),
    "model": ("gen_ai.request.model", "gen_ai.response.model"),
    "input_tokens": ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
    "output_tokens": ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
    "cached_tokens": ("tokenmill.usage.cached_tokens",),
    "error_type": ("error.type",),
}


def strict_json(node) -> str:
    """Strict JSON for the store's JSON columns: a NaN or ±Inf (a double attribute may hold
    one) is written as null, never as the invalid token ``NaN``."""
    return msgspec.json.encode(node).decode()


def span_row(
    *,
    trace_id: str,
    span_id: str,
    parent_span_id: str | None,
    name: str,
    kind: str,
    start_ns: int,
    end_ns: int,
    status_code: str,
    status_message: str | None = None,
    service_name: str | None = None,
    attributes: dict | None = None,
    events: list | None = None,
    **columns,
) -> dict:
    """The ``spans`` row (:class:`SpanRow` as a dict) of one span: its attributes and events as
    JSON, its duration, and the hot columns from :data:`HOT_ATTRIBUTES` and the first of
    ``gen_ai.response.finish_reasons`` (a list, or vLLM's JSON string of one), unless given in
    ``columns``."""
    attrs = attributes or {}
    hot = {}
    for col, keys in HOT_ATTRIBUTES.items():
        hot[col] = next((attrs[k] for k in keys if attrs.get(k) is not None), None)
    reasons = attrs.get("gen_ai.response.finish_reasons")
    if isinstance(reasons, str):  # vLLM writes the list as a JSON string
        try:
            reasons = json.loads(reasons)
        except ValueError:
            reasons = [reasons]
    hot["finish_reason"] = reasons[0] if reasons else None
    row = SpanRow(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        kind=kind,
        start_ns=start_ns,
        end_ns=end_ns,
        duration_ns=end_ns - start_ns,
        status_code=status_code,
        status_message=status_message,
        service_name=service_name,
        attributes=strict_json(attrs),
        events=strict_json(events or []),
        **{**hot, **columns},
    )
    return msgspec.structs.asdict(row)


class WaitingSampleRow(msgspec.Struct, kw_only=True):
    """One request in flight whose first token had not reached the API (so not the client
    either) at one sample: field
    for field the ``waiting_samples`` table. The API takes a sample of every such request each
    ``WAITING_SAMPLE_S`` (``engine/api/server_state.py``), so a queue shows in the store while it stands,
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


class StreamSampleRow(msgspec.Struct, kw_only=True):
    """One streamed request in flight that had made its first token and not yet ended, at one
    sample: field for field the ``stream_samples`` table. ``tokenmill proxy`` takes a sample of
    every such stream each ``WAITING_SAMPLE_S``, so an upstream's pace shows in the store while
    its streams run (its ``requests`` row comes only when the stream ends: a neighbour that
    makes every token 20x slower keeps every stream open for minutes)."""

    time_ns: Ns
    """when the sample was taken"""
    request_id: str
    """the request's id (its ``requests.request_id`` once it ends)"""
    first_token_ns: Ns
    """its first output reached the proxy"""
    last_token_ns: Ns
    """its latest output reached the proxy"""
    output_tokens: int
    """outputs (stream events with text) so far"""
    tenant: str | None = None


class FindingRow(msgspec.Struct, kw_only=True):
    """One state of a live finding (``diagnose/live.py``): field for field the ``findings``
    table. A finding writes a row when it opens, at each period it still holds, and when it
    resolves; its current state is its latest row (``arg_max(..., time_ns)`` by
    ``finding_id``)."""

    time_ns: Ns
    """when this state was written"""
    finding_id: str
    rule: str
    """the rule's id (``diagnose/rules/``)"""
    status: str
    """open | resolved"""
    severity: str
    """warning | critical"""
    confidence: float
    title: str
    summary: str
    first_seen_ns: Ns
    """the first period the rule held in (before the finding opened)"""
    opened_ns: NsOrNull = None
    last_seen_ns: Ns
    """the latest period the rule held in"""
    resolved_ns: NsOrNull = None
    evidence: str = "{}"
    """JSON: the rule's numbers at the latest period it held"""
    example_trace_ids: list[str] = msgspec.field(default_factory=list)
    explained_by: list[str] = msgspec.field(default_factory=list)
    """rules of other open findings that explain this one"""
    runbook: str = ""
    knob: str = ""


def finding_row(*, evidence: dict, **fields) -> dict:
    """A ``findings`` row as the store takes it (evidence as strict JSON)."""
    return msgspec.structs.asdict(FindingRow(evidence=strict_json(evidence), **fields))
