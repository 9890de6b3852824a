"""The proxy's own Prometheus series (``GET /metrics`` on the proxy), what its clients saw of
the upstream, labelled by upstream only (never by tenant):

- ``tokenmill_proxy_requests_total{upstream, code}``: requests answered, by HTTP status
  (``error`` where none was sent);
- ``tokenmill_proxy_requests_in_flight{upstream}``: requests between arrival and their row;
- ``tokenmill_proxy_time_to_first_token_seconds``, ``tokenmill_proxy_inter_token_latency_seconds``
  (each gap between two output events) and ``tokenmill_proxy_e2e_request_latency_seconds``
  histograms, as the proxy measured them (``observe.py``), with the server's buckets;
- ``tokenmill_proxy_prompt_tokens_total`` and ``tokenmill_proxy_generation_tokens_total``;
- ``tokenmill_proxy_telemetry_dropped_total{upstream, reason}``: what the proxy could not record
  of an answer it relayed unchanged (``usage_not_a_count``: a ``usage`` count that is not a whole
  number in 0..2^31-1; ``unreadable_event``/``unreadable_body``; ``event_too_long``;
  ``encoded_body``: an encoding it cannot read; ``record_failed``: a row it could not build).

Their prefix is not an engine's: a scraper pointed at a proxy reads it as no known engine
(``telemetry/engine_metrics.py``), never as a tokenmill server.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from tokenmill.telemetry.metrics import REQUEST_LATENCY_BUCKETS_S, TPOT_BUCKETS_S, TTFT_BUCKETS_S

from .observe import Exchange

PREFIX = "tokenmill_proxy_"


class ProxyMetrics:
    """The series above in a registry of their own."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.registry = CollectorRegistry()
        r, up = self.registry, ("upstream",)
        ProcessCollector(registry=r)  # the proxy process's process_* series
        self.requests = Counter(PREFIX + "requests", "Requests answered, by HTTP status.",
                                (*up, "code"), registry=r)  # fmt: skip
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Requests not yet answered.", up,
                               registry=r)  # fmt: skip
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "TTFT as the proxy saw it.", up, buckets=TTFT_BUCKETS_S,
                              registry=r)  # fmt: skip
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gaps between output events, as the proxy saw them.", up,
                             buckets=TPOT_BUCKETS_S, registry=r)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival to the answer's end, as the proxy saw it.", up,
                             buckets=REQUEST_LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens (upstream usage or "
                              "the proxy's count).", up, registry=r)  # fmt: skip
        self.generation = Counter(PREFIX + "generation_tokens", "Output tokens.", up,
                                  registry=r)  # fmt: skip
        self.telemetry_dropped = Counter(PREFIX + "telemetry_dropped", "What could not be "
                                         "recorded of answers relayed unchanged, by reason.",
                                         (*up, "reason"), registry=r)  # fmt: skip

    def arrived(self) -> None:
        self.in_flight.labels(self.upstream).inc()

    def left(self) -> None:
        """A request is over (its row is next): out of the in-flight gauge."""
        self.in_flight.labels(self.upstream).dec()

    def dropped(self, reason: str, n: int = 1) -> None:
        self.telemetry_dropped.labels(self.upstream, reason).inc(n)

    def answered(self, ex: Exchange, row: dict) -> None:
        """One request's row written: count it and its latencies."""
        up = self.upstream
        self.requests.labels(up, str(ex.http_status) if ex.http_status else "error").inc()
        if row.get("ttft_ms") is not None:
            self.ttft.labels(up).observe(row["ttft_ms"] / 1e3)
        for gap in ex.itl_ms():
            self.itl.labels(up).observe(gap / 1e3)
        self.e2e.labels(up).observe(row["e2e_ms"] / 1e3)
        self.prompt.labels(up).inc(row.get("input_tokens") or 0)
        self.generation.labels(up).inc(row.get("output_tokens") or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
