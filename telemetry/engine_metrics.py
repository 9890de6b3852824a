"""Any serving engine's Prometheus metrics, read into one shape: the ``engine_samples`` row.

vLLM, SGLang, llama.cpp's server, TGI and tokenmill all serve ``/metrics``, each with names of
its own for the same few facts (requests running and waiting, KV-cache use, preemptions,
prefix-cache queries and hits, token counters, the request-phase histograms). :data:`ENGINES`
is the one name table, per engine kind, from each project's own metric definitions (the version
read is in ``docs/engine_metrics.md``); :func:`read_exposition` turns one scrape into an
:class:`EngineSampleRow` whose columns mean the same thing whoever served them. A column the
engine does not expose stays NULL, and :func:`missing_signals` says which.

Aggregation over label sets (several models, data-parallel engine indexes, finish reasons):
counts and counters are summed; a ratio gauge (KV-cache use) is averaged. A NaN or ±Inf reading
is no reading: it is skipped, never summed or averaged. Counters are summed per series with
each series' own resets undone (:class:`CounterResets`, the scraper keeps one per URL), so one
engine index restarting is not read as a reset of the whole sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.messages import Ns


class MetricsFormatError(ValueError):
    """A scrape that is not Prometheus exposition text (one-line reason)."""


class EngineSampleRow(msgspec.Struct, kw_only=True):
    """One scrape of an engine's ``/metrics``, field for field the ``engine_samples`` table.
    Counters and histogram sums/counts are cumulative as the engine reports them (a restart
    resets them); a consumer takes differences between samples of one ``url``."""

    time_ns: Ns
    """when the scrape was answered"""
    url: str
    """the URL scraped"""
    engine_kind: str
    """vllm | sglang | llamacpp | tgi | tokenmill"""
    running: float | None = None
    """requests running (in the batch)"""
    waiting: float | None = None
    """requests waiting (queued, not yet scheduled)"""
    kv_usage: float | None = None
    """KV-cache use, 0..1"""
    preemptions_total: float | None = None
    prefix_queries_total: float | None = None
    """prefix-cache lookups (tokens for vLLM and tokenmill)"""
    prefix_hits_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_finished_total: float | None = None
    iteration_tokens_sum: float | None = None
    """tokens per engine step (histogram sum; with its count: the mean step size)"""
    iteration_tokens_count: float | None = None
    queue_s_sum: float | None = None
    """seconds requests waited in the queue (histogram sum)"""
    queue_s_count: float | None = None
    prefill_s_sum: float | None = None
    prefill_s_count: float | None = None
    decode_s_sum: float | None = None
    decode_s_count: float | None = None
    ttft_s_sum: float | None = None
    ttft_s_count: float | None = None
    itl_s_sum: float | None = None
    """inter-token latency, or time per output token where the engine has only that"""
    itl_s_count: float | None = None
    e2e_s_sum: float | None = None
    e2e_s_count: float | None = None


# the row's signal columns; a histogram signal fills <name>_sum and <name>_count
GAUGES = ("running", "waiting")
RATIOS = ("kv_usage",)
COUNTERS = (
    "preemptions_total",
    "prefix_queries_total",
    "prefix_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "requests_finished_total",
)
HISTOGRAMS = ("iteration_tokens", "queue_s", "prefill_s", "decode_s", "ttft_s", "itl_s", "e2e_s")
SIGNALS = (*GAUGES, *RATIOS, *COUNTERS, *HISTOGRAMS)


@dataclass(frozen=True)
class Engine:
    """One engine kind: the prefix its metric names carry and, per signal, the exposition name
    (a sample name; for a histogram its base name, without ``_sum``/``_count``). A tuple gives
    alternatives, first found wins (names renamed across versions)."""

    kind: str
    prefix: str
    names: dict[str, str | tuple[str, ...]]
    #: signals read from a histogram's ``_sum`` (a total the engine keeps only as one)
    from_hist_sum: tuple[str, ...] = ()
    #: signals that are the sum of several series, all of which must be present
    sum_of: dict[str, tuple[str, ...]] | None = None


ENGINES: dict[str, Engine] = {
    e.kind: e
    for e in (
        Engine(
            "vllm",
            "vllm:",
            {
                "running": "vllm:num_requests_running",
                "waiting": "vllm:num_requests_waiting",
                "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                "preemptions_total": "vllm:num_preemptions_total",
                "prefix_queries_total": (
                    "vllm:prefix_cache_queries_total",
                    "vllm:gpu_prefix_cache_queries_total",
                ),
                "prefix_hits_total": (
                    "vllm:prefix_cache_hits_total",
                    "vllm:gpu_prefix_cache_hits_total",
                ),
                "prompt_tokens_total": "vllm:prompt_tokens_total",
                "generation_tokens_total": "vllm:generation_tokens_total",
                "requests_finished_total": "vllm:request_success_total",
                "iteration_tokens": "vllm:iteration_tokens_total",
                "queue_s": "vllm:request_queue_time_seconds",
                "prefill_s": "vllm:request_prefill_time_seconds",
                "decode_s": "vllm:request_decode_time_seconds",
                "ttft_s": "vllm:time_to_first_token_seconds",
                "itl_s": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                "e2e_s": "vllm:e2e_request_latency_seconds",
            },
        ),
        Engine(
            "sglang",
            "sglang:",
            {
                "running": "sglang:num_running_reqs",
                "waiting": "sglang:num_queue_reqs",
                "kv_usage": "sglang:token_usage",
                "preemptions_total": "sglang:num_retracted_requests_total",
                "prefix_hits_total": "sglang:cached_tokens_total",
                "prompt_tokens_total": "sglang:prompt_tokens_total",
                "generation_tokens_total": "sglang:generation_tokens_total",
                "requests_finished_total": "sglang:num_requests_total",
                "queue_s": "sglang:queue_time_seconds",
                "ttft_s": "sglang:time_to_first_token_seconds",
                "itl_s": (
                    "sglang:inter_token_latency_seconds",
                    "sglang:time_per_output_token_seconds",
                ),
                "e2e_s": "sglang:e2e_request_latency_seconds",
            },
        ),
        Engine(
            "llamacpp",
            "llamacpp:",
            {
                "running": "llamacpp:requests_processing",
                "waiting": "llamacpp:requests_deferred",
                "kv_usage": "llamacpp:kv_cache_usage_ratio",
                "prefix_hits_total": "llamacpp:prompt_tokens_cached_total",
                "prompt_tokens_total": "llamacpp:prompt_tokens_total",
                "generation_tokens_total": "llamacpp:tokens_predicted_total",
            },
            # its prompt counter leaves out the tokens a slot's cache served: a lookup covers both
            sum_of={
                "prefix_queries_total": (
                    "llamacpp:prompt_tokens_total",
                    "llamacpp:prompt_tokens_cached_total",
                )
            },
        ),
        Engine(
            "tgi",
            "tgi_",
            {
                "running": "tgi_batch_current_size",
                "waiting": "tgi_queue_size",
                "prompt_tokens_total": "tgi_request_input_length",
                "generation_tokens_total": "tgi_request_generated_tokens",
                # exposed as `tgi_request_success` (a counter without the suffix): the
                # exposition parser names every counter sample `<name>_total`
                "requests_finished_total": "tgi_request_success_total",
                "queue_s": "tgi_request_queue_duration",
                "itl_s": "tgi_request_mean_time_per_token_duration",
                "e2e_s": "tgi_request_duration",
            },
            from_hist_sum=("prompt_tokens_total", "generation_tokens_total"),
        ),
        Engine(
            "tokenmill",
            "tokenmill_",
            {
                "running": "tokenmill_num_requests_running",
                "waiting": "tokenmill_num_requests_waiting",
                "kv_usage": "tokenmill_kv_cache_usage_perc",
                "preemptions_total": "tokenmill_num_preemptions_total",
                "prefix_queries_total": "tokenmill_prefix_cache_queries_total",
                "prefix_hits_total": "tokenmill_prefix_cache_hits_total",
                "prompt_tokens_total": "tokenmill_prompt_tokens_total",
                "generation_tokens_total": "tokenmill_generation_tokens_total",
                "requests_finished_total": "tokenmill_request_success_total",
                "iteration_tokens": "tokenmill_iteration_tokens",
                "queue_s": "tokenmill_request_queue_time_seconds",
                "prefill_s": "tokenmill_request_prefill_time_seconds",
                "decode_s": "tokenmill_request_decode_time_seconds",
                "ttft_s": "tokenmill_time_to_first_token_seconds",
                "itl_s": "tokenmill_inter_token_latency_seconds",
                "e2e_s": "tokenmill_e2e_request_latency_seconds",
            },
        ),
    )
}


#: one series of a scrape: its sample name and its labels
Series = tuple[str, tuple[tuple[str, str], ...]]


def parse_samples(text: str) -> dict[str, dict[Series, float]]:
    """Exposition text → every sample's value by sample name, per series (name and labels).
    NaN and ±Inf values are left out: a reading that is not a number is no reading.

    Raises:
        MetricsFormatError: the text is not Prometheus exposition format.
    """
    out: dict[str, dict[Series, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                value = float(s.value)
                if not math.isfinite(value):
                    continue
                series = (s.name, tuple(sorted(s.labels.items())))
                out.setdefault(s.name, {})[series] = value
    except (ValueError, TypeError, IndexError) as exc:
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise MetricsFormatError(f"not Prometheus exposition text ({reason})") from None
    return out


@dataclass
class CounterResets:
    """One scrape target's counters, series by series, with each series' resets undone
    (Prometheus's ``increase``: a value below the series' last is a restart from 0, and what
    the series had counted until then is kept). :meth:`total` is the sum over every series
    seen so far, so it only grows: one engine index restarting among several, or a series
    that goes away, does not make the sum fall. A restarted scraper starts afresh (its first
    row then reads as a reset)."""

    _series: dict[str, dict[Series, list[float]]] = field(default_factory=dict)

    def total(self, signal: str, series: dict[Series, float]) -> float:
        known = self._series.setdefault(signal, {})
        for key, value in series.items():
            kept = known.get(key)
            if kept is None:
                known[key] = [0.0, value]
                continue
            if value < kept[1]:  # this series restarted: keep what it had counted
                kept[0] += kept[1]
            kept[1] = value
        return sum(base + last for base, last in known.values())


#: series that carry an engine's prefix but are not an engine's (``tokenmill proxy``'s own)
NOT_ENGINE_PREFIXES = ("tokenmill_proxy_",)


def detect_kind(samples: dict[str, dict[Series, float]]) -> str | None:
    """The engine kind whose prefix most sample names carry; None: no known engine (a
    ``tokenmill proxy``'s own series are not an engine's)."""
    best, hits = None, 0
    names = [n for n in samples if not n.startswith(NOT_ENGINE_PREFIXES)]
    for e in ENGINES.values():
        n = sum(1 for name in names if name.startswith(e.prefix))
        if n > hits:
            best, hits = e.kind, n
    return best


def _first(samples: dict[str, dict[Series, float]], names: str | tuple[str, ...], suffix=""):
    for name in (names,) if isinstance(names, str) else names:
        if name + suffix in samples:
            return samples[name + suffix]
    return None


def read_exposition(
    text: str,
    url: str,
    time_ns: int,
    kind: str | None = None,
    counters: CounterResets | None = None,
) -> EngineSampleRow | None:
    """One scrape → one row; None when no known engine's metrics are in it (``kind`` forces
    one). With ``counters`` (the same one for every scrape of ``url``) each counter and
    histogram sum/count is summed over its series with each series' resets undone; without,
    the scrape's own sum.

    Raises:
        MetricsFormatError: the text is not Prometheus exposition format.
    """
    samples = parse_samples(text)
    kind = kind or detect_kind(samples)
    if kind is None:
        return None
    engine = ENGINES[kind]

    def counted(signal: str, series: dict[Series, float]) -> float:
        if counters is None:
            return sum(series.values())
        return counters.total(signal, series)

    row: dict[str, float] = {}
    for signal, names in engine.names.items():
        if signal in HISTOGRAMS:
            for part in ("sum", "count"):
                series = _first(samples, names, "_" + part)
                if series:
                    row[f"{signal}_{part}"] = counted(f"{signal}_{part}", series)
            continue
        if signal in engine.from_hist_sum:
            series = _first(samples, names, "_sum")
        else:
            series = _first(samples, names)
        if not series:
            continue
        if signal in RATIOS:
            row[signal] = sum(series.values()) / len(series)
        elif signal in COUNTERS:
            row[signal] = counted(signal, series)
        else:
            row[signal] = sum(series.values())
    for signal, names in (engine.sum_of or {}).items():
        parts = [samples.get(name) for name in names]
        if all(parts):
            row[signal] = counted(signal, {k: v for p in parts for k, v in p.items()})
    return EngineSampleRow(time_ns=time_ns, url=url, engine_kind=kind, **row)


def read_slots(payload) -> dict[str, float]:
    """llama.cpp's ``GET /slots`` (a JSON array, one object per slot) → the signals it gives:
    ``running`` (busy slots) and, where each busy slot says its prompt size
    (``n_prompt_tokens``, current builds), ``kv_usage`` estimated as the tokens the busy slots
    hold (prompt plus ``next_token[0].n_decoded``, at most the slot's ``n_ctx``) over the
    slots' summed ``n_ctx``. With a unified KV cache (``--kv-unified``) each slot reports the
    whole context as its ``n_ctx``, so the estimate is low by the slot count.

    Raises:
        MetricsFormatError: not such an array.
    """
    if not isinstance(payload, list) or not payload:
        raise MetricsFormatError("/slots: not a JSON array of slots")
    busy = held = capacity = 0
    sized = True
    for slot in payload:
        n_ctx = slot.get("n_ctx") if isinstance(slot, dict) else None
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
            raise MetricsFormatError("/slots: a slot without a positive n_ctx")
        capacity += n_ctx
        if not slot.get("is_processing"):
            continue
        busy += 1
        prompt = slot.get("n_prompt_tokens")
        nxt = slot.get("next_token")
        decoded = nxt[0].get("n_decoded", 0) if isinstance(nxt, list) and nxt else 0
        if not isinstance(prompt, int) or not isinstance(decoded, int):
            sized = False
            continue
        held += min(prompt + decoded, n_ctx)
    out: dict[str, float] = {"running": float(busy)}
    if sized:
        out["kv_usage"] = held / capacity
    return out


def missing_signals(kind: str) -> list[str]:
    """The signals engine ``kind`` does not expose (its rows leave them NULL)."""
    engine = ENGINES[kind]
    return [s for s in SIGNALS if s not in engine.names and s not in (engine.sum_of or {})]
