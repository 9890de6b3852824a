"""OTLP export: the exporters for spans and metrics, chosen by the standard ``OTEL_*``
variables, and the GenAI server metrics of the OpenTelemetry semantic conventions.

Protocol: ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL`` or ``OTEL_EXPORTER_OTLP_PROTOCOL``,
``http/protobuf`` (the default) or ``grpc`` (``pip install 'tokenmill[grpc]'``); anything else is
a one-line error at start. Endpoint: ``--otlp-endpoint`` (``http://host:4318`` for HTTP, the
collector's ``host:4317`` URL for gRPC), else the SDK's own ``OTEL_EXPORTER_OTLP_*ENDPOINT``
variables; headers, timeouts and certificates come from the SDK's variables too.

Metrics (when an endpoint is configured): the conventions' model-server histograms, in seconds,
with their advised bucket boundaries (semantic-conventions ``docs/gen-ai/gen-ai-metrics.md``,
read at v1.41.0), one observation per request as the ``requests`` row states it:

- ``gen_ai.server.time_to_first_token`` — TTFT (``ttft_ms``), successful responses;
- ``gen_ai.server.time_per_output_token`` — TPOT (``tpot_ms``: decode time over the output
  tokens after the first), successful responses with two or more output tokens;
- ``gen_ai.server.request.duration`` — E2E (``e2e_ms``), every request, ``error.type`` on a
  failed one.

Attributes: ``gen_ai.operation.name`` (``chat`` | ``text_completion``), ``gen_ai.provider.name``
(``tokenmill``), ``gen_ai.request.model``; the resource is the spans' (``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` win).

A collector that is down, refuses or never answers never holds serving or the exit
(:class:`SpanExport`): spans wait in the SDK's ``BatchSpanProcessor`` queue, at most
``OTEL_BSP_MAX_QUEUE_SIZE`` (2048) of them; one export takes at most the export timeout
(``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` / ``OTEL_EXPORTER_OTLP_TIMEOUT``, seconds as the Python
SDK reads them, 10 by default); at exit what is queued gets one try within
``min(--shutdown-timeout, export timeout)`` and the process goes on without waiting further.
Every span that did not reach the collector is counted by reason: ``otlp_export_failed`` (the
collector refused, failed or timed out), ``otlp_queue_full`` (the queue was full),
``otlp_shutdown`` (still queued or in flight when the exit's wait ended). The metrics hold no
queue (the SDK aggregates them); their exit is bounded by the same wait.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Callable

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "grpc")
PROVIDER = "tokenmill"
#: the SDK's defaults: one export's timeout (s) and the span queue's bound (spans)
DEFAULT_EXPORT_TIMEOUT_S = 10.0
DEFAULT_MAX_QUEUE_SIZE = 2048
#: why a span did not reach the collector (``tokenmill_telemetry_dropped_total{reason}``)
DROP_REASONS = ("otlp_export_failed", "otlp_queue_full", "otlp_shutdown")

#: name → (description, explicit bucket boundaries in s), as the conventions advise
GENAI_SERVER_HISTOGRAMS = {
    "gen_ai.server.time_to_first_token": (
        "Time to generate first token for successful responses (TTFT).",
        (
            0.001,
            0.005,
            0.01,
            0.02,
            0.04,
            0.06,
            0.08,
            0.1,
            0.25,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            7.5,
            10.0,
        ),
    ),
    "gen_ai.server.time_per_output_token": (
        "Time per output token generated after the first token for successful responses (TPOT).",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
    ),
    "gen_ai.server.request.duration": (
        "Generative AI server request duration, arrival to the last byte (E2E).",
        (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92),
    ),
}


class OTLPConfigError(ValueError):
    """The OTEL_* variables ask for something we cannot export (one-line reason)."""


def otlp_protocol(signal: str) -> str:
    """The protocol for ``signal`` (``traces`` | ``metrics``) from the standard variables.

    Raises:
        OTLPConfigError: a protocol other than http/protobuf or grpc.
    """
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    name = var if os.environ.get(var) else "OTEL_EXPORTER_OTLP_PROTOCOL"
    value = (os.environ.get(name) or "http/protobuf").strip().lower()
    if value not in PROTOCOLS:
        raise OTLPConfigError(
            f"{name}={value!r}: tokenmill exports OTLP over {' or '.join(PROTOCOLS)}"
        )
    return value


def export_timeout_s(signal: str) -> float:
    """Seconds one export of ``signal`` may take: ``OTEL_EXPORTER_OTLP_{SIGNAL}_TIMEOUT``, else
    ``OTEL_EXPORTER_OTLP_TIMEOUT`` (seconds, as the Python SDK reads both), else 10.

    Raises:
        OTLPConfigError: not a number of seconds above 0.
    """
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT"
    name = var if os.environ.get(var) else "OTEL_EXPORTER_OTLP_TIMEOUT"
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return DEFAULT_EXPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise OTLPConfigError(f"{name}={raw!r}: an export timeout in seconds above 0")
    return value


def max_queue_size() -> int:
    """The span queue's bound: ``OTEL_BSP_MAX_QUEUE_SIZE`` (2048 by default).

    Raises:
        OTLPConfigError: not a whole number above 0.
    """
    raw = (os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE") or "").strip()
    if not raw:
        return DEFAULT_MAX_QUEUE_SIZE
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise OTLPConfigError(f"OTEL_BSP_MAX_QUEUE_SIZE={raw!r}: a number of spans above 0")
    return value


def in_background(fn: Callable[[], object], name: str) -> threading.Thread:
    """``fn()`` on a daemon thread of its own, started: a caller joins it with a deadline and
    goes on without it, and the process exits without waiting for it. An error is one line."""

    def run() -> None:
        try:
            fn()
        except Exception as exc:  # a failed close must not stop the exit
            log.warning("%s failed: %s", name, " ".join(f"{type(exc).__name__}: {exc}".split()))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


#: the exporters ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` may name here
EXPORTER_NAMES = ("otlp", "none")
#: ``OTEL_TRACES_SAMPLER``'s values we read (the SDK's built-in samplers)
SAMPLER_NAMES = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED=true``: nothing leaves the process (our store keeps everything)."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_on(signal: str) -> bool:
    """Whether ``OTEL_{SIGNAL}_EXPORTER`` lets ``signal`` out: ``otlp`` (the default) or ``none``.

    Raises:
        OTLPConfigError: an exporter tokenmill does not have (one line).
    """
    var = f"OTEL_{signal.upper()}_EXPORTER"
    raw = os.environ.get(var, "")
    names = {n.strip().lower() for n in raw.split(",") if n.strip()} or {"otlp"}
    if not names <= set(EXPORTER_NAMES):
        raise OTLPConfigError(
            f"{var}={raw!r}: tokenmill exports over OTLP ('otlp') or not at all ('none')"
        )
    return "otlp" in names


def export_configured(endpoint: str | None, signal: str) -> bool:
    """Whether ``signal`` (``traces`` | ``metrics``) is exported: something says where to
    (``--otlp-endpoint`` or the endpoint variables), and neither ``OTEL_SDK_DISABLED=true`` nor
    ``OTEL_{SIGNAL}_EXPORTER=none`` turns it off. Each signal is switched on its own.

    Raises:
        OTLPConfigError: a bad ``OTEL_{SIGNAL}_EXPORTER`` (one line).
    """
    if sdk_disabled() or not exporter_on(signal):
        return False
    return bool(
        endpoint
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def export_sampler():
    """The sampler that decides which traces are exported, from ``OTEL_TRACES_SAMPLER`` and
    ``OTEL_TRACES_SAMPLER_ARG`` as the SDK reads them (default ``parentbased_always_on``: a
    caller's sampled flag decides its request, every other request is exported). Our store keeps
    every trace whatever it decides.

    Raises:
        OTLPConfigError: a sampler we do not have, or a ratio outside 0..1 (one line).
    """
    from opentelemetry.sdk.trace import sampling

    raw = os.environ.get("OTEL_TRACES_SAMPLER", "")
    name = raw.strip().lower() or "parentbased_always_on"
    if name not in SAMPLER_NAMES:
        raise OTLPConfigError(f"OTEL_TRACES_SAMPLER={raw!r}: one of {', '.join(SAMPLER_NAMES)}")
    root_name = name.removeprefix("parentbased_")
    if root_name == "traceidratio":
        arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = float(arg) if arg else 1.0
        except ValueError:
            ratio = math.nan
        if not 0.0 <= ratio <= 1.0:
            raise OTLPConfigError(
                f"OTEL_TRACES_SAMPLER_ARG={arg!r}: the share of traces to export, 0..1"
            )
        root = sampling.TraceIdRatioBased(ratio)
    else:
        root = sampling.ALWAYS_ON if root_name == "always_on" else sampling.ALWAYS_OFF
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


#: signal → (the exporter module's name in either protocol package, its class, the HTTP path)
_EXPORTERS = {
    "traces": ("trace_exporter", "OTLPSpanExporter", "/v1/traces"),
    "metrics": ("metric_exporter", "OTLPMetricExporter", "/v1/metrics"),
}


def _exporter(signal: str, endpoint: str | None):
    """The OTLP exporter of ``signal`` in the protocol the variables ask for; ``endpoint``
    (``--otlp-endpoint``) or, without it, the SDK's own ``OTEL_EXPORTER_OTLP_*`` variables."""
    import importlib

    module, cls, path = _EXPORTERS[signal]
    grpc = otlp_protocol(signal) == "grpc"
    package = "opentelemetry.exporter.otlp.proto." + ("grpc" if grpc else "http")
    try:
        exporter = getattr(importlib.import_module(f"{package}.{module}"), cls)
    except ImportError:
        if not grpc:
            raise
        raise OTLPConfigError(
            "OTLP over grpc needs the gRPC exporter: pip install 'tokenmill[grpc]'"
        ) from None
    timeout = export_timeout_s(signal)
    if not endpoint:
        return exporter(timeout=timeout)
    if grpc:  # an http:// URL is a plaintext channel; https:// (or host:port) uses TLS
        return exporter(endpoint=endpoint, insecure=endpoint.startswith("http://"), timeout=timeout)
    return exporter(endpoint=endpoint.rstrip("/") + path, timeout=timeout)


def span_exporter(endpoint: str | None):
    """The span exporter the variables (and ``endpoint``) ask for."""
    return _exporter("traces", endpoint)


def metric_exporter(endpoint: str | None):
    """The metric exporter the variables (and ``endpoint``) ask for."""
    return _exporter("metrics", endpoint)


class SpanExport(SpanProcessor):
    """Spans to an OTLP collector through the SDK's ``BatchSpanProcessor``, bounded in memory
    and in time, every span it could not deliver counted (the module docstring).

    The queue's bound is kept here too: a span is handed to the batch processor only while
    fewer than ``max_queue_size`` spans are pending (queued or in an export), else it is
    dropped and counted (``otlp_queue_full``), so the SDK's queue never drops silently and
    ``offered = exported + dropped + pending`` holds at every moment.

    Args:
        endpoint: ``--otlp-endpoint`` or None (the variables).
        exporter: the span exporter (default: :func:`span_exporter` of ``endpoint``).

    Raises:
        OTLPConfigError: a bad ``OTEL_*`` variable (one line).
    """

    def __init__(self, endpoint: str | None, exporter: SpanExporter | None = None):
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.endpoint = endpoint
        self.max_queue_size = max_queue_size()
        self.timeout_s = export_timeout_s("traces")
        self.offered = 0
        self.exported = 0
        self.dropped: Counter = Counter()  # reason -> spans
        self._pending = 0
        self._closed = False  # no new spans
        self._sealed = False  # what was pending is counted; late export results are not
        self._lock = threading.Lock()
        self._told: set[str] = set()
        self._closing: threading.Thread | None = None
        counting = _CountingExporter(self, exporter or span_exporter(endpoint))
        # a queue below the SDK's default batch (512) takes batches of its own size, unless
        # OTEL_BSP_MAX_EXPORT_BATCH_SIZE says otherwise (the SDK refuses a batch over the queue)
        batch = None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else 512
        try:
            self._batch = BatchSpanProcessor(
                counting,
                max_queue_size=self.max_queue_size,
                max_export_batch_size=batch and min(batch, self.max_queue_size),
            )
        except ValueError as exc:  # OTEL_BSP_* that do not fit together
            raise OTLPConfigError(" ".join(str(exc).split())) from None

    @property
    def pending(self) -> int:
        """Spans queued or in an export now."""
        return self._pending

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return  # the batch processor skips it as well
        with self._lock:
            self.offered += 1
            reason = None
            if self._closed:
                reason = "otlp_shutdown"
            elif self._pending >= self.max_queue_size:
                reason = "otlp_queue_full"
            else:
                self._pending += 1
            if reason is not None:
                self.dropped[reason] += 1
        if reason is None:
            self._batch.on_end(span)
        elif reason == "otlp_queue_full":
            self._tell(reason, f"{self.max_queue_size} spans wait already, OTEL_BSP_MAX_QUEUE_SIZE")
        else:
            self._tell(reason, "a span ended after the export closed")

    def _settle(self, n: int, ok: bool, why: str = "") -> None:
        """An export of ``n`` spans returned (``ok``: the collector took them)."""
        with self._lock:
            if self._sealed:
                return  # counted as otlp_shutdown when the exit's wait ended
            self._pending -= n
            if ok:
                self.exported += n
            else:
                self.dropped["otlp_export_failed"] += n
        if not ok:
            self._tell("otlp_export_failed", why or f"no answer within {self.timeout_s:g} s")

    def _tell(self, reason: str, why: str) -> None:
        """Log a reason's first drop (once; the totals come at exit)."""
        if reason in self._told:
            return
        self._told.add(reason)
        log.warning(
            "OTLP export to %s: spans dropped (%s: %s); serving goes on, they are counted in "
            'tokenmill_telemetry_dropped_total{reason="%s"}',
            self.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint",
            reason,
            why,
            reason,
        )

    def begin_close(self) -> threading.Thread:
        """Take no more spans and start the batch processor's shutdown (what is queued gets
        its export) on a daemon thread; returns it, for the caller to join with a deadline
        and then :meth:`seal`."""
        with self._lock:
            self._closed = True
            if self._closing is None:
                self._closing = in_background(self._batch.shutdown, "otlp-span-shutdown")
            return self._closing

    def seal(self) -> None:
        """Count what is still pending as ``otlp_shutdown`` (an export still in flight may
        finish later; its result is not counted again), and log the totals once."""
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
            left, self._pending = self._pending, 0
            if left:
                self.dropped["otlp_shutdown"] += left
            lost = dict(self.dropped)
        if any(lost.values()):
            log.warning(
                "OTLP export to %s: %d of %d spans not delivered (%s)",
                self.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint",
                sum(lost.values()),
                self.offered,
                ", ".join(f"{k} {v}" for k, v in sorted(lost.items()) if v),
            )

    def close(self, timeout_s: float | None = None) -> bool:
        """:meth:`begin_close`, wait at most ``timeout_s`` (default: the export timeout),
        :meth:`seal`. Returns whether the shutdown finished within the wait."""
        thread = self.begin_close()
        thread.join(max(0.0, self.timeout_s if timeout_s is None else timeout_s))
        self.seal()
        return not thread.is_alive()

    def shutdown(self) -> None:
        """The tracer provider's shutdown (also at interpreter exit): :meth:`close`, bounded
        by the export timeout; a no-op once a close has begun (its caller waits for it)."""
        if self._closing is None:
            self.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued; waits at most ``timeout_millis`` (the SDK's own flush does
        not time out). False when the wait ended first or the export is closed."""
        if self._closed:
            return False
        thread = in_background(self._batch.force_flush, "otlp-span-flush")
        thread.join(max(0.0, timeout_millis / 1000))
        return not thread.is_alive()

    def drops(self) -> dict[str, int]:
        """Spans not delivered, by reason (a copy)."""
        with self._lock:
            return {r: n for r, n in self.dropped.items() if n}

    def health(self) -> dict:
        """The export's counts, for ``/health``."""
        with self._lock:
            return {
                "endpoint": self.endpoint,
                "export_timeout_s": self.timeout_s,
                "max_queue_size": self.max_queue_size,
                "pending": self._pending,
                "exported": self.exported,
                "dropped": {r: self.dropped[r] for r in DROP_REASONS if self.dropped[r]},
            }


class _CountingExporter(SpanExporter):
    """The OTLP exporter as the batch processor sees it: each export's result settles its
    spans in the :class:`SpanExport`; an exporter's exception is a failed export (one line);
    after the exit's wait ended (sealed) nothing more is sent."""

    def __init__(self, owner: SpanExport, inner: SpanExporter):
        self.owner, self.inner = owner, inner

    def export(self, spans) -> SpanExportResult:
        if self.owner._sealed:
            return SpanExportResult.FAILURE
        why = ""
        try:
            ok = self.inner.export(spans) is SpanExportResult.SUCCESS
        except Exception as exc:  # an exporter bug is a failed export
            ok, why = False, " ".join(f"{type(exc).__name__}: {exc}".split())
        self.owner._settle(len(spans), ok, why)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class GenAIServerMetrics:
    """The conventions' server histograms (module docstring), exported over OTLP.

    Args:
        resource: the spans' resource (so both signals name the same service).
        endpoint: ``--otlp-endpoint`` or None (the variables).
        interval_s: export period; None: ``OTEL_METRIC_EXPORT_INTERVAL`` (60 s by default).
    """

    def __init__(self, resource, endpoint: str | None, interval_s: float | None = None):
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

        reader = PeriodicExportingMetricReader(
            metric_exporter(endpoint),
            export_interval_millis=None if interval_s is None else interval_s * 1000,
        )
        views = [
            View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(bounds))
            for name, (_, bounds) in GENAI_SERVER_HISTOGRAMS.items()
        ]
        # no exit hook of the SDK's own (an unbounded 30 s wait): Telemetry.close ends it, bounded
        self.provider = MeterProvider(
            resource=resource, metric_readers=[reader], views=views, shutdown_on_exit=False
        )
        meter = self.provider.get_meter("tokenmill")
        self._hist = {
            name: meter.create_histogram(name, unit="s", description=desc)
            for name, (desc, _) in GENAI_SERVER_HISTOGRAMS.items()
        }

    def observe(self, row: dict, model: str) -> None:
        """One finished request, from its ``requests`` row."""
        attrs = {
            "gen_ai.operation.name": "chat" if row.get("endpoint") == "chat" else "text_completion",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": row.get("model") or model,
        }
        failed = row.get("error_type") or (row.get("http_status") or 200) >= 400
        if row.get("e2e_ms") is not None:
            extra = {"error.type": str(row.get("error_type") or row.get("http_status"))}
            self._hist["gen_ai.server.request.duration"].record(
                row["e2e_ms"] / 1000, {**attrs, **extra} if failed else attrs
            )
        if failed:
            return
        if row.get("ttft_ms") is not None:
            self._hist["gen_ai.server.time_to_first_token"].record(row["ttft_ms"] / 1000, attrs)
        if row.get("tpot_ms") is not None and (row.get("output_tokens") or 0) >= 2:
            self._hist["gen_ai.server.time_per_output_token"].record(row["tpot_ms"] / 1000, attrs)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def begin_close(self, timeout_s: float) -> threading.Thread:
        """Export what is left and shut down (the SDK's shutdown, given ``timeout_s``) on a
        daemon thread; returns it, for the caller to join with a deadline."""
        ms = max(0.0, timeout_s) * 1000
        return in_background(lambda: self.provider.shutdown(timeout_millis=ms), "otlp-metrics")

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """:meth:`begin_close` and wait at most ``timeout_s`` (default: the export timeout).
        Returns whether it finished within the wait."""
        timeout_s = export_timeout_s("metrics") if timeout_s is None else timeout_s
        thread = self.begin_close(timeout_s)
        thread.join(max(0.0, timeout_s))
        return not thread.is_alive()


__all__ = [
    "DROP_REASONS",
    "GENAI_SERVER_HISTOGRAMS",
    "PROTOCOLS",
    "GenAIServerMetrics",
    "OTLPConfigError",
    "SpanExport",
    "export_configured",
    "export_sampler",
    "export_timeout_s",
    "in_background",
    "max_queue_size",
    "metric_exporter",
    "otlp_protocol",
    "span_exporter",
]
