"""``ServerState``: what the routes share, and how a finished request is metered and recorded."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ..messages import RequestOutput
from .gateway import Gateway
from .handle import EngineHandle
from .stations import AdmissionStation, MeteringStation, TokenizeStation, billed_usage
from .timeline import RequestTimeline
from .worker import ENGINE_STALL_DEGRADED_S, ENGINE_STALL_UNAVAILABLE_S

log = logging.getLogger("tokenmill.engine.api.app")  # the app's logger, as before the split
#: How long (s) a request cut before its end (client gone, server shutdown) waits for the
#: engine's final record of it (sent in the step the abort arrives) before it is recorded
#: with the tokens seen so far.
ENGINE_FINAL_WAIT_S = 5.0
#: Engine final records kept for responses not over yet (a bound, never reached in practice).
MAX_EARLY_FINALS = 4096
SHUTDOWN_MESSAGE = "the server is shutting down; this request was stopped"
DRAINING_MESSAGE = "the server is shutting down and takes no new requests; retry on another server"
#: Retry-After (s) of a request refused while the server drains
DRAIN_RETRY_S = 5
# the requests in flight without their first token are sampled this often into the trace store
# (waiting_samples): a queue shows there while it stands, not only once its requests end
WAITING_SAMPLE_S = 1.0


@dataclass
class ServerState:
    """Everything the routes share."""

    worker: EngineHandle  # one engine core, replicas, or prefill/decode pools
    gateway: Gateway
    tokenize: TokenizeStation
    admission: AdmissionStation
    metering: MeteringStation
    model_name: str
    max_body_bytes: int
    block_size: int  # the engine's tokens per KV block (prompt hashes use the same blocks)
    # telemetry (tokenmill.telemetry.Telemetry): on_request(timeline), on_step(record),
    # metrics.render()/set_engine_state(), health(). The API depends only on these calls.
    telemetry: object
    started: float = field(default_factory=time.time)
    trace_content: bool = False
    fault_stream_delay_s: float = (
        0.0  # fault drill (case C03): wait before each chunk but the first
    )
    # /health: an engine silent this long (s) is degraded, and unavailable (503) past the second
    engine_stall_degraded_s: float = ENGINE_STALL_DEGRADED_S
    engine_stall_unavailable_s: float = ENGINE_STALL_UNAVAILABLE_S
    # /metrics renders in a worker thread; False renders on the event loop (the behaviour before,
    # kept only so benchmarks/metrics_scrape.py can measure the difference in one run)
    metrics_off_loop: bool = True
    shutting_down: bool = False
    # SIGTERM's drain: /health/ready answers 503 and new requests 503 + Retry-After while the
    # requests in flight finish (shutdown.DrainingServer)
    draining: bool = False
    access_log: bool = False  # --access-log: one tokenmill.access line per completion request
    open_requests: int = 0  # completion requests whose response is not over yet
    # engine ids of requests whose stream was left (client gone, shutdown) before the engine's
    # final record of them: finish() waits for that record (see on_engine_final)
    unsettled: set[str] = field(default_factory=set)
    _early_finals: dict[str, RequestOutput] = field(default_factory=dict)
    _awaiting: dict[str, tuple] = field(default_factory=dict)
    # the timelines of the completion requests whose response is not over yet
    live: dict[int, RequestTimeline] = field(default_factory=dict)

    def waiting_rows(self, now_ns: int) -> list[dict]:
        """``waiting_samples`` rows (``telemetry/rows.py``: ``WaitingSampleRow``): every live
        request past tokenize without its first token yet, and how long it has waited."""
        return [
            {
                "time_ns": now_ns,
                "request_id": tl.request_id,
                "arrival_ns": tl.arrival_ns,
                "wait_ms": (now_ns - tl.arrival_ns) / 1e6,
                "prompt_tokens": tl.stats.input_tokens,
                "scheduled": tl.stats.scheduled_ns is not None,
                "tenant": tl.tenant,
                "replica": tl.replica,
            }
            for tl in list(self.live.values())
            if tl.request_id is not None
            and tl.tokenize_end_ns is not None
            and tl.stats.first_token_ns is None
            and tl.error_type is None
        ]

    async def sample_waiting(self, interval_s: float = WAITING_SAMPLE_S) -> None:
        """Hand telemetry a ``waiting_samples`` sample every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                rows = self.waiting_rows(time.time_ns())
                if rows:
                    self.telemetry.on_waiting(rows)
            except Exception:  # telemetry must never stop serving
                log.exception("waiting sample failed")

    def finish(self, tl: RequestTimeline) -> None:
        """The response is over: meter the request and hand its timeline to telemetry.

        A request cut before the engine's final record of it (the client left, the server is
        shutting down) is recorded when that record arrives (:meth:`on_engine_final`: the tokens
        made up to the step the abort arrived in), or after :data:`ENGINE_FINAL_WAIT_S` seconds
        with the tokens seen so far. Must run in the event loop."""
        rid = tl.request_id
        final = self._early_finals.pop(rid, None) if rid else None
        if final is not None:
            tl.observe(final)
        elif rid in self.unsettled:
            loop = asyncio.get_running_loop()
            self._awaiting[rid] = (tl, loop.call_later(ENGINE_FINAL_WAIT_S, self._settle, rid))
            return
        self._record(tl)

    def on_engine_final(self, out: RequestOutput) -> None:
        """Abandoned-output listener (the engine worker's): the engine's final record of a
        request whose stream was left early; its timeline is recorded with it."""
        rid = out.request_id
        if rid not in self.unsettled:
            return
        if rid in self._awaiting:
            self._settle(rid, out)
            return
        self.unsettled.discard(rid)  # the response is not over yet: finish() takes it
        self._early_finals[rid] = out
        while len(self._early_finals) > MAX_EARLY_FINALS:
            self._early_finals.pop(next(iter(self._early_finals)))

    def _settle(self, rid: str, out: RequestOutput | None = None) -> None:
        self.unsettled.discard(rid)
        entry = self._awaiting.pop(rid, None)
        if entry is None:
            return
        tl, timer = entry
        timer.cancel()
        if out is not None:
            tl.observe(out)
        self._record(tl)

    @property
    def unrecorded(self) -> int:
        """Completion requests not recorded yet: responses still open, and finished ones
        waiting for the engine's final record of their request."""
        return self.open_requests + len(self._awaiting)

    def record_awaiting(self) -> None:
        """Record every request still waiting for its engine record, with what it has (the
        engine is stopping)."""
        for rid in list(self._awaiting):
            self._settle(rid)

    def begin_shutdown(self, reason: str = SHUTDOWN_MESSAGE) -> int | None:
        """Stop serving: new requests get 503, every open stream ends now with a
        ``server_shutdown`` error (its request aborted in the engine and recorded with error
        type ``server_shutdown``). Returns the number of requests stopped, or None when the
        shutdown had already begun."""
        if self.shutting_down:
            return None
        self.shutting_down = True
        return self.worker.stop_streams(reason)

    def _record(self, tl: RequestTimeline) -> None:
        """Metering, then the finished timeline to telemetry (which must never fail us).

        Every request the engine queued gets one usage (its metering record), also when it was
        cut (:func:`billed_usage`); one that never reached the engine gets none."""
        tl.metering_start_ns = time.time_ns()
        if tl.usage is None and tl.stats.queued_ns is not None:
            tl.usage = billed_usage(
                tl.stats.input_tokens or 0,
                tl.stats.output_tokens if tl.stats.first_token_ns is not None else 0,
                tl.stats.cached_tokens,
                prefill_started=tl.stats.scheduled_ns is not None,
            )
        if tl.usage is not None and tl.tenant is not None:
            u = tl.usage
            self.metering.record(
                tl.tenant,
                u["prompt_tokens"],
                u["completion_tokens"],
                u["prompt_tokens_details"]["cached_tokens"],
            )
        tl.metering_end_ns = time.time_ns()
        if tl.usage is None:
            tl.metering_start_ns = tl.metering_end_ns = None  # nothing was metered
        try:
            self.telemetry.on_request(tl)
        except Exception:
            log.exception("telemetry failed on request %s", tl.request_id)
        if self.access_log:
            _log_access(tl)


access = logging.getLogger("tokenmill.access")


def _log_access(tl: RequestTimeline) -> None:
    """One access-log line: method, path, status, duration, ids and tenant (``engine/logs.py``
    puts the ids in a JSON line's own keys)."""
    end = tl.last_byte_ns or tl.metering_end_ns or time.time_ns()
    ms = (end - tl.arrival_ns) / 1e6
    rid = tl.request_id or tl.client_request_id
    access.info(
        "%s %s %s %.0f ms request_id=%s tenant=%s",
        tl.method, tl.path, tl.http_status, ms, rid, tl.tenant,
        extra={"request_id": rid, "trace_id": tl.trace_id, "tenant": tl.tenant,
               "method": tl.method, "path": tl.path, "status": tl.http_status,
               "duration_ms": round(ms, 1)},
    )  # fmt: skip
