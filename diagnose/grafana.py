"""A Grafana dashboard over the ``tokenmill_`` metrics (``tokenmill export grafana``): the
console's Overview in Grafana terms, for teams that live in Grafana.

The tiles are the Overview's (TTFT and ITL p50/p99, output tokens/s, error rate, KV usage,
requests), then TTFT and ITL over time with concurrency, and what the exported alerts read:
queue and prefill time against TTFT, KV usage with preemptions, errors by type, prefix-cache
hits. Every query reads raw ``tokenmill_`` series of ``/metrics`` (``telemetry/metrics.py``),
so the dashboard works without the exported recording rules; the "Firing tokenmill alerts"
panel reads Prometheus' ``ALERTS`` series of the exported alerts (those with a ``rule_id``).
Goodput is not here: it checks each request against the SLOs, which takes the trace store
(the console's Overview has it).

Quantiles are ``histogram_quantile`` over ``rate(...[$__rate_interval])``, aggregated by
``model_name``; the dashboard's variables are the Prometheus data source and ``model_name``.
"""

from __future__ import annotations

#: Grafana's dashboard JSON schema version this file is written in (Grafana 10.4 and 11 load it)
SCHEMA_VERSION = 39
UID = "tokenmill-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{model_name=~"$model_name"}'


def _hq(q: float, metric: str) -> str:
    return (
        f"histogram_quantile({q}, sum by (model_name, le) "
        f"(rate({metric}_bucket{SEL}[$__rate_interval])))"
    )


def _rate(metric: str, by: str = "model_name") -> str:
    return f"sum by ({by}) (rate({metric}{SEL}[$__rate_interval]))"


TTFT = "tokenmill_time_to_first_token_seconds"
ITL = "tokenmill_inter_token_latency_seconds"
ERROR_RATIO = f"{_rate('tokenmill_request_errors_total')} / {_rate('tokenmill_requests_total')}"


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}


def _panel(kind: str, title: str, description: str, unit: str, targets: list[tuple[str, str]]):
    refs = "ABCDEFGH"
    panel = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [_target(e, legend, refs[i]) for i, (e, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
    }
    if kind == "stat":
        panel["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
        }
    else:
        panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}}
    return panel


def _tiles() -> list[dict]:
    m = "{{model_name}}"
    return [
        _panel("stat", "TTFT p50", "Time to first token, median.", "s", [(_hq(0.5, TTFT), m)]),
        _panel("stat", "TTFT p99", "Time to first token, 99th percentile.", "s",
               [(_hq(0.99, TTFT), m)]),
        _panel("stat", "ITL p50", "Inter-token latency, median.", "s", [(_hq(0.5, ITL), m)]),
        _panel("stat", "ITL p99", "Inter-token latency, 99th percentile.", "s",
               [(_hq(0.99, ITL), m)]),
        _panel("stat", "Throughput", "Output tokens per second.", "tok/s",
               [(_rate("tokenmill_generation_tokens_total"), m)]),
        _panel("stat", "Error rate", "Share of finished requests that carry an error type.",
               "percentunit", [(ERROR_RATIO, m)]),
        _panel("stat", "KV usage", "Share of KV-cache blocks held by requests.", "percentunit",
               [(f"max by (model_name) (tokenmill_kv_cache_usage_perc{SEL})", m)]),
        _panel("stat", "Running", "Requests running in the engine.", "short",
               [(f"sum by (model_name) (tokenmill_num_requests_running{SEL})", m)]),
        _panel("stat", "Waiting", "Requests waiting in the engine queue.", "short",
               [(f"sum by (model_name) (tokenmill_num_requests_waiting{SEL})", m)]),
        _panel("stat", "Requests", "Finished HTTP requests per second.", "reqps",
               [(_rate("tokenmill_requests_total"), m)]),
        _panel("stat", "Preemptions", "Requests preempted by the engine per second.", "short",
               [(_rate("tokenmill_num_preemptions_total"), m)]),
        _panel("stat", "Firing tokenmill alerts",
               "Exported tokenmill alerts firing now (tokenmill export prometheus-rules); "
               "each names its rule and runbook.", "short",
               [('count(ALERTS{alertstate="firing", rule_id!=""}) or vector(0)', "firing")]),
    ]  # fmt: skip


