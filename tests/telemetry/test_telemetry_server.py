"""Telemetry end to end: a real server with a tiny KV pool under a mixed load (streamed and not,
one aborted, one rejected, preemptions), then the DuckDB trace store and /metrics are checked
against each other. Plus: a store that cannot be written never stops serving."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import duckdb
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server

from tokenmill.engine.api.gateway import hash_key
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.telemetry.latency import percentile
from tokenmill.telemetry.spans import STATIONS

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY = "sk-trace-123"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _wait_idle(server: Server, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = server.health()
        if h["in_flight"] == 0 and not h["engine"]["stats"].get("num_running"):
            return
        time.sleep(0.2)
    raise AssertionError(f"server never went idle: {h}")


async def _mixed_load(url: str) -> dict:
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 48,
        "ignore_eos": True,
    }
    comp = {"model": MODEL, "prompt": "The history of bread", "max_tokens": 48, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=300) as ac:

        async def streamed(i: int, extra_headers: dict | None = None) -> int:
            headers = {**auth, "x-request-id": f"stream-{i}", **(extra_headers or {})}
            n = 0
            async with ac.stream(
                "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=headers
            ) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
            return n

        async def plain(i: int) -> dict:
            r = await ac.post(
                "/v1/completions", json=comp, headers={**auth, "x-request-id": f"plain-{i}"}
            )
            assert r.status_code == 200, r.text
            return r.json()

        async def aborted() -> None:
            body = {**chat, "max_tokens": 100, "stream": True}  # fits the 160-token pool
            headers = {**auth, "x-request-id": "aborted-0"}
            async with ac.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen >= 4:
                        break  # leave mid-stream: the connection closes under the server

        async def rejected() -> int:
            r = await ac.post(
                "/v1/chat/completions",
                json=chat,
                headers={"Authorization": "Bearer sk-wrong", "x-request-id": "rejected-0"},
            )
            return r.status_code

        results = await asyncio.gather(
            streamed(0, {"traceparent": TRACEPARENT}),
            streamed(1),
            streamed(2),
            plain(0),
            plain(1),
            aborted(),
            rejected(),
        )
    return {"rejected_status": results[-1], "plain": results[3:5]}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("traced")
    (tmp / "tenants.toml").write_text(f'[tenants.alpha]\nkey_sha256 = "{hash_key(KEY)}"\n')
    db = tmp / "traces.duckdb"
    # 10 blocks of 16 tokens: four ~90-token requests cannot all grow, so some are preempted
    server = Server(
        tmp,
        "--model",
        str(smollm2_dir),
        "--tenants",
        str(tmp / "tenants.toml"),
        "--num-gpu-blocks-override",
        "10",
        "--max-num-seqs",
        "4",
        "--trace-db",
        str(db),
        "--device-sample-interval",
        "0.05",
        "--open-metrics",  # a keyed server whose /metrics any caller may scrape
    )
    try:
        load = asyncio.run(_mixed_load(server.url))
        _wait_idle(server)
        time.sleep(0.5)  # the aborted request's engine record arrives after its stream ended
        metrics_text = httpx.get(server.url + "/metrics", timeout=30).text
        health = server.health()
    finally:
        server.stop()
    log = (tmp / f"server-{server.port}.log").read_text()
    con = duckdb.connect(str(db), read_only=True)
    yield {"con": con, "metrics": metrics_text, "health": health, "load": load, "log": log}
    con.close()


def _rows(con, sql: str, params=None) -> list[dict]:
    cur = con.execute(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _completed(con) -> list[dict]:
    return _rows(
        con,
        "SELECT * FROM requests WHERE finish_reason IN ('stop', 'length') AND error_type IS NULL",
    )


def test_every_completed_request_has_one_root_and_eight_ordered_stations(traced):
    con = traced["con"]
    completed = _completed(con)
    assert len(completed) == 5  # 3 streamed + 2 plain
    for req in completed:
        spans = _rows(con, "SELECT * FROM spans WHERE trace_id = ?", [req["trace_id"]])
        roots = [s for s in spans if s["kind"] == "SERVER"]
        assert len(roots) == 1
        root = roots[0]
        op = "chat" if req["endpoint"] == "chat" else "text_completion"
        assert root["name"] == f"{op} {MODEL}"  # the GenAI conventions' root span name
        attrs = json.loads(root["attributes"])
        assert attrs["gen_ai.operation.name"] == op and attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.usage.output_tokens"] == req["output_tokens"]
        assert root["parent_span_id"] is None or req["client_request_id"] == "stream-0"
        assert root["kind"] == "SERVER" and root["request_id"] == req["request_id"]
        children = {s["name"]: s for s in spans if s["kind"] != "SERVER"}
        assert sorted(children) == sorted(STATIONS) and len(spans) == 9
        for s in children.values():
            assert s["parent_span_id"] == root["span_id"]
            assert root["start_ns"] <= s["start_ns"] <= s["end_ns"] <= root["end_ns"]
        starts = [children[n]["start_ns"] for n in STATIONS[:5]]
        assert starts == sorted(starts), f"station starts out of order in {req['request_id']}"
        ends = [children[n]["end_ns"] for n in ("prefill", "decode", "stream", "metering")]
        assert ends == sorted(ends), f"station ends out of order in {req['request_id']}"

        # the requests row agrees with the spans (same numbers: to well under a millisecond)
        ttft = (children["prefill"]["end_ns"] - root["start_ns"]) / 1e6
        assert abs(req["ttft_ms"] - ttft) < 1e-3
        assert abs(req["e2e_ms"] - (root["end_ns"] - root["start_ns"]) / 1e6) < 1e-3
        assert abs(req["queue_ms"] - children["schedule"]["duration_ns"] / 1e6) < 1e-3
        decode_attrs = json.loads(children["decode"]["attributes"])
        itl = decode_attrs["tokenmill.decode.itl_ms"]
        assert len(itl) == req["output_tokens"] - 1 == 47
        assert abs(sum(itl) - children["decode"]["duration_ns"] / 1e6) < 1e-3
        assert abs(req["itl_p50_ms"] - percentile(itl, 50)) < 1e-6
        assert abs(req["itl_p99_ms"] - percentile(itl, 99)) < 1e-6
        assert abs(req["tpot_ms"] - sum(itl) / len(itl)) < 1e-6
        assert root["input_tokens"] == req["input_tokens"] > 0
        assert root["output_tokens"] == 48 and root["finish_reason"] == "length"


def test_incoming_traceparent_is_honoured(traced):
    con = traced["con"]
    (req,) = _rows(con, "SELECT * FROM requests WHERE client_request_id = 'stream-0'")
    trace_id, parent = TRACEPARENT.split("-")[1:3]
    assert req["trace_id"] == trace_id
    (root,) = _rows(con, "SELECT * FROM spans WHERE trace_id = ? AND kind = 'SERVER'", [trace_id])
    assert root["parent_span_id"] == parent


def test_the_engines_request_stats_reach_the_requests_row(traced):
    """RequestStats travels engine -> output -> timeline -> row: each completed request's
    peak KV blocks are the blocks its computed tokens fill (prompt + output - 1: the last
    sampled token's K/V is never computed), its token counts match the usage it was billed,
    and the engine's milestones are ordered."""
    rows = _completed(traced["con"])
    assert len(rows) >= 4
    for r in rows:
        assert r["kv_blocks"] == -(-(r["input_tokens"] + r["output_tokens"] - 1) // 16), r
        assert r["queued_ns"] <= r["scheduled_ns"] <= r["first_token_ns"] <= r["last_token_ns"]
    for body in traced["load"]["plain"]:
        (row,) = [r for r in rows if r["request_id"] == body["id"]]
        assert body["usage"]["prompt_tokens"] == row["input_tokens"]
        assert body["usage"]["completion_tokens"] == row["output_tokens"]


def test_preempted_request_carries_the_preemption_event(traced):
    con = traced["con"]
    preempted = _rows(con, "SELECT * FROM requests WHERE preemptions > 0")
    assert preempted, "the tiny KV pool should have forced a preemption"
    # four ~90-token requests in 10 blocks: some that completed were preempted and resumed
    assert any(r["finish_reason"] in ("stop", "length") for r in preempted), preempted
    steps_with_preemption = {
        r["step_id"] for r in _rows(con, "SELECT step_id FROM engine_steps WHERE num_preempted > 0")
    }
    for req in preempted:
        spans = _rows(con, "SELECT * FROM spans WHERE trace_id = ?", [req["trace_id"]])
        events = [e for s in spans for e in json.loads(s["events"] or "[]")]
        pre = [e for e in events if e["name"] == "preempted"]
        assert len(pre) == req["preemptions"]
        for e in pre:
            assert e["attributes"]["tokenmill.step_id"] in steps_with_preemption
        assert req["recomputed_tokens"] > 0
        if req["finish_reason"] in ("stop", "length"):  # a request cut while preempted
            assert any(e["name"] == "resumed" for e in events)  # (the aborted one) never resumed


def test_rejected_request_has_gateway_span_with_error_type(traced):
    con = traced["con"]
    assert traced["load"]["rejected_status"] == 401
    (req,) = _rows(con, "SELECT * FROM requests WHERE client_request_id = 'rejected-0'")
    assert req["http_status"] == 401 and req["error_type"] == "invalid_api_key"
    assert req["ttft_ms"] is None and req["output_tokens"] == 0
    spans = {
        s["name"]: s
        for s in _rows(con, "SELECT * FROM spans WHERE trace_id = ?", [req["trace_id"]])
    }
    assert {f"chat {MODEL}", "gateway"} <= set(spans) and "tokenize" not in spans
    assert spans["gateway"]["error_type"] == "invalid_api_key"
    assert spans["gateway"]["status_code"] == "ERROR"
    assert spans[f"chat {MODEL}"]["status_code"] == "ERROR"


def test_aborted_request_is_traced_and_its_engine_record_kept(traced):
    con = traced["con"]
    (req,) = _rows(con, "SELECT * FROM requests WHERE client_request_id = 'aborted-0'")
    assert req["finish_reason"] == "abort" and req["error_type"] == "client_disconnected"
    spans = {
        s["name"]: s
        for s in _rows(con, "SELECT * FROM spans WHERE trace_id = ?", [req["trace_id"]])
    }
    assert any(e["name"] == "client_disconnect" for e in json.loads(spans["stream"]["events"]))
    (ev,) = _rows(
        con,
        "SELECT * FROM events WHERE kind = 'request_abort' AND attributes->>'request_id' = ?",
        [req["request_id"]],
    )
    engine_tokens = json.loads(ev["attributes"])["output_tokens"]
    assert req["output_tokens"] <= engine_tokens < 100


def test_engine_steps_account_for_every_generated_token(traced):
    con = traced["con"]
    (sampled,) = con.execute("SELECT sum(num_sampled) FROM engine_steps").fetchone()
    completed = sum(r["output_tokens"] for r in _completed(con))
    (aborted,) = con.execute(
        "SELECT coalesce(sum((attributes->>'output_tokens')::INT), 0) FROM events "
        "WHERE kind = 'request_abort'"
    ).fetchone()
    assert completed == 5 * 48
    assert sampled == completed + aborted
    (steps, bad) = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE end_ns < start_ns OR kv_blocks_used > "
        "kv_blocks_total OR kv_blocks_total != 10) FROM engine_steps"
    ).fetchone()
    assert steps > 48 and bad == 0
    # every working step: the API stamped its outputs' send time on receipt (issue 20 item 1);
    # batches of at most 4 decodes ran the compiled decode step, prefill chunks did not
    (working, sent, bad_send, compiled_decode, compiled_prefill) = con.execute(
        "SELECT count(*), count(output_send_ms), count(*) FILTER (WHERE output_send_ms < 0 "
        "OR output_send_ms > 60000), count(*) FILTER (WHERE compiled AND num_prefill_tokens = 0),"
        " count(*) FILTER (WHERE compiled AND num_prefill_tokens > 0) FROM engine_steps "
        "WHERE num_prefill_tokens + num_decode_tokens > 0"
    ).fetchone()
    assert sent == working and bad_send == 0
    assert compiled_prefill == 0
    assert compiled_decode > 0 or not cpu_kernels.available()
    # every step on CPU records its forward's thread count: between 1 and the allowed cores
    (lo, hi, missing) = con.execute(
        "SELECT min(cpu_threads), max(cpu_threads), count(*) FILTER (WHERE cpu_threads IS NULL) "
        "FROM engine_steps"
    ).fetchone()
    assert missing == 0 and 1 <= lo <= hi <= len(os.sched_getaffinity(0)), (lo, hi, missing)


def test_device_samples_hold_host_rows(traced):
    con = traced["con"]
    (n, rss) = con.execute(
        "SELECT count(*), min(rss_bytes) FROM device_samples WHERE kind = 'host'"
    ).fetchone()
    assert n >= 5 and rss > 0
    kinds = {k for (k,) in con.execute("SELECT DISTINCT kind FROM events").fetchall()}
    assert {"server_start", "config", "request_abort"} <= kinds


def test_metrics_pass_promtool_and_count_completed_requests(traced):
    text = traced["metrics"]
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    ttft_count = samples[("tokenmill_time_to_first_token_seconds_count", (("model_name", MODEL),))]
    assert ttft_count == len(_completed(traced["con"])) == 5
    preemptions = samples[("tokenmill_num_preemptions_total", (("model_name", MODEL),))]
    (stored,) = traced["con"].execute("SELECT sum(num_preempted) FROM engine_steps").fetchone()
    assert preemptions == stored > 0
    assert traced["health"]["telemetry"]["dropped_total"] == 0


# SmolLM2-135M in float32: 106,168,320 linear + 28,311,552 embedding (tied LM head) + 35,136
# norm weights, 4 bytes each
WEIGHT_BYTES_TOTAL = (106_168_320 + 28_311_552 + 35_136) * 4  # 538,060,032


def test_weight_bytes_and_peaks_in_config_event_health_and_metrics(traced):
    """Memory accounting end to end: the engine's weight bytes by dtype reach the config event,
    /health, the startup line and tokenmill_model_weight_bytes; the config event names the
    device's peaks and their sources; every working step carries its roofline numbers."""
    con = traced["con"]
    (attrs,) = con.execute(
        "SELECT attributes FROM events WHERE kind = 'config' ORDER BY time_ns DESC LIMIT 1"
    ).fetchone()
    cfg = json.loads(attrs)
    assert cfg["weight_bytes_total"] == WEIGHT_BYTES_TOTAL
    assert cfg["weight_bytes_by_dtype"] == {"float32": WEIGHT_BYTES_TOTAL}
    assert cfg["kv_cache_bytes"] == 10 * 16 * 46_080  # 10 blocks of 16 tokens
    assert cfg["device_peak_gbps"] > 0 and cfg["device_peak_gflops"] > 0
    assert cfg["device_peak_gbps_source"] in ("probe", "flag") or cfg[
        "device_peak_gbps_source"
    ].startswith("table:")
    assert cfg["device_name"] and cfg["model_dtype"] == "float32"
    health = traced["health"]
    assert health["weight_bytes_total"] == WEIGHT_BYTES_TOTAL
    assert health["weight_bytes_by_dtype"] == {"float32": WEIGHT_BYTES_TOTAL}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(traced["metrics"])
        for s in fam.samples
    }
    key = ("tokenmill_model_weight_bytes", (("dtype", "float32"), ("model_name", MODEL)))
    assert samples[key] == WEIGHT_BYTES_TOTAL
    assert "weights 513.1 MiB (float32 513.1 MiB)" in traced["log"]
    (bad,) = con.execute(
        "SELECT count(*) FROM engine_steps WHERE num_prefill_tokens + num_decode_tokens > 0 "
        "AND NOT (weight_bytes >= 106_168_320 * 4 AND kv_read_bytes > 0 "
        "AND kv_write_bytes = (num_prefill_tokens + num_decode_tokens) * 46_080 AND flops > 0)"
    ).fetchone()
    assert bad == 0


