"""Telemetry: the one object the server hands its timelines, step records and events to.

It owns the OpenTelemetry tracer provider (spans go to the trace store and, optionally, an OTLP
collector), the DuckDB :class:`TraceStore`, the :class:`DeviceSampler` and the Prometheus
:class:`ServingMetrics`. Nothing here may stop serving: a store that cannot be opened or whose
writer died turns every row into a counted drop, visible in ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tokenmill.engine.api.timeline import RequestTimeline
from tokenmill.engine.messages import StepRecord, to_row

from .dump import DumpError, latest_ns, write_dump
from .metrics import ServingMetrics
from .otlp import (
    GenAIServerMetrics,
    SpanExport,
    export_configured,
    export_sampler,
    export_timeout_s,
)
from .sampler import DeviceSampler
from .spans import (
    SampledExport,
    StoreSpanProcessor,
    emit_trace,
    make_resource,
    make_tracer_provider,
)
from .store import DEFAULT_TRACE_DB, TraceStore, TraceStoreInUse, by_reason

log = logging.getLogger(__name__)


def step_row(record: StepRecord, engine_pid: int | None = None) -> dict:
    """The ``engine_steps`` row of one :class:`StepRecord`: its fields in order (the table is
    generated from the type, see :mod:`.schema`); ``engine_pid`` fills a record without one."""
    row = to_row(record)
    if row["engine_pid"] is None:
        row["engine_pid"] = engine_pid
    return row


def billed_row(row: dict, usage: dict | None) -> dict:
    """The ``requests`` row with its token counts replaced by what the request was metered
    (``usage``, the OpenAI usage object), for the Prometheus token counters: they bill what
    metering billed (a request cut in the queue bills no prompt), and nothing without usage (the
    request never reached the engine). The stored row keeps the request's own counts."""
    if usage is None:
        return {**row, "input_tokens": 0, "output_tokens": 0, "cached_tokens": 0}
    return {
        **row,
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", row.get("cached_tokens")
        ),
    }


class LiveDumps:
    """Trace dumps of a live store for ``GET /admin/dump`` (the API's ``DumpWriter``).

    Args:
        get_store: returns the live :class:`TraceStore`, or None without one (``--no-trace-db``).
    """

    def __init__(self, get_store: Callable[[], TraceStore | None]):
        self._get_store = get_store

    @property
    def can_dump(self) -> bool:
        """Whether there is a store to dump."""
        return self._get_store() is not None

    def latest_ns(self) -> int | None:
        """The live store's latest row (ns; None: no store, or no row yet)."""
        store = self._get_store()
        if store is None:
            return None
        store.flush()
        with store.connection_locked() as con:
            return latest_ns(con) or None

    def write_dump(
        self,
        path: Path,
        since_ns: int | None,
        until_ns: int | None,
        ended_since_ns: int | None = None,
    ) -> None:
        """Flush the store and write a dump of ``[since_ns, until_ns)`` to ``path``. Holds the
        store's lock meanwhile (rows arriving may be dropped and counted if its queue fills).

        Raises:
            RuntimeError: no store, or the dump failed (one-line reason).
        """
        store = self._get_store()
        if store is None:
            raise RuntimeError("trace store disabled (--no-trace-db)")
        store.flush()
        source = f"server {socket.gethostname()} pid {os.getpid()} store {store.path}"
        try:
            with store.connection_locked() as con:
                write_dump(
                    con,
                    path,
                    since_ns=since_ns,
                    until_ns=until_ns,
                    source=source,
                    ended_since_ns=ended_since_ns,
                )
        except DumpError as exc:
            raise RuntimeError(str(exc)) from None


