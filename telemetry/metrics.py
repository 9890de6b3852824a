"""Prometheus metrics for the server's ``/metrics`` route, mirroring vLLM's metric set.

Every vLLM metric ``vllm:<name>`` that tokenmill has is exported here as ``tokenmill_<name>`` with
the same meaning, unit and bucket boundaries, so a vLLM dashboard translates by a rename. Every
series carries ``model_name`` (the served model, as vLLM does); per-tenant series also carry
``tenant``. The numbers are the ones the telemetry store holds: :class:`ServingMetrics` is fed the
same ``requests``, ``engine_steps`` and ``device_samples`` rows (``telemetry/schema.sql``) that go
to DuckDB, so a scrape and a trace dump agree.

Units: the rows carry milliseconds (``*_ms``); every exported time is in seconds (Prometheus base
unit). One scale per suffix: ``_ratio`` and ``_perc`` are 0..1 (``kv_cache_usage_perc`` keeps
vLLM's name; NVML's 0..100 utilisations are divided by 100 into ``gpu_*_ratio``); the server
process's CPU is ``host_cpu_cores`` (1.0 = one core busy). Monotonic values are counters
(``engine_restarts_total``, ``gpu_energy_joules_total``). ``build_info`` is 1 with the
versions as labels. ``docs/metrics.md`` is generated from this registry
(``python -m tokenmill.telemetry.metrics_doc``) with each metric's vLLM counterpart.

Bucket boundaries: every bound of vLLM's Prometheus logger (``vllm/v1/metrics/loggers.py``,
v0.10) is kept, so an ``le`` a vLLM dashboard names still exists, and the latency ladders add a
fine ladder below 60 s (1, 1.5, 2, 3, 5, 7.5 per decade: neighbours at most 1.67x apart) down to
10 us for queue and prefill time and 100 us for TTFT, ITL/TPOT, e2e and decode time. vLLM's
ladders alone start at 0.3 s for queue/prefill and 10 ms for ITL, so an idle server's 0.1 ms
queue time read as 150 ms through ``histogram_quantile`` (the first bucket interpolates from 0);
with neighbours under 2x apart, a quantile interpolated inside one bucket is within 2x of any
value in it. Iteration tokens keep vLLM's bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric

from tokenmill.engine.messages import COMPLETED_FINISH_REASONS

# no ``*_created`` series beside every counter and histogram: Prometheus' text format has no
# use for them and they double the series a scrape stores (process-wide, for the proxy's too)
disable_created_metrics()

PREFIX = "tokenmill_"

#: Mantissas of the fine ladder: neighbours at most 5/3 apart, so a histogram quantile (linear
#: inside its bucket) is within 2x of the value it estimates.
FINE_MANTISSAS = (1, 1.5, 2, 3, 5, 7.5)
#: The fine ladder stops here (s); above it the (longer) vLLM bounds alone.
FINE_LADDER_TOP_S = 60.0


def fine_ladder(floor_exp: int, top: float = FINE_LADDER_TOP_S) -> tuple[float, ...]:
    """Bounds ``m * 10**e`` for ``m`` in :data:`FINE_MANTISSAS`, from ``10**floor_exp`` up to
    (not including) ``top``, in the unit of ``top`` (seconds here)."""
    out: list[float] = []
    exp = floor_exp
    while True:
        for m in FINE_MANTISSAS:
            bound = float(f"{m}e{exp}")  # the decimal literal: no 1.5000000000000002e-05
            if bound >= top:
                return tuple(out)
            out.append(bound)
        exp += 1


def merge_ladders(*ladders: Iterable[float]) -> tuple[float, ...]:
    """The sorted union of bucket ladders (each bound once)."""
    return tuple(sorted({float(b) for ladder in ladders for b in ladder}))


# vllm:time_to_first_token_seconds (vllm/v1/metrics/loggers.py).
VLLM_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vllm:time_per_output_token_seconds; vLLM uses the same for inter_token_latency_seconds and
# request_time_per_output_token_seconds.
VLLM_TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's request_latency_buckets: e2e_request_latency, request_queue_time, request_prefill_time,
# request_decode_time.
VLLM_REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

#: TTFT: from 100 us (a GPU TTFT of a short prompt is a few ms) plus vLLM's bounds.
TTFT_BUCKETS_S = merge_ladders(fine_ladder(-4), VLLM_TTFT_BUCKETS_S)
#: ITL and TPOT: from 100 us (a small model's decode step on a GPU is ~1-5 ms) plus vLLM's.
TPOT_BUCKETS_S = merge_ladders(fine_ladder(-4), VLLM_TPOT_BUCKETS_S)
#: Queue time and prefill time: from 10 us (an idle server queues for ~0.1 ms) plus vLLM's.
REQUEST_STAGE_BUCKETS_S = merge_ladders(fine_ladder(-5), VLLM_REQUEST_LATENCY_BUCKETS_S)
#: E2E and decode time: from 100 us (a one-token request on a GPU) plus vLLM's.
REQUEST_LATENCY_BUCKETS_S = merge_ladders(fine_ladder(-4), VLLM_REQUEST_LATENCY_BUCKETS_S)
# vllm:iteration_tokens_total uses 1, 8, 16, ..., 16384; tokenmill's steps stop at 8192.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: prompt and output lengths per request: vLLM's 1-2-5 ladder (up to a million tokens)
REQUEST_TOKEN_BUCKETS = (*(m * 10**e for e in range(6) for m in (1, 2, 5)), 1_000_000)

SUCCESS_REASONS = COMPLETED_FINISH_REASONS
UNKNOWN = "unknown"
#: sample keys whose unit the exported gauge scales: NVML's percent to 0..1, the process's
#: CPU percent (100 = one core) to cores
# stored unit → exported base unit (percent → ratio, MHz → hertz)
_SCALE = {
    "dram_bw_util_pct": 0.01,
    "gpu_util_pct": 0.01,
    "cpu_pct": 0.01,
    "sm_clock_mhz": 1e6,
    "mem_clock_mhz": 1e6,
}


def _s(ms: float | None) -> float | None:
    """Milliseconds to seconds; None stays None."""
    return None if ms is None else float(ms) / 1000.0


def _label(value: object) -> str:
    """A label value: the string form, or ``unknown`` for None/empty."""
    if value is None or value == "":
        return UNKNOWN
    return str(value)


class _DropsCollector:
    """``tokenmill_telemetry_dropped_total{model_name,table,reason}``: rows that did not reach
    the trace store, by table and reason (``telemetry/store.py``: ``DROP_REASONS``), and spans
    the OTLP collector did not take (``telemetry/otlp.py``: ``DROP_REASONS``).

    Read at every scrape from ``source() -> {(table, reason): count}`` (the store's own drop
    counter), so the exported number can never drift from the store's. The scrape may run in a
    worker thread while other threads add a first drop; a copy that meets that
    (``RuntimeError``) is retried.
    """

    NAME = PREFIX + "telemetry_dropped"
    HELP = (
        "Telemetry rows that did not reach the trace store, or spans the OTLP collector did not "
        "take, by table and reason (the store's: queue_full, closed, bad_value, disk_full, "
        "unwritable, store_error, unknown_table, no_store; the OTLP export's: "
        "otlp_export_failed, otlp_queue_full, otlp_shutdown)."
    )

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.source: Callable[[], dict[tuple[str, str], int]] | None = None

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.NAME, self.HELP, labels=["model_name", "table", "reason"])

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        fam = self._family()
        counts: dict[tuple[str, str], int] = {}
        for _ in range(3 if self.source is not None else 0):
            try:
                counts = dict(self.source() or {})
                break
            except RuntimeError:  # a first drop landed mid-copy (another thread): again
                continue
            except Exception:  # a failing source must not break the whole scrape
                break
        for table, reason in sorted(counts):
            fam.add_metric([self.model_name, str(table), str(reason)], float(counts[table, reason]))
        return [fam]


class _MetricFactory:
    """Defines metrics in one registry, each labelled ``model_name`` first, and lists each one
    (exported name, type, labels, help) in ``defined`` for ``docs/metrics.md``."""

    def __init__(self, registry: CollectorRegistry, defined: list):
        self.registry = registry
        self.defined = defined

    def histogram(self, name: str, doc: str, buckets) -> Histogram:
        labels = ["model_name"]
        self.defined.append((PREFIX + name, "histogram", tuple(labels), doc))
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, doc: str, labels=("model_name",)) -> Gauge:
        labels = list(labels)
        self.defined.append((PREFIX + name, "gauge", tuple(labels), doc))
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def counter(self, name: str, doc: str, labels=("model_name",)) -> Counter:
        labels = list(labels)
        # prometheus_client appends _total to the exported name.
        self.defined.append((PREFIX + name + "_total", "counter", tuple(labels), doc))
        return Counter(PREFIX + name, doc, labels, registry=self.registry)


class ServingMetrics:
    """The server's Prometheus metrics, in their own :class:`CollectorRegistry`.

    Args:
        model_name: the served model name, the ``model_name`` label on every series.

    Feed it with :meth:`observe_request` (one per finished or rejected request),
    :meth:`observe_step` (engine steps), :meth:`observe_device` (device samples) and
    :meth:`set_engine_state` (the server's periodic refresh); serve :meth:`render`.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        # the engine and step of the record the engine-state gauges came from: a record reaches the
        # listeners once its outputs are written (engine/stream_writes.py), so a slow stream
        # can deliver it after a newer step's or an idle heartbeat's
        self._state_step = (None, -1)  # (engine_pid, step_id): a restarted engine counts anew
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # the API process's process_* series
        # every metric as defined: (exported name, type, labels, help), for docs/metrics.md
        self.defined: list[tuple[str, str, tuple[str, ...], str]] = []
        new = _MetricFactory(self.registry, self.defined)
        # the groups in this order: docs/metrics.md lists the metrics as they are defined
        self._define_request_latencies(new)
        self._define_engine_state(new)
        self._define_server_info(new)
        self._define_devices(new)
        self._define_token_counters(new)
        self._define_request_outcomes(new)
        self._define_spec_decode(new)
        self._define_telemetry_store()

        # Series without extra labels exist from the start (zero counts are true, not unknown).
        for metric in (
            self.h_ttft,
            self.h_itl,
            self.h_tpot,
            self.h_e2e,
            self.h_queue,
            self.h_prefill,
            self.h_decode,
            self.h_iter_tokens,
            self.c_prefix_queries,
            self.c_prefix_hits,
            self.c_preemptions,
            self.c_spec_drafts,
            self.c_spec_draft_tokens,
            self.c_spec_accepted,
        ):
            metric.labels(model_name)

    def _define_request_latencies(self, new: _MetricFactory) -> None:
        """Per-request histograms: latencies by stage (seconds), the KV hand-off's time and the
        prompt and output lengths (tokens)."""
        self.h_ttft = new.histogram(
            "time_to_first_token_seconds",
            "Time to first token in seconds (gateway arrival to first token).",
            TTFT_BUCKETS_S,
        )
        self.h_itl = new.histogram(
            "inter_token_latency_seconds",
            "Inter-token latency in seconds, one observation per token interval.",
            TPOT_BUCKETS_S,
        )
        self.h_tpot = new.histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request, in seconds.",
            TPOT_BUCKETS_S,
        )
        self.h_e2e = new.histogram(
            "e2e_request_latency_seconds",
            "End-to-end request latency in seconds, for requests that reached the engine.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.h_queue = new.histogram(
            "request_queue_time_seconds",
            "Time a request waited in the engine queue (WAITING) in seconds.",
            REQUEST_STAGE_BUCKETS_S,
        )
        self.h_prefill = new.histogram(
            "request_prefill_time_seconds",
            "Time from first scheduled to first token (PREFILL) in seconds.",
            REQUEST_STAGE_BUCKETS_S,
        )
        self.h_decode = new.histogram(
            "request_decode_time_seconds",
            "Time from first to last token (DECODE) in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.h_kv_transfer = new.histogram(
            "kv_transfer_seconds",
            "Prefill/decode disaggregation: time one request's KV took from the prefill core "
            "to the decode core, in seconds.",
            REQUEST_STAGE_BUCKETS_S,
        )
        self.h_prompt_len = new.histogram(
            "request_prompt_tokens",
            "Prompt tokens per request that reached the engine.",
            REQUEST_TOKEN_BUCKETS,
        )
        self.h_gen_len = new.histogram(
            "request_generation_tokens",
            "Output tokens per request that reached the engine.",
            REQUEST_TOKEN_BUCKETS,
        )

    def _define_engine_state(self, new: _MetricFactory) -> None:
        """The engine's steps and state: tokens per step, requests running and waiting, KV-cache
        usage (summed, and per replica under data parallelism), the API's in-flight requests
        and the engine's restarts."""
        self.h_iter_tokens = new.histogram(
            "iteration_tokens",
            "Tokens (prefill + decode) per engine step; steps with no tokens are not counted.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.g_running = new.gauge("num_requests_running", "Requests running in the engine.")
        # data parallelism (engine/api/replicas.py): one series per replica, bounded by
        # --data-parallel-size (<= 64); the unlabelled gauges above are the sums
        mr = ["model_name", "replica"]
        self.g_replica = {
            "running": new.gauge(
                "replica_num_requests_running", "Requests running in one replica.", mr
            ),
            "waiting": new.gauge(
                "replica_num_requests_waiting", "Requests waiting in one replica's queue.", mr
            ),
            "kv_usage": new.gauge(
                "replica_kv_cache_usage_perc", "One replica's KV-cache usage, 0..1.", mr
            ),
            "outstanding_tokens": new.gauge(
                "replica_outstanding_tokens",
                "Tokens routed to one replica and not yet done: prompts not yet prefilled "
                "plus outputs still to come (the router's load).",
                mr,
            ),
        }
        self.data_parallel_size = 1  # above 1, step records set the replica gauges only
        self._replica_step: dict[int, tuple] = {}
        self.g_waiting = new.gauge("num_requests_waiting", "Requests waiting in the engine queue.")
        self.g_kv = new.gauge("kv_cache_usage_perc", "KV-cache usage, 0..1 (1 means 100 percent).")
        self.g_in_flight = new.gauge(
            "requests_in_flight", "Requests admitted by the API, not done."
        )
        self.c_restarts = new.counter("engine_restarts", "Engine core restarts since server start.")
        self._restarts_seen = 0

    def _define_server_info(self, new: _MetricFactory) -> None:
        """What this server runs and whether its engine answers: the build info, the engine's
        heartbeat age and the model's weight bytes."""
        self.g_build = new.gauge(
            "build_info",
            "1, labelled with the versions this server runs and the int8 GEMM path its "
            "quantized layers' large steps take (amx, avx512_vnni, avx2_vnni, avx2; off).",
            ["model_name", "version", "python", "torch", "int8_compute"],
        )
        self.g_heartbeat_age = new.gauge(
            "engine_heartbeat_age_seconds",
            "Seconds since the engine core's last message (one per step, a heartbeat every "
            "0.5 s when idle); absent while no engine is up.",
        )
        self.g_weight_bytes = new.gauge(
            "model_weight_bytes",
            "Bytes of the model's weights by storage dtype (int4 packs two weights per byte).",
            ["model_name", "dtype"],
        )

    def _define_devices(self, new: _MetricFactory) -> None:
        """The device samples: per-GPU gauges (label ``gpu`` = device index) and energy, the
        server process's CPU and memory."""
        mg = ["model_name", "gpu"]
        self.g_gpu = {
            "power_w": new.gauge("gpu_power_watts", "GPU power draw in watts (NVML).", mg),
            "dram_bw_util_pct": new.gauge(
                "gpu_dram_bandwidth_utilization_ratio",
                "GPU DRAM bandwidth utilisation, 0..1 (NVML GPM, Hopper+).",
                mg,
            ),
            "sm_clock_mhz": new.gauge("gpu_sm_clock_hertz", "GPU SM clock in hertz (NVML).", mg),
            "mem_clock_mhz": new.gauge(
                "gpu_memory_clock_hertz", "GPU memory clock in hertz (NVML).", mg
            ),
            "temperature_c": new.gauge(
                "gpu_temperature_celsius", "GPU temperature in celsius.", mg
            ),
            "mem_used_bytes": new.gauge("gpu_memory_used_bytes", "GPU memory used in bytes.", mg),
            "gpu_util_pct": new.gauge(
                "gpu_utilization_ratio", "GPU (SM) utilisation, 0..1 (NVML).", mg
            ),
        }
        # energy only grows: a counter, fed the sampler's increments
        self.c_energy = new.counter("gpu_energy_joules", "GPU energy in joules (NVML).", mg)
        self._energy_seen: dict[str, float] = {}
        self.g_host = {
            "cpu_pct": new.gauge(
                "host_cpu_cores", "Server process CPU in cores (1.0 = one busy core)."
            ),
            "rss_bytes": new.gauge("host_rss_bytes", "Server (+ engine) resident memory in bytes."),
        }

    def _define_token_counters(self, new: _MetricFactory) -> None:
        """Tokens of requests that reached the engine (per tenant), the prefix cache's queries
        and hits, KV bytes moved between disaggregated cores, preemptions."""
        mt = ["model_name", "tenant"]
        self.c_prompt = new.counter(
            "prompt_tokens", "Prompt tokens of requests that reached the engine.", mt
        )
        self.c_gen = new.counter("generation_tokens", "Output tokens generated.", mt)
        self.c_cached = new.counter(
            "cached_prompt_tokens", "Prompt tokens served from the prefix cache.", mt
        )
        self.c_prefix_queries = new.counter(
            "prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up."
        )
        self.c_prefix_hits = new.counter(
            "prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache."
        )
        self.c_kv_transfer_bytes = new.counter(
            "kv_transfer_bytes",
            "Prefill/decode disaggregation: KV bytes sent from the prefill to the decode core.",
        )
        self.c_preemptions = new.counter("num_preemptions", "Requests preempted by the engine.")

    def _define_request_outcomes(self, new: _MetricFactory) -> None:
        """How requests ended: successes by finish reason, errors by type, HTTP requests by
        tenant and status."""
        self.c_success = new.counter(
            "request_success",
            "Requests finished without error (finished_reason stop or length).",
            ["model_name", "finished_reason"],
        )
        self.c_errors = new.counter(
            "request_errors",
            "Requests that ended with an error, by error type.",
            ["model_name", "error_type"],
        )
        self.c_requests = new.counter(
            "requests",
            "Finished HTTP requests by tenant and HTTP status code.",
            ["model_name", "tenant", "status"],
        )

    def _define_spec_decode(self, new: _MetricFactory) -> None:
        """Speculative decoding: vLLM's ``spec_decode_*`` counters, fed from the step records."""
        self.c_spec_drafts = new.counter(
            "spec_decode_num_drafts",
            "Speculative decoding: drafts verified (one per request per step that verified "
            "draft tokens).",
        )
        self.c_spec_draft_tokens = new.counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
        )
        self.c_spec_accepted = new.counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
        )
        self.c_spec_accepted_pos = new.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by draft position (0 = the first "
            "draft token).",
            ["model_name", "position"],
        )

    def _define_telemetry_store(self) -> None:
        """``telemetry_dropped_total``: rows the trace store did not take, read at each scrape
        (:class:`_DropsCollector`)."""
        self._drops = _DropsCollector(self.model_name)
        self.registry.register(self._drops)
        self.defined.append(
            (
                _DropsCollector.NAME + "_total",
                "counter",
                ("model_name", "table", "reason"),
                _DropsCollector.HELP,
            )
        )

    # ------------------------------------------------------------------------------------------
    def set_drops_source(self, fn: Callable[[], dict[tuple[str, str], int]] | None) -> None:
        """Sets where ``tokenmill_telemetry_dropped_total`` reads from:
        ``fn() -> {(table, reason): rows}``, the store's cumulative drop counts, called at
        every scrape."""
        self._drops.source = fn

    def observe_request(self, row: dict, itl_ms: list[float]) -> None:
        """Records one finished (or rejected) request.

        Args:
            row: a ``requests`` row (schema.sql). Times in milliseconds (``ttft_ms``,
                ``queue_ms``, ``prefill_ms``, ``decode_ms``, ``tpot_ms``, ``e2e_ms``), exported
                in seconds; token counts (``input_tokens``, ``output_tokens``,
                ``cached_tokens``); ``finish_reason`` (stop | length | abort | error | None when
                rejected before the engine); ``error_type``; ``http_status``; ``tenant``.
                Missing keys count as None.
            itl_ms: the request's inter-token intervals in milliseconds, one observation each.

        Latency histograms (TTFT, ITL, TPOT, E2E, queue, prefill, decode) only for completed
        requests (``finish_reason`` stop/length, no error), TPOT only with two or more output
        tokens; token and prefix-cache counters for every request that reached the engine
        (``finish_reason`` set, aborted included); ``requests_total`` always.
        """
        g = row.get
        model = self.model_name
        tenant = _label(g("tenant"))
        finish = g("finish_reason")
        error = g("error_type")
        output_tokens = int(g("output_tokens") or 0)
        reached_engine = finish is not None

        self.c_requests.labels(model, tenant, _label(g("http_status"))).inc()
        if error:
            self.c_errors.labels(model, str(error)).inc()
        elif finish in SUCCESS_REASONS:
            self.c_success.labels(model, finish).inc()

        if not reached_engine:
            return
        if finish in SUCCESS_REASONS and not error:
            # latency histograms describe completed requests only (so the TTFT count equals
            # the completed-request count); aborted and failed ones are in the counters
            ttft = _s(g("ttft_ms"))
            if ttft is not None:
                self.h_ttft.labels(model).observe(ttft)
            tpot = _s(g("tpot_ms"))
            if tpot is not None and output_tokens >= 2:
                self.h_tpot.labels(model).observe(tpot)
            if itl_ms:
                h_itl = self.h_itl.labels(model)
                for ms in itl_ms:
                    h_itl.observe(float(ms) / 1000.0)
            for hist, key in (
                (self.h_e2e, "e2e_ms"),
                (self.h_queue, "queue_ms"),
                (self.h_prefill, "prefill_ms"),
                (self.h_decode, "decode_ms"),
            ):
                value = _s(g(key))
                if value is not None:
                    hist.labels(model).observe(value)
        input_tokens = int(g("input_tokens") or 0)
        cached_tokens = int(g("cached_tokens") or 0)
        self.h_prompt_len.labels(model).observe(input_tokens)
        self.h_gen_len.labels(model).observe(output_tokens)
        self.c_prompt.labels(model, tenant).inc(input_tokens)
        self.c_gen.labels(model, tenant).inc(output_tokens)
        self.c_cached.labels(model, tenant).inc(cached_tokens)
        self.c_prefix_queries.labels(model).inc(input_tokens)
        self.c_prefix_hits.labels(model).inc(cached_tokens)
        moved = g("kv_transfer_bytes")
        if moved is not None:  # every request that crossed, whatever its outcome
            self.c_kv_transfer_bytes.labels(model).inc(int(moved))
            seconds = _s(g("kv_transfer_ms"))
            if seconds is not None:
                self.h_kv_transfer.labels(model).observe(seconds)

    def observe_step(self, row: dict) -> None:
        """Records one ``engine_steps`` row.

        ``iteration_tokens`` observes ``num_prefill_tokens + num_decode_tokens`` (tokens, steps
        with 0 tokens skipped); ``num_requests_running/waiting`` from ``num_running`` /
        ``num_waiting`` (requests); ``kv_cache_usage_perc`` = ``kv_blocks_used /
        kv_blocks_total`` (0..1, left as is when the total is unknown or 0); those three only
        from a record at least as new (``step_id``) as the last one they came from, or from
        a new engine (``engine_pid``: a restarted core counts its steps from 0 again);
        ``num_preemptions_total`` += ``num_preempted`` (requests); speculative decoding:
        ``spec_decode_num_drafts_total`` += ``num_drafts``, ``spec_decode_num_draft_tokens_total``
        += ``num_draft_tokens``, ``spec_decode_num_accepted_tokens_total`` +=
        ``num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos_total{position=i}``
        += ``num_accepted_tokens_per_pos[i]`` (a position's series appears with its first
        verified draft).
        """
        g = row.get
        model = self.model_name
        tokens = int(g("num_prefill_tokens") or 0) + int(g("num_decode_tokens") or 0)
        if tokens > 0:
            self.h_iter_tokens.labels(model).observe(tokens)
        total, used = g("kv_blocks_total"), g("kv_blocks_used")
        pid, step_id = g("engine_pid"), g("step_id")
        replica = g("replica")
        many = self.data_parallel_size > 1
        last_pid, last_step = (
            self._replica_step.get(replica, (None, -1)) if many else self._state_step
        )
        if step_id is None or pid != last_pid or step_id >= last_step:
            seen = (pid, -1 if step_id is None else step_id)
            state = {
                "running": g("num_running"),
                "waiting": g("num_waiting"),
                "kv_usage": (used / total) if total and used is not None else None,
            }
            if not many:
                self._state_step = seen
                self.set_engine_state(**state)
            elif replica is not None:  # the sums come from the server's refresh
                self._replica_step[replica] = seen
                self.set_replica_state(replica, **state)
        preempted = int(g("num_preempted") or 0)
        if preempted > 0:
            self.c_preemptions.labels(model).inc(preempted)
        draft_tokens = int(g("num_draft_tokens") or 0)
        if draft_tokens > 0:
            self.c_spec_drafts.labels(model).inc(int(g("num_drafts") or 0))
            self.c_spec_draft_tokens.labels(model).inc(draft_tokens)
            self.c_spec_accepted.labels(model).inc(int(g("num_accepted_tokens") or 0))
            for pos, n in enumerate(g("num_accepted_tokens_per_pos") or ()):
                # every position verified gets its series, zero acceptances included
                self.c_spec_accepted_pos.labels(model, str(pos)).inc(int(n or 0))

    def observe_device(self, row: dict) -> None:
        """Records one ``device_samples`` row.

        ``kind == 'gpu'``: the ``gpu_*`` gauges labelled ``gpu=str(device_index)`` from
        ``power_w`` (W), ``dram_bw_util_pct`` and ``gpu_util_pct`` (percent 0..100, exported
        0..1), ``sm_clock_mhz`` / ``mem_clock_mhz`` (MHz, exported in hertz), ``temperature_c`` (celsius),
        ``mem_used_bytes`` (bytes), and the energy counter from ``energy_j`` (J since the
        sampler started: its increments). ``kind == 'host'``: ``host_cpu_cores`` from
        ``cpu_pct`` (percent, exported /100) and ``host_rss_bytes`` from ``rss_bytes``.
        A None value removes that series (unknown is not exported as 0, nor left stale).
        """
        kind = row.get("kind")
        if kind == "gpu":
            index = row.get("device_index")
            if index is None:
                return
            labels = (self.model_name, str(int(index)))
            gauges = self.g_gpu
        elif kind == "host":
            labels = (self.model_name,)
            gauges = self.g_host
        else:
            return
        for key, gauge in gauges.items():
            value = row.get(key)
            if value is None:
                gauge.remove(*labels)
            else:
                gauge.labels(*labels).set(float(value) * _SCALE.get(key, 1.0))
        energy = row.get("energy_j") if kind == "gpu" else None
        if energy is not None:
            seen = self._energy_seen.get(labels[1])
            if seen is not None and energy > seen:
                self.c_energy.labels(*labels).inc(float(energy) - seen)
            self._energy_seen[labels[1]] = float(energy)

    def set_engine_state(
        self,
        running: int | None = None,
        waiting: int | None = None,
        kv_usage: float | None = None,
        restarts: int | None = None,
        in_flight: int | None = None,
    ) -> None:
        """Sets the engine/API gauges; None leaves a gauge as it is.

        Args:
            running: requests running in the engine.
            waiting: requests waiting in the engine queue.
            kv_usage: KV-cache usage as a fraction 0..1.
            restarts: engine worker restarts since server start.
            in_flight: requests admitted by the API and not yet finished.
        """
        model = self.model_name
        for gauge, value in (
            (self.g_running, running),
            (self.g_waiting, waiting),
            (self.g_kv, kv_usage),
            (self.g_in_flight, in_flight),
        ):
            if value is not None:
                gauge.labels(model).set(float(value))
        if restarts is not None:
            self.c_restarts.labels(model).inc(max(0, restarts - self._restarts_seen))
            self._restarts_seen = max(self._restarts_seen, restarts)

    def set_build_info(
        self,
        version: str | None,
        python: str | None,
        torch: str | None,
        int8_compute: str | None = None,
    ) -> None:
        """``tokenmill_build_info`` = 1 with these versions (``runtime_versions`` in
        ``engine/api/lifecycle.py``) and the int8 compute path (``off`` without one)."""
        self.g_build.labels(
            self.model_name, version or "", python or "", torch or "", int8_compute or "off"
        ).set(1)

    def set_replica_state(self, replica: int, **values: float | None) -> None:
        """Sets one replica's ``tokenmill_replica_*`` gauges (keys ``running``, ``waiting``,
        ``kv_usage`` (0..1), ``outstanding_tokens``); None leaves a gauge as it is.

        Raises:
            KeyError: an unknown key.
        """
        labels = (self.model_name, str(int(replica)))
        for key, value in values.items():
            gauge = self.g_replica[key]
            if value is not None:
                gauge.labels(*labels).set(float(value))

    def set_weight_bytes(self, by_dtype: dict[str, int]) -> None:
        """Sets ``tokenmill_model_weight_bytes{dtype}``: the loaded model's weight bytes per
        storage dtype (``EngineReady.model_info["weight_bytes_by_dtype"]``); a dtype no longer
        present loses its series."""
        self.g_weight_bytes.clear()
        for dtype, n in by_dtype.items():
            self.g_weight_bytes.labels(self.model_name, dtype).set(float(n))

    def set_heartbeat_age(self, age_s: float | None) -> None:
        """Sets ``tokenmill_engine_heartbeat_age_seconds``: seconds since the engine core's last
        message as the server saw it at this scrape (``AsyncEngine.heartbeat_age_s``). None (no
        engine up: starting or restarting) removes the series, since the age is then unknown."""
        if age_s is None:
            self.g_heartbeat_age.remove(self.model_name)  # a missing series is no error
        else:
            self.g_heartbeat_age.labels(self.model_name).set(float(age_s))

    def render(self) -> tuple[bytes, str]:
        """The exposition: ``(body, content_type)`` for the ``/metrics`` response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """PromQL's ``histogram_quantile(q, ...)`` over one series' cumulative buckets.

    Args:
        q: the quantile, 0..1.
        buckets: ``(le, cumulative_count)`` pairs of one series, ``+Inf`` included, any order
            (the ``*_bucket`` samples of a scrape; ``le`` in the metric's unit).

    Returns the estimate the way Prometheus computes it (``bucketQuantile`` in
    ``promql/quantile.go``): rank ``q * count``; the first bucket whose cumulative count
    reaches it; linear interpolation between that bucket's lower bound (0 for the first bucket)
    and its upper bound; the highest finite bound when the rank falls in ``+Inf``. NaN without
    observations or without a ``+Inf`` bucket.
    """
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    pairs = sorted((float(le), float(count)) for le, count in buckets)
    if len(pairs) < 2 or not math.isinf(pairs[-1][0]):
        return math.nan
    total = pairs[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, count) in enumerate(pairs) if count >= rank)
    if b == len(pairs) - 1:
        return pairs[-2][0]
    end, count = pairs[b]
    if b == 0 and end <= 0:
        return end
    start = 0.0
    if b > 0:
        start, below = pairs[b - 1]
        count -= below
        rank -= below
    if count <= 0:  # q = 0 over an empty lowest bucket
        return start
    return start + (end - start) * (rank / count)