def test_unwritable_trace_store_never_stops_serving(tmp_path, smollm2_dir):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    server = Server(
        tmp_path, "--model", str(smollm2_dir), "--trace-db", str(blocker / "traces.duckdb")
    )
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        _wait_idle(server)
        tel = server.health()["telemetry"]
        assert tel["status"] == "degraded" and "traces.duckdb" in (tel["trace_db"] or "")
        assert tel["store_error"] and tel["dropped"].get("requests", 0) >= 1
        assert tel["dropped"].get("spans", 0) >= 8
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        dropped = {
            s.labels["table"]: s.value
            for fam in text_string_to_metric_families(metrics)
            for s in fam.samples
            if s.name == "tokenmill_telemetry_dropped_total"
        }
        assert dropped["spans"] == tel["dropped"]["spans"] or dropped["spans"] >= 8
    finally:
        server.stop()


def test_diagnose_reads_the_real_engine_store(traced, tmp_path):
    """The diagnoser runs over the store the real server wrote: no rule fails on real rows,
    and its summary agrees with the store."""
    from tokenmill.diagnose.findings import diagnose

    report = diagnose(traced["con"], window_s=2.0)
    assert report.rule_errors == {}
    assert report.summary["completed"] == 5
    assert report.summary["errors_by_type"] == {
        "client_disconnected": 1,
        "invalid_api_key": 1,
    }
    assert report.summary["preemptions"] > 0
    for f in report.findings:
        assert f.example_trace_ids == [] or all(len(t) == 32 for t in f.example_trace_ids)