def _charts() -> list[dict]:
    m = "{{model_name}}"
    return [
        _panel("timeseries", "TTFT", "Time to first token: p50 and p99.", "s",
               [(_hq(0.5, TTFT), f"p50 {m}"), (_hq(0.99, TTFT), f"p99 {m}")]),
        _panel("timeseries", "ITL", "Inter-token latency: p50 and p99.", "s",
               [(_hq(0.5, ITL), f"p50 {m}"), (_hq(0.99, ITL), f"p99 {m}")]),
        _panel("timeseries", "Concurrency", "Requests running, waiting and in flight in the API.",
               "short",
               [(f"sum by (model_name) (tokenmill_num_requests_running{SEL})", f"running {m}"),
                (f"sum by (model_name) (tokenmill_num_requests_waiting{SEL})", f"waiting {m}"),
                (f"sum by (model_name) (tokenmill_requests_in_flight{SEL})", f"in flight {m}")]),
        _panel("timeseries", "TTFT split: queue and prefill",
               "Queue time and prefill time p99 against TTFT p99: which one TTFT grew from "
               "(queueing or a slow prefill).", "s",
               [(_hq(0.99, TTFT), f"TTFT p99 {m}"),
                (_hq(0.99, "tokenmill_request_queue_time_seconds"), f"queue p99 {m}"),
                (_hq(0.99, "tokenmill_request_prefill_time_seconds"), f"prefill p99 {m}")]),
        _panel("timeseries", "KV cache usage", "Share of KV-cache blocks held by requests.",
               "percentunit",
               [(f"max by (model_name) (tokenmill_kv_cache_usage_perc{SEL})", m)]),
        _panel("timeseries", "Preemptions", "Requests preempted per second (KV pressure).",
               "short", [(_rate("tokenmill_num_preemptions_total"), m)]),
        _panel("timeseries", "Tokens per second", "Prompt and output tokens per second.",
               "tok/s",
               [(_rate("tokenmill_prompt_tokens_total"), f"prompt {m}"),
                (_rate("tokenmill_generation_tokens_total"), f"output {m}")]),
        _panel("timeseries", "Errors by type", "Requests ending in an error per second, by type.",
               "reqps",
               [(_rate("tokenmill_request_errors_total", "model_name, error_type"),
                 "{{error_type}} {{model_name}}")]),
        _panel("timeseries", "Prefix-cache hit rate",
               "Prompt tokens served from the prefix cache / prompt tokens looked up.",
               "percentunit",
               [(f"{_rate('tokenmill_prefix_cache_hits_total')} / "
                 f"{_rate('tokenmill_prefix_cache_queries_total')}", m)]),
        _panel("timeseries", "E2E latency", "End-to-end request latency: p50 and p99.", "s",
               [(_hq(0.5, "tokenmill_e2e_request_latency_seconds"), f"p50 {m}"),
                (_hq(0.99, "tokenmill_e2e_request_latency_seconds"), f"p99 {m}")]),
    ]  # fmt: skip


def _layout(tiles: list[dict], charts: list[dict]) -> list[dict]:
    """Stat tiles 4 wide, 6 to a row; charts 12 wide, two to a row, below them."""
    panels, y = [], 0
    for i, p in enumerate(tiles):
        p["gridPos"] = {"x": (i % 6) * 4, "y": (i // 6) * 4, "w": 4, "h": 4}
        panels.append(p)
    y = -(-len(tiles) // 6) * 4
    for i, p in enumerate(charts):
        p["gridPos"] = {"x": (i % 2) * 12, "y": y + (i // 2) * 8, "w": 12, "h": 8}
        panels.append(p)
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    return panels


def dashboard(title: str = "tokenmill Overview") -> dict:
    """The dashboard as Grafana's JSON model (import it, or provision the file)."""
    return {
        "title": title,
        "uid": UID,
        "tags": ["tokenmill"],
        "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {
                        "query": "label_values(tokenmill_num_requests_running, model_name)",
                        "refId": "model_name",
                    },
                    "definition": "label_values(tokenmill_num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {},
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
        "panels": _layout(_tiles(), _charts()),
    }


def render(title: str = "tokenmill Overview") -> str:
    """The dashboard JSON text (indented, ends with a newline)."""
    import json

    return json.dumps(dashboard(title), indent=2) + "\n"
