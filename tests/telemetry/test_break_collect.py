"""`tokenmill collect` fed exports that try to break it: a vLLM request span whose latency
attributes are negative is kept, but no negative time reaches a station span or the requests
row (a negative latency is no time, as NaN and ±Inf are)."""

from __future__ import annotations

import json


def _attr(key: str, value: float) -> dict:
    return {"key": key, "value": {"doubleValue": value}}


def test_negative_vllm_latencies_are_no_time(collector):
    client, store = collector
    attrs = [
        {"key": "gen_ai.request.id", "value": {"stringValue": "neg"}},
        _attr("gen_ai.latency.time_in_queue", -5.0),
        _attr("gen_ai.latency.time_to_first_token", -1.0),
        _attr("gen_ai.latency.time_in_model_prefill", -2.0),
        _attr("gen_ai.latency.time_in_model_decode", 0.5),
        _attr("gen_ai.latency.e2e", -3.0),
    ]
    span = {
        "traceId": "01" * 16,
        "spanId": "02" * 8,
        "name": "llm_request",
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001000000000",
        "attributes": attrs,
    }
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}
    r = client.post("/v1/traces", content=json.dumps(doc),
                    headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert store.flush()
    durations = store.query("SELECT name, end_ns - start_ns FROM spans ORDER BY name")
    assert all(d >= 0 for _, d in durations), durations
    assert [n for n, _ in durations] == ["decode", "llm_request"]
    (row,) = store.query("SELECT ttft_ms, queue_ms, prefill_ms, decode_ms, e2e_ms FROM requests")
    assert row == (None, None, None, 500.0, 1000.0)  # e2e from the span itself
