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
"""

from __future__ import annotations

import os

PROTOCOLS = ("http/protobuf", "grpc")
PROVIDER = "tokenmill"

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


def export_configured(endpoint: str | None, signal: str) -> bool:
    """Whether anything says where to send ``signal``: ``--otlp-endpoint`` or the variables."""
    return bool(
        endpoint
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


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
    if not endpoint:
        return exporter()
    if grpc:  # an http:// URL is a plaintext channel; https:// (or host:port) uses TLS
        return exporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    return exporter(endpoint=endpoint.rstrip("/") + path)


def span_exporter(endpoint: str | None):
    """The span exporter the variables (and ``endpoint``) ask for."""
    return _exporter("traces", endpoint)


def metric_exporter(endpoint: str | None):
    """The metric exporter the variables (and ``endpoint``) ask for."""
    return _exporter("metrics", endpoint)


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
        self.provider = MeterProvider(resource=resource, metric_readers=[reader], views=views)
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

    def shutdown(self) -> None:
        self.provider.shutdown()


__all__ = [
    "GENAI_SERVER_HISTOGRAMS",
    "PROTOCOLS",
    "GenAIServerMetrics",
    "OTLPConfigError",
    "export_configured",
    "metric_exporter",
    "otlp_protocol",
    "span_exporter",
]
