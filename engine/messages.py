"""The engine's contract with everything that observes it: every message between the API process
and the engine core process, and the step record telemetry stores, as typed msgspec Structs.

This module imports no torch, so the API, telemetry and tests can read engine messages without
loading the model stack. Messages cross the process boundary as msgpack (:func:`encode`,
:data:`INPUT_DECODER`, :data:`OUTPUT_DECODER`), never as pickles; each is a tagged Struct, so a
reader dispatches on its type. vLLM's ``EngineCoreRequest`` / ``EngineCoreOutputs`` are the model.

API → engine (:data:`EngineInput`): :class:`AddRequest`, :class:`AbortRequests`,
:class:`StatsQuery`, :class:`Shutdown`.

Engine → API (:data:`EngineOutput`): :class:`EngineReady`, :class:`EngineOutputs` (the step's
:class:`RequestOutput` deltas and its :class:`StepRecord`), :class:`Heartbeat` (idle: stats and an
idle step record), :class:`StatsReply`, :class:`RequestFailed` and :class:`EngineFatal` (an
:class:`EngineError` with a stable ``error_type`` code).

Adding a step field is one edit here (a field with a default, its unit in the name or the
description): the ``engine_steps`` column is generated from :class:`StepRecord`
(``tokenmill.telemetry.schema``); set it in ``EngineCore.step``. A request's counters travel the
same way as one :class:`RequestStats` (engine ``Request`` → :class:`RequestOutput` → the API's
timeline → the ``requests`` row, whose type inherits it): a per-request column is a field there
and the engine line that sets it.
"""

from __future__ import annotations

import signal
from typing import Annotated, Any

import msgspec

from .sampling_params import SamplingParams

# ---- column types: the store's SQL type is read from these (telemetry/schema.py) ----
#: wall-clock Unix nanoseconds (``time.time_ns()``), stored as BIGINT
Ns = Annotated[int, msgspec.Meta(extra={"sql": "BIGINT"})]
#: a large integer (ids, byte counts), stored as BIGINT
BigInt = Annotated[int, msgspec.Meta(extra={"sql": "BIGINT"})]
#: wall-clock Unix nanoseconds, or None when the moment has not come (a nullable BIGINT)
NsOrNull = Annotated[int | None, msgspec.Meta(extra={"sql": "BIGINT"})]

#: The signal an engine core sends its API process when it is asked to stop (SIGTERM to the core
#: alone, or to the server's whole process group): a request to drain, never a second stop
#: signal. Engine cores and worker ranks ignore SIGINT and SIGTERM themselves; the API process
#: decides when they stop (``DrainingServer``, engine/api/shutdown.py), and they exit when it is gone.
DRAIN_REQUEST_SIGNAL = signal.SIGUSR1

#: An ``engine_steps`` row with tokens; rows without are an idle engine's heartbeats
#: (:meth:`EngineCore.idle_record`), which count for KV use and queue depth but not as steps.
WORKING_STEP_SQL = "num_prefill_tokens + num_decode_tokens > 0"

#: Tokens per KV block unless ``--block-size`` says otherwise. The prompt's per-block content
#: hashes on the ``requests`` row use the engine's block size (the ``config`` event has it).
DEFAULT_BLOCK_SIZE = 16

#: A request completed when it finished by a stop condition or its length limit and was answered
#: without error: the server's success, the only requests goodput counts.
COMPLETED_FINISH_REASONS = ("stop", "length")


def is_completed(finish_reason: str | None, error_type: str | None) -> bool:
    """Whether a request with this outcome completed (see :data:`COMPLETED_FINISH_REASONS`)."""
    return finish_reason in COMPLETED_FINISH_REASONS and error_type is None


#: Share of the KV pool still held with nothing running or waiting that counts as a block leak
#: (symptom case C05): ``/health`` turns ``degraded`` and the ``kv_block_leak`` rule fires. 5 %
#: leaves room for the one partly filled block a request may keep between steps.
IDLE_KV_LEAK_SHARE = 0.05