class Telemetry:
    """Spans, store, sampler and metrics of one server.

    Args:
        model_name: the served model name (metric label, span attribute).
        trace_db: the DuckDB file, or None for no store (``--no-trace-db``).
        tracing: build spans at all (False only to measure tracing's own cost).
        otlp_endpoint: an OTLP collector (``http://host:4318``; gRPC with
            ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``, ``telemetry/otlp.py``); None reads the standard
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables.
        device_sample_interval_s: sampler period (s); 0 disables the sampler.
        trace_content: keep prompt and output text on the root span (off by default).
        retention: :class:`TraceStore`'s ``retention_s``, ``max_bytes``, ``archive``,
            ``archive_max_age_s`` and ``archive_max_bytes``.

    Raises:
        TraceStoreInUse: another process holds ``trace_db`` (any other store error is logged
            and the server serves on without a store).
    """

    def __init__(
        self,
        model_name: str,
        *,
        trace_db: str | None = DEFAULT_TRACE_DB,
        tracing: bool = True,
        otlp_endpoint: str | None = None,
        device_sample_interval_s: float = 0.1,
        trace_content: bool = False,
        retention: dict | None = None,
    ):
        self.model_name = model_name
        self.tracing = tracing
        self.trace_content = trace_content
        self.metrics = ServingMetrics(model_name)
        self.store: TraceStore | None = None
        self.store_error: str | None = None
        self.lost: Counter = Counter()  # rows dropped because there is no store at all
        self.trace_db = trace_db
        if trace_db:
            try:
                self.store = TraceStore(trace_db, **(retention or {}))
            except TraceStoreInUse:
                raise  # a second server on the same file: it must not start
            except Exception as exc:  # serve on without a store; count what is lost
                self.store_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log.error("trace store %s unavailable: %s", trace_db, self.store_error)
        self.metrics.set_drops_source(self.drops)
        self.provider = None
        self.tracer = None
        self._otlp = None
        self.otlp_export: SpanExport | None = None
        resource = {
            "service.name": "tokenmill",
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
            "gen_ai.request.model": model_name,
        }
        if tracing:
            self.provider = make_tracer_provider(resource)
            if self.store is not None or self.store_error is not None:
                self.provider.add_span_processor(StoreSpanProcessor(self._submit))
            self._setup_otlp(otlp_endpoint)
            self.tracer = self.provider.get_tracer("tokenmill")
        # TTFT, TPOT and E2E as the GenAI conventions' server metrics, beside Prometheus
        self.genai_metrics: GenAIServerMetrics | None = None
        if export_configured(otlp_endpoint, "metrics"):
            self.genai_metrics = GenAIServerMetrics(
                self.provider.resource if self.provider is not None else make_resource(resource),
                otlp_endpoint,
            )
        self.engine_pid: int | None = None
        self.dumps = LiveDumps(lambda: self.store)
        self.sampler: DeviceSampler | None = None
        self._sample_interval = device_sample_interval_s

    def _setup_otlp(self, endpoint: str | None) -> None:
        """Spans over OTLP (``telemetry/otlp.py``: protocol and endpoint from the OTEL_*
        variables) when anything names a collector. Raises OTLPConfigError (one line)."""
        if not export_configured(endpoint, "traces"):
            return
        # bounded in memory and time, what it could not deliver counted (otlp.SpanExport);
        # the traces OTEL_TRACES_SAMPLER leaves out (an unsampled caller's, by default) stay in
        # our store only (spans.SampledExport)
        self.otlp_export = SpanExport(endpoint)
        self._otlp = SampledExport(self.otlp_export, export_sampler())
        self.provider.add_span_processor(self._otlp)

    # ----- lifecycle -----
    def start(self, engine_pids: list[int] | None = None) -> None:
        """Start the device sampler and record the server start."""
        if self._sample_interval > 0:
            self.sampler = DeviceSampler(
                self._on_sample, interval_s=self._sample_interval, pids=engine_pids
            )
            self.sampler.start()
        self.event("server_start", "info", f"serving {self.model_name}")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the sampler, flush spans, close the store.

        The OTLP export's last flush (spans and metrics at once) waits at most the export
        timeout, and never more than ``timeout_s`` (``--shutdown-timeout``); a collector that
        does not answer by then is left behind (daemon threads, never holding the exit) and the
        spans it did not take are counted (``otlp_shutdown``)."""
        if self.sampler is not None:
            self.sampler.stop()
        deadline = time.monotonic()
        closing = []
        parts = {"traces": self.otlp_export, "metrics": self.genai_metrics}
        signals = [signal for signal, part in parts.items() if part is not None]
        if signals:  # the OTLP flush runs while the store closes
            wait = max(export_timeout_s(s) for s in signals)
            if timeout_s is not None:
                wait = min(wait, max(0.0, timeout_s))
            deadline += wait
            if self.otlp_export is not None:
                closing.append(self.otlp_export.begin_close())
            if self.genai_metrics is not None:
                closing.append(self.genai_metrics.begin_close(wait))  # exports what is left
        if self.provider is not None:
            self.provider.shutdown()  # the store's spans; the OTLP part is closing already
        if self.store is not None:
            self.store.close()
        for thread in closing:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.otlp_export is not None:
            self.otlp_export.seal()

    # ----- inputs -----
    def on_request(self, tl: RequestTimeline) -> None:
        """A finished request: spans → store (+ OTLP), its ``requests`` row, Prometheus."""
        if self.tracer is not None:
            tl.trace_id, row, itl = emit_trace(self.tracer, tl)
            self._submit("requests", row)
        else:
            from .latency import itl_ms
            from .spans import request_end_ns, request_row, station_intervals

            stations = station_intervals(tl)
            row = request_row(tl, "", stations, request_end_ns(tl, stations))
            itl = itl_ms(tl.token_ns)
        self.metrics.observe_request(billed_row(row, tl.usage), itl)
        if self.genai_metrics is not None:
            self.genai_metrics.observe(row, self.model_name)

    def on_step(self, record: StepRecord) -> None:
        """One engine step: an ``engine_steps`` row and the step metrics."""
        row = step_row(record, self.engine_pid)
        if self.tracing:
            self._submit("engine_steps", row)
        self.metrics.observe_step(row)

    def on_waiting(self, rows: list[dict]) -> None:
        """One sample of the requests in flight without their first token: ``waiting_samples``
        rows (``rows.WaitingSampleRow``)."""
        if self.tracing:
            for row in rows:
                self._submit("waiting_samples", row)

    def on_abandoned(self, out) -> None:
        """The engine's final record of a request whose client left: an ``events`` row
        (``request_abort``) with the tokens it produced and the step it was aborted in."""
        step = next((e.step_id for e in out.events if e.name == "aborted"), None)
        self.event(
            "request_abort",
            "info",
            f"{out.request_id} aborted after {out.stats.output_tokens} output tokens",
            request_id=out.request_id,
            output_tokens=out.stats.output_tokens,
            step_id=step,
            finish_reason=out.finish_reason,
        )

    def event(self, kind: str, severity: str = "info", message: str = "", **attrs) -> None:
        """A server or engine event (worker start/crash/restart, config, ...)."""
        self._submit(
            "events",
            {
                "time_ns": time.time_ns(),
                "kind": kind,
                "severity": severity,
                "message": message,
                "attributes": json.dumps(attrs, default=str),
            },
        )

    def _on_sample(self, row: dict) -> None:
        if self.tracing:
            self._submit("device_samples", row)
        self.metrics.observe_device(row)

    def _submit(self, table: str, row: dict) -> bool:
        if self.store is None:
            if self.store_error is not None:
                self.lost[table] += 1
            return False
        return self.store.submit(table, row)

    # ----- outputs -----
    def dropped(self) -> dict[str, int]:
        """Rows dropped per table (every reason together)."""
        out: Counter = Counter()
        for (table, _), n in self.drops().items():
            out[table] += n
        return dict(out)

    def drops(self) -> dict[tuple[str, str], int]:
        """Rows dropped per ``(table, reason)`` (``store.DROP_REASONS``; ``no_store``: the
        store could not be opened)."""
        out = Counter({(table, "no_store"): n for table, n in dict(self.lost).items()})
        if self.store is not None:
            out.update(dict(self.store.drops))
        if self.otlp_export is not None:  # spans the OTLP collector did not take
            out.update({("spans", reason): n for reason, n in self.otlp_export.drops().items()})
        return dict(out)

    def health(self) -> dict:
        """The ``telemetry`` block of ``/health``."""
        dropped = self.dropped()
        store = self.store.health() if self.store is not None else None
        ok = self.store_error is None and (
            store is None or (store["writer_alive"] and store["problem"] is None)
        )
        return {
            "status": "ok" if ok else "degraded",
            "tracing": self.tracing,
            "trace_db": self.trace_db,
            "store": store,
            "store_error": self.store_error or (store or {}).get("error"),
            "dropped_total": sum(dropped.values()),
            "dropped": dropped,
            "dropped_by_reason": by_reason(self.drops()),
            "sampler": None
            if self.sampler is None
            else {"mode": self.sampler.mode, "last_error": self.sampler.last_error},
            "otlp": None if self.otlp_export is None else self.otlp_export.health(),
        }
