"""``docs/metrics.md``, generated from the ``/metrics`` registry (:class:`ServingMetrics`).

Run ``python -m tokenmill.telemetry.metrics_doc > docs/metrics.md`` after changing a metric;
``tests/telemetry/test_metrics.py`` fails while the file and the registry disagree. Each metric's vLLM
counterpart is named here, checked against vLLM's v1 Prometheus logger
(``vllm/v1/metrics/loggers.py``, v0.10): a dashboard written for vLLM reads ours after the
rename ``vllm:`` → ``tokenmill_``, where one exists.
"""

from __future__ import annotations

from .metrics import ServingMetrics

#: tokenmill's name (exported, ``_total`` included) → vLLM's, where vLLM has the same metric
VLLM_COUNTERPARTS = {
    "tokenmill_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "tokenmill_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "tokenmill_request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "tokenmill_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "tokenmill_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "tokenmill_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "tokenmill_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "tokenmill_request_prompt_tokens": "vllm:request_prompt_tokens",
    "tokenmill_request_generation_tokens": "vllm:request_generation_tokens",
    "tokenmill_iteration_tokens": "vllm:iteration_tokens_total",
    "tokenmill_num_requests_running": "vllm:num_requests_running",
    "tokenmill_num_requests_waiting": "vllm:num_requests_waiting",
    "tokenmill_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "tokenmill_prompt_tokens_total": "vllm:prompt_tokens_total",
    "tokenmill_generation_tokens_total": "vllm:generation_tokens_total",
    "tokenmill_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "tokenmill_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "tokenmill_num_preemptions_total": "vllm:num_preemptions_total",
    "tokenmill_request_success_total": "vllm:request_success_total",
    "tokenmill_spec_decode_num_drafts_total": "vllm:spec_decode_num_drafts_total",
    "tokenmill_spec_decode_num_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
    "tokenmill_spec_decode_num_accepted_tokens_total": (
        "vllm:spec_decode_num_accepted_tokens_total"
    ),
    "tokenmill_spec_decode_num_accepted_tokens_per_pos_total": (
        "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    ),
}

HEADER = """# Metrics

What `GET /metrics` exports (Prometheus text format). Every series carries `model_name`; the
per-tenant ones also `tenant`, the per-replica ones `replica`, the per-GPU ones `gpu`. Times are
in seconds, sizes in bytes, clocks in hertz, `_ratio` and `_perc` are 0..1. Latency histograms count completed
requests only; token counters count every request that reached the engine. On a keyed server
a scrape needs `Authorization: Bearer <key>` with the `--metrics-key` or the admin key
(`--open-metrics`: none).

Where vLLM exports the same metric, its name is given: a vLLM dashboard reads ours after the
rename `vllm:` → `tokenmill_`.

Beside them, the live diagnosis' series when it runs (`--diagnose-every`, on by default):
`tokenmill_finding_active{rule, severity}`, `tokenmill_finding_confidence{rule}`,
`tokenmill_findings_opened_total{rule}`, `tokenmill_diagnosis_run_seconds`,
`tokenmill_diagnosis_cpu_seconds_total` and `tokenmill_diagnosis_runs_total{outcome}`
([live-diagnosis.md](live-diagnosis.md)); and the API process's own `process_*` series (CPU seconds, resident memory, open
file descriptors, start time), as every Prometheus exporter has them; no `*_created` series.

This page is generated from the registry (`python -m tokenmill.telemetry.metrics_doc`).

| metric | type | labels | meaning | vLLM |
|---|---|---|---|---|
"""


def render() -> str:
    """The page: one row per metric, in the order the registry defines them."""
    rows = []
    for name, kind, labels, doc in ServingMetrics("m").defined:
        vllm = VLLM_COUNTERPARTS.get(name)
        cells = (
            f"`{name}`",
            kind,
            ", ".join(f"`{x}`" for x in labels),
            doc.replace("|", "\\|"),
            f"`{vllm}`" if vllm else "–",
        )
        rows.append("| " + " | ".join(cells) + " |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