class RequestEvent(msgspec.Struct):
    """Something that happened to a request in a step (becomes a span event).

    ``name`` is one of ``chunk`` (a prefill chunk was computed; attrs: tokens),
    ``preempted`` (blocks taken back; attrs: recompute_tokens, by: the request whose block
    allocation needed them, absent for an operator's drill), ``resumed``, ``aborted``,
    ``kv_transfer`` (a decode core adopted the request's KV from a prefill core; attrs:
    bytes, ms (the transfer; None when not timed), waited_ms (arrival to adoption: the wait
    for room), from, to).
    ``time_ns`` is wall-clock ns; ``step_id`` the engine step it happened in.
    """

    name: str
    step_id: int
    time_ns: int
    attrs: dict[str, Any] = {}


#: Why a prompt block was not served from the prefix cache when its request was first admitted
#: (:class:`CacheMiss`), in the order ``BlockManager.explain_misses`` tests them.
CACHE_MISS_REASONS = {
    "caching_off": "prefix caching is off",
    "partial_block": "shorter than one block: the cache keeps whole blocks only",
    "last_token": "holds the prompt's last token, which is always computed (its logits are needed)",
    "after_miss": "cached, but an earlier block missed: only a prefix is reused",
    "evicted": "cached once, evicted (taken for another request's allocation)",
    "other_tenant": "cached under another tenant's salt (prefix_cache_scope tenant)",
    "never_seen": "no request computed this prefix before",
}

#: Why the scheduler stopped admitting waiting requests in a step (``StepRecord.admit_stop``).
ADMIT_STOP_REASONS = {
    "budget": "the step's token budget was used (running requests' chunks come first)",
    "kv_blocks": "the KV pool had no room (allocation failed, the watermark, or a preemption)",
    "max_num_seqs": "the running batch was at --max-num-seqs",
}


