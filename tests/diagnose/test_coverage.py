"""Partial observability: a store collected from another engine (its request spans through the
OTLP receiver, its /metrics through the scraper) is diagnosed on what it holds, and the report
names every rule it could not assess and what that rule needed, never a bare "no problems".

vLLM needs a GPU: its request spans and metrics are the fixtures written from its published
definitions (tests/telemetry/fixtures, docs/engine_metrics.md)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from tokenmill.diagnose.findings import diagnose
from tokenmill.diagnose.report import print_text, to_markdown
from tokenmill.diagnose.rules import RULES
from tokenmill.diagnose.signals import FAMILIES
from tokenmill.telemetry.engine_metrics import read_exposition
from tokenmill.telemetry.otlp_receiver import decode_export, received_rows
from tokenmill.telemetry.store import TraceStore

FIXTURES = Path(__file__).resolve().parents[1] / "telemetry" / "fixtures"
SPAN = json.loads((FIXTURES / "otlp" / "vllm_request_span.json").read_text())


def _export(i: int, start_ns: int, queue_s: float) -> bytes:
    """The fixture's vLLM request span as request ``i``: its own ids, arriving at
    ``start_ns``, waiting ``queue_s`` in vLLM's queue (TTFT and E2E grow with it)."""
    doc = copy.deepcopy(SPAN)
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = f"{i + 1:032x}"
    span["spanId"] = f"{i + 1:016x}"
    span.pop("parentSpanId", None)
    attrs = {a["key"]: a["value"] for a in span["attributes"]}
    attrs["gen_ai.request.id"] = {"stringValue": f"req-{i}"}
    attrs["gen_ai.latency.time_in_queue"] = {"doubleValue": queue_s}
    attrs["gen_ai.latency.time_to_first_token"] = {"doubleValue": queue_s + 0.55}
    attrs["gen_ai.latency.e2e"] = {"doubleValue": queue_s + 3.75}
    span["attributes"] = [{"key": k, "value": v} for k, v in attrs.items()]
    span["startTimeUnixNano"] = str(start_ns)
    span["endTimeUnixNano"] = str(start_ns + int((queue_s + 3.75) * 1e9))
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def vllm_store(tmp_path_factory):
    """Two minutes of a vLLM server seen through `tokenmill collect`: a request every second,
    its metrics every 5 s."""
    path = tmp_path_factory.mktemp("collected") / "vllm.duckdb"
    store = TraceStore(path, flush_interval_s=0.05)
    t0 = 1_767_225_600_000_000_000
    for i in range(120):
        export = decode_export(_export(i, t0 + i * 10**9, 0.25), "application/json")
        rows = received_rows(export).rows
        for table, table_rows in rows.items():
            for row in table_rows:
                assert store.submit(table, row)
    text = (FIXTURES / "metrics" / "vllm.prom").read_text()
    for k in range(24):
        row = read_exposition(text, "http://vllm:8000/metrics", t0 + k * 5 * 10**9)
        assert store.submit("engine_samples", msgspec.structs.asdict(row))
    assert store.flush()
    yield store
    store.close()


def test_a_vllm_store_names_what_it_could_not_assess(vllm_store):
    with vllm_store.connection_locked() as con:
        report = diagnose(con, window_s=10)
    # the requests are read from vLLM's spans: their count and TTFT (queue 0.25 s + 0.55 s)
    assert report.summary["requests"] == 120
    assert report.summary["ttft_p50_ms"] == pytest.approx(800.0)
    missing = report.not_assessed
    # every rule that reads a family only our step records or device samples feed: named,
    # with what it needed; the queue and KV families come from vLLM's own gauges and counters
    # and the same-work comparison from the requests' time per token
    assert report.signal_sources == {
        "steps": "steps_from_samples",
        "kv": "kv_from_samples",
        "same_work": "same_work_from_requests",
    }
    ours_only = {
        f.name
        for f in FAMILIES
        if f.fallback is None and {"engine_steps", "device_samples"} & set(f.needs)
    }
    assert {"roofline", "spec", "devices", "step_split"} <= ours_only
    for rule in RULES:
        if ours_only & set(rule.reads):
            assert rule.id in missing, rule.id
    assert "per-step records (engine_steps)" in missing["host_bound_steps"]
    assert missing["host_bound_steps"].endswith("which this vllm store does not hold")
    assert "device samples" in missing["host_contention"]
    # what the requests and vLLM's metrics feed is assessed
    for rid in ("ttft_prefill_bound", "prefix_cache_miss", "midstream_stall", "ttft_queueing",
                "overload", "kv_pressure_preemption"):  # fmt: skip
        assert rid not in missing, (rid, missing.get(rid))
    assert report.to_json()["not_assessed"] == missing
    md = to_markdown(report)
    assert "## Not assessed" in md and f"- `host_bound_steps`: {missing['host_bound_steps']}" in md
    assert "queue and KV-cache signals come from its scraped /metrics" in md
    if not report.findings:
        assert "among the rules this store lets us assess" in md
    console = Console(record=True, width=200)
    print_text(report, console)
    text = console.export_text()
    assert f"not assessed ({len(missing)} rules" in text


def test_our_own_store_of_a_real_run_has_every_rule_assessed():
    """A real-engine run (the corpus's healthy one) holds steps, devices and requests: nothing
    is listed as not assessed."""
    from tokenmill.telemetry.dump import open_dump

    run = Path(__file__).resolve().parents[2] / "benchmarks/data/diagnosis_corpus/healthy-1"
    if not run.is_dir():
        pytest.skip("no corpus")
    con = open_dump(run / "dump", verify=False)
    try:
        report = diagnose(con, window_s=10)
    finally:
        con.close()
    assert report.findings == [] and report.not_assessed == {}