def test_requests_waiting_for_their_first_token_are_sampled_while_they_wait(traced):
    """``waiting_samples``: each second the API records every request in flight without its
    first token, with its wait so far. Against the requests rows written when they ended: the
    same arrival and prompt size, every sample taken before the request ended (and before its
    first token reached the API, which can be later than the engine sampled it: the samples
    record what the client has not got yet), its wait the sample's time less the arrival; a
    request that waited over two sample periods for its first token was sampled at least
    once."""
    from tokenmill.engine.api.app import WAITING_SAMPLE_S

    con = traced["con"]
    reqs = {r["request_id"]: r for r in _rows(con, "SELECT * FROM requests")}
    samples = _rows(con, "SELECT * FROM waiting_samples ORDER BY time_ns")
    assert samples, "no waiting samples"
    for s in samples:
        r = reqs[s["request_id"]]
        assert s["arrival_ns"] == r["arrival_ns"] and s["prompt_tokens"] == r["input_tokens"]
        assert s["wait_ms"] == pytest.approx((s["time_ns"] - s["arrival_ns"]) / 1e6)
        assert s["time_ns"] < r["end_ns"], (s, r)
        if s["scheduled"]:
            assert r["scheduled_ns"] is not None and r["scheduled_ns"] <= s["time_ns"]
    waits = {
        r["request_id"]: r["first_token_ns"] - r["arrival_ns"]
        for r in reqs.values()
        if r["first_token_ns"]
    }
    # the load makes some request wait past a sample period (about 2 s on a fast VM), and a
    # request that waited over two periods (a tick late at most) was sampled
    assert max(waits.values()) > WAITING_SAMPLE_S * 1e9, sorted(waits.values())
    slow = [rid for rid, wait in waits.items() if wait > 2 * WAITING_SAMPLE_S * 1e9]
    sampled = {s["request_id"] for s in samples}
    assert all(rid in sampled for rid in slow), slow