class CacheMiss(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A run of ``num_blocks`` prompt blocks from ``first_block`` (0 = the prompt's first
    block) that the prefix cache did not serve, and why (:data:`CACHE_MISS_REASONS`).
    ``evicted``: ``time_ns`` (wall clock) of the run's first block's eviction and ``by`` (the
    request whose allocation took it; None for a cache reset); ``other_tenant``: ``tenant``,
    the tenant that computed the same tokens."""

    reason: str
    first_block: int
    num_blocks: int = 1
    time_ns: int | None = None
    by: str | None = None
    tenant: str | None = None


class EngineError(msgspec.Struct, frozen=True):
    """An error as a value: ``error_type`` is the stable code the API's error body and the
    store's ``error_type`` column use (``context_length_exceeded``, ``invalid_request``,
    ``nan_logits``, ``engine_start_failed``); ``message`` is one user-facing line."""

    error_type: str
    message: str


class RequestStats(msgspec.Struct, kw_only=True):
    """What the engine counts about one request, cumulative over its life: one struct from the
    engine's ``Request`` (``engine/request.py``) through every :class:`RequestOutput` and the
    API's timeline to the store, where each field is the ``requests`` column of the same name
    (``telemetry/rows.py``: ``RequestRow`` inherits this class).

    Adding a per-request column is a field here (with a default, so dumps from before it read
    it as NULL) and the engine line that sets it (docs/how-to-add.md). A request the engine
    never took keeps the defaults (``input_tokens`` from the API's tokenizer)."""

    input_tokens: int = 0
    """prompt tokens"""
    output_tokens: int = 0
    """tokens sampled so far"""
    cached_tokens: int = 0
    """prompt tokens the prefix cache served at its first admission"""
    preemptions: int = 0
    """times it lost its KV blocks to another request (and was queued again)"""
    recomputed_tokens: int = 0
    """tokens computed again after its preemptions"""
    spec_drafts: int = 0
    """speculative decoding: decode steps that verified draft tokens for it (0 with speculation
    off)"""
    spec_draft_tokens: int = 0
    """draft tokens verified for it"""
    spec_accepted_tokens: int = 0
    """draft tokens accepted (output tokens that cost no step of their own)"""
    queued_ns: NsOrNull = None
    """the engine took it (its ``add_request``)"""
    scheduled_ns: NsOrNull = None
    """first scheduled: its first prefill chunk's step"""
    first_token_ns: NsOrNull = None
    """its first token sampled"""
    kv_blocks: int = 0
    """KV-cache blocks it held at its peak (prefix-cache hits included)"""


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request (a delta), with its counters so far.

    ``finish_reason`` is ``stop`` | ``length`` | ``abort`` | ``error`` once ``finished``;
    ``stop_reason`` is the stop string or stop token that ended it (None for EOS/length);
    ``error_type`` is e.g. ``nan_logits``. ``events`` are the request's events since its last
    output (chunks, preemptions, resumes, abort). ``token_ns`` holds one wall-clock time per
    token in ``new_token_ids``. ``stats`` is a copy of the request's :class:`RequestStats` as
    this step left it.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ns: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    error_type: str | None
    error_message: str | None
    stats: RequestStats
    arrival_ns: int
    finished_ns: int | None
    events: list[RequestEvent] = []
    cache_misses: list[CacheMiss] | None = None
    """the prompt blocks the prefix cache did not serve at the request's first admission, with
    why (runs of blocks; every admitted request has at least the block of its last token); on
    the first output after that admission only, None on the others"""


class StepRecord(msgspec.Struct, kw_only=True):
    """One scheduler iteration (one forward) — and, field for field, one ``engine_steps`` row.

    Required fields are ``NOT NULL`` columns; fields with a default are nullable (a dump from
    before a field existed reads as NULL there). Times: ``start_ns``/``end_ns`` wall clock;
    the ``*_ms`` durations come from a monotonic clock. An idle heartbeat has no tokens and zero
    durations (:data:`WORKING_STEP_SQL` tells the two apart).
    """

    step_id: BigInt
    engine_pid: int | None = None
    start_ns: Ns
    end_ns: Ns
    schedule_ms: float = 0.0
    """drafting (speculative decoding), scheduling and the step's cost arithmetic"""
    forward_ms: float = 0.0
    """the model's forward and the logits' copy to the host (until 2026-12-01 it also held
    ``prepare_ms``)"""
    sample_ms: float = 0.0
    """sampling, draft verification, token bookkeeping and stop checks (until 2026-12-01 it
    also held ``detokenize_ms``)"""
    prepare_ms: float = 0.0
    """laying the step out for the model: input ids, positions, slot mapping, block tables
    and the logit rows (NULL in dumps from before the field)"""
    detokenize_ms: float = 0.0
    """incremental detokenization of this step's tokens, stop-string checks and text deltas
    (NULL in dumps from before the field)"""
    num_running: int = 0
    num_waiting: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_chunks: int = 0
    num_sampled: int = 0
    """tokens produced in this step"""
    num_preempted: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    prefix_hit_tokens: int = 0
    allocation_failures: int = 0
    num_finished: int = 0
    weight_bytes: BigInt = 0
    """bytes of weights this step read: every decoder linear layer once in its storage dtype,
    plus the LM head when a row sampled (``engine/roofline.py``)"""
    kv_read_bytes: BigInt = 0
    """KV-cache bytes attention read: each chunk's context (start + new tokens) x KV bytes per
    token over all layers"""
    kv_write_bytes: BigInt = 0
    """KV-cache bytes written: new tokens x KV bytes per token over all layers"""
    flops: BigInt = 0
    """FLOP of the forward: linear layers 2 x params x tokens (LM head per sampled row) plus
    attention QK^T and PV; intensity, GB/s and GFLOP/s over ``forward_ms`` are SQL in
    ``telemetry/schema.py`` (``ROOFLINE_*``)"""
    num_drafts: int = 0
    """requests that verified draft tokens in this step (speculative decoding)"""
    num_draft_tokens: int = 0
    """draft tokens verified in this step (part of ``num_decode_tokens``)"""
    num_accepted_tokens: int = 0
    """draft tokens accepted in this step"""
    num_accepted_tokens_per_pos: list[int] = []
    """accepted draft tokens by draft position (index 0 = the first draft token), this step"""
    output_send_ms: float | None = None
    """from the step's end to the API process holding its outputs: encoding, the ZeroMQ hop,
    decoding and the API's event loop getting to the message (wall clock, one host); set by the
    API on receipt (``engine/async_engine.py``), NULL in-process (``LLM``) and in dumps from
    before the field"""
    stream_write_ms: float | None = None
    """from the API process holding the step's outputs (``output_send_ms``'s end) to the last
    stream given one having written it to its socket, event-loop waits included
    (``engine/stream_writes.py``); 0 when no stream had one; NULL when a stream had not
    written it after 10 s (a client that stopped reading) or the engine stopped first,
    in-process (``LLM``) and in dumps from before the field"""
    compiled: bool | None = None
    """the forward ran the compiled decode step (``engine/models/native_step.py``) instead of
    the eager module forward; NULL in dumps from before the field"""
    replica: int | None = None
    """the data-parallel replica (engine core, ``0 .. --data-parallel-size - 1``) that ran the
    step, stamped by the API process on receipt (``engine/api/worker.py``); NULL in-process
    (``LLM``) and in dumps from before the field"""
    role: str | None = None
    """prefill/decode disaggregation: the side of the engine core that ran the step
    (``"prefill"`` or ``"decode"``), stamped by the API process on receipt with ``replica``;
    NULL when colocated, in-process (``LLM``) and in dumps from before the field"""
    num_kv_waiting: int | None = None
    """prefill/decode disaggregation, decode side: requests prefilled and handed off whose KV
    has arrived but waits for room in this core's pool or batch (back-pressure, the
    ``kv_wait`` state: ``requests.kv_wait_ms``); NULL on the prefill side, colocated and in
    dumps from before the field"""
    compute_precision: str | None = None
    """what the step's linear layers multiplied in: ``int8`` where int8 compute took its rows
    (``engine/int8_compute.py``: quantized layers, rows above their GEMV cut-over), else the
    activations' dtype (``float32``, ``bfloat16``); NULL for an idle heartbeat and in dumps
    from before the field"""
    cpu_threads: int | None = None
    """the forward's CPU threads this step (``engine/cpu_threads.py``: the cores other
    processes leave free, or ``--cpu-threads``); NULL on CUDA and in dumps from before the
    field"""
    collective_ms: float | None = None
    """tensor parallelism: rank 0's wall time in collectives this step (sending the step's
    inputs to the other ranks and the row-parallel layers' all-reduces; part of
    ``forward_ms``); NULL on one rank and in dumps from before the field"""
    collective_bytes: BigInt | None = None
    """tensor parallelism: bytes rank 0 all-reduced this step (two ``[tokens, hidden]``
    tensors a layer; the input broadcast not counted); NULL on one rank"""
    rank_compute_ms: list[float] | None = None
    """tensor parallelism: each rank's mean forward time outside collectives over the last 16
    steps (``engine/parallel/workers.py``: ``RankTimes``), ms, index = rank; set on every 16th
    step, NULL on the others, without tensor parallelism and in dumps from before the field.
    A rank the others wait for shows the longest"""
    req_ids: list[str] | None = None
    """the requests this step computed tokens for, in the step's order (running requests
    first, then those admitted); NULL for an idle heartbeat and in dumps from before the field"""
    req_tokens: list[int] | None = None
    """tokens computed this step for each of ``req_ids`` (a prefill chunk's tokens, 1 for a
    decode, 1 + K for a decode verifying K drafts)"""
    req_prefill: list[bool] | None = None
    """for each of ``req_ids``: a prefill chunk (a prompt, or its recompute after a
    preemption) rather than a decode"""
    admit_stop: str | None = None
    """why the scheduler stopped admitting waiting requests this step
    (:data:`ADMIT_STOP_REASONS`: ``budget``, ``kv_blocks``, ``max_num_seqs``); NULL when none
    was left waiting, for an idle heartbeat and in dumps from before the field"""
    oldest_wait_ms: float | None = None
    """the queue as it stands at the step's start, before its admission: how long the
    longest-waiting request not yet scheduled has waited since the engine queued it (its queue
    time so far, part of its TTFT); NULL when none waits and in dumps from before the field. A
    live store sees a queue form here before any of its requests has ended"""
    oldest_wait_id: str | None = None
    """that request's id (still in flight while it waits)"""
    oldest_wait_prompt_tokens: int | None = None
    """that request's prompt tokens"""


class EngineStats(msgspec.Struct, kw_only=True):
    """Queue depth and KV use right now (``/health``, ``/metrics``)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    max_model_len: int
    block_size: int
    cpu_threads: int = 0  # the forward's CPU threads now (0 on CUDA)


# ----- API → engine -----
class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    """Queue a request (``EngineCore.add_request``'s arguments)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    tenant: str = ""
    arrival_ns: int | None = None
    # disaggregation (engine/parallel/pd_link.py): ``hand_off`` on the prefill core (end after
    # the first token, send the KV to the decode core); ``adopt`` on the decode core (stream
    # this request once its hand-off arrives; the prompt and params come with it)
    hand_off: bool = False
    adopt: bool = False
    decode_rank: int | None = None
    """``hand_off``: the KV link rank of the decode core the router chose for it (None: the
    first decode core)"""


class AbortRequests(msgspec.Struct, tag="abort"):
    """Abort these requests now; their blocks are freed before the next step."""

    request_ids: list[str]


class StatsQuery(msgspec.Struct, tag="stats"):
    """Ask for a :class:`StatsReply`."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the engine core process."""


class RemoteStart(msgspec.Struct, tag="remote_start", kw_only=True):
    """API → the host of an engine core that runs on another machine (``tokenmill
    pd-worker``): start the core with this configuration (``EngineConfig.to_dict()``; the
    worker puts its own copy of the model folder in) and this part in ``--disaggregation``
    (``core_process.run_engine_core``'s ``pd``). Sent again each time the API (re)starts it."""

    config: dict[str, Any]
    pd: dict[str, Any]


EngineInput = AddRequest | AbortRequests | StatsQuery | Shutdown | RemoteStart


# ----- engine → API -----
class EngineReady(msgspec.Struct, tag="ready", kw_only=True):
    """The model is loaded and the core takes requests.

    ``model_info`` holds the memory and roofline facts of the loaded model (``EngineCore.
    model_info`` plus the device peaks): ``weight_bytes_total``, ``weight_bytes_by_dtype``
    (bytes by storage dtype, int4 as ``int4``), ``kv_cache_bytes``, ``kv_bytes_per_token``,
    ``model_dtype``, ``engine_device``, ``device_name``, ``device_peak_gbps`` (GB/s),
    ``device_peak_gflops`` (GFLOP/s) and their ``*_source``; empty from an older sender.
    """

    pid: int
    started_ns: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    config: dict[str, Any]
    stats: EngineStats
    model_info: dict[str, Any] = {}


class EngineOutputs(msgspec.Struct, tag="outputs"):
    """One step's deltas and its record (``step`` None for the outputs of an abort)."""

    outputs: list[RequestOutput]
    step: StepRecord | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent every ``IDLE_POLL_MS`` while idle: fresh stats and an idle step record."""

    stats: EngineStats
    step: StepRecord


class StatsReply(msgspec.Struct, tag="stats_reply"):
    """The answer to :class:`StatsQuery`."""

    stats: EngineStats


class RequestFailed(msgspec.Struct, tag="request_failed"):
    """An :class:`AddRequest` the engine refused (bad input, can never fit)."""

    request_id: str
    error: EngineError


class EngineFatal(msgspec.Struct, tag="fatal"):
    """The engine core cannot go on (or could not start); it exits after sending this."""

    error: EngineError


EngineOutput = EngineReady | EngineOutputs | Heartbeat | StatsReply | RequestFailed | EngineFatal

_encoder = msgspec.msgpack.Encoder()
INPUT_DECODER = msgspec.msgpack.Decoder(EngineInput)
OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineOutput)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of one message (decode with :data:`INPUT_DECODER` / :data:`OUTPUT_DECODER`)."""
    return _encoder.encode(msg)


def to_row(record: msgspec.Struct) -> dict[str, Any]:
    """A Struct as a ``{field: value}`` dict in field order (a store row)."""
    return msgspec.structs.asdict(record)
