"""`tokenmill proxy` in front of an upstream OpenAI-style server: bytes unchanged, the trace joined
through traceparent, one request row per request with client-side TTFT and ITL, and each way an
upstream fails answered in OpenAI's error shape and recorded.

The upstream here is a real HTTP server on 127.0.0.1 whose answers are scripted per request
(its `model` field picks the behaviour): how an upstream misbehaves is what is under test. The
proxy in front of the real engine is `benchmarks/any_engine.py`'s and the scenarios' job."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tokenmill.engine.api.gateway import Gateway, single_key_tenants
from tokenmill.proxy.app import ProxyState, build_proxy_app
from tokenmill.telemetry.store import TraceStore

GAP_S = 0.05  # between the scripted upstream's stream events
FIXTURES = Path(__file__).resolve().parents[1] / "telemetry" / "fixtures"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Serve:
    """A uvicorn server for ``app`` on its own thread."""

    def __init__(self, app):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return
            time.sleep(0.02)
        raise RuntimeError("server did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def _events(n: int, model: str) -> list[bytes]:
    out = []
    for i in range(n):
        ev = {
            "id": "chatcmpl-up1",
            "model": model,
            "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
        }
        out.append(b"data: " + json.dumps(ev).encode() + b"\n\n")
    last = {
        "id": "chatcmpl-up1",
        "model": model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
    }
    return [*out, b"data: " + json.dumps(last).encode() + b"\n\n", b"data: [DONE]\n\n"]


def upstream_app(seen: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "up-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen["traceparent"] = request.headers.get("traceparent")
        seen["authorization"] = request.headers.get("authorization")
        seen["body"] = body
        mode = body.get("model")
        if mode == "json-ok":
            return JSONResponse(
                {
                    "id": "chatcmpl-j1",
                    "model": mode,
                    "choices": [
                        {"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                }
            )
        if mode == "refuse":
            return JSONResponse({"error": {"message": "model is overloaded"}}, status_code=503)
        if mode == "slow-first-byte":
            await asyncio.sleep(3)
        events = _events(int(body.get("max_tokens", 5)), mode)
        if mode == "no-usage":  # a stream without the final usage frame
            events = [e for e in events if b'"usage"' not in e]
        if mode == "malformed":
            events.insert(1, b"data: {this is not json\n\n")

        async def gen():
            seen["open"] = seen.get("open", 0) + 1
            seen["open_max"] = max(seen.get("open_max", 0), seen["open"])
            try:
                for ev in events:
                    yield ev
                    await asyncio.sleep(GAP_S)
            except BaseException:
                seen["cancelled"] = True
                raise
            finally:
                seen["open"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture
def rig(tmp_path):
    seen: dict = {}
    up = _Serve(upstream_app(seen))
    store = TraceStore(tmp_path / "proxy.duckdb", flush_interval_s=0.05)
    state = ProxyState(up.url, store.submit, first_byte_timeout_s=1.0)
    px = _Serve(build_proxy_app(state))

    def rows(sql: str):
        assert store.flush()
        return store.query(sql)

    yield px.url, up, seen, rows, state
    px.stop()
    up.stop()
    store.close()


def _chat(url: str, model: str, stream: bool = True, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json={**body, **kw}, timeout=30)


def test_a_stream_passes_through_unchanged_and_is_recorded(rig):
    url, up, seen, rows, _ = rig
    direct = httpx.post(
        up.url + "/v1/chat/completions",
        json={"model": "stream-ok", "messages": [], "stream": True, "max_tokens": 6},
        timeout=30,
    )
    r = _chat(url, "stream-ok", max_tokens=6)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == direct.content  # byte for byte
    # the upstream got our trace: its spans join the proxy's trace
    tp = seen["traceparent"].split("-")
    (row,) = rows(
        "SELECT trace_id, request_id, ttft_ms, itl_p50_ms, output_tokens, input_tokens, "
        "finish_reason, http_status, error_type, endpoint, stream FROM requests"
    )
    assert row[0] == tp[1] and row[1] == "chatcmpl-up1"
    assert row[2] > 0 and row[2] < 1000
    assert row[3] == pytest.approx(GAP_S * 1e3, rel=0.6)  # the upstream's gap between events
    assert row[4:] == (6, 7, "length", 200, None, "chat", True)
    spans = dict(rows("SELECT name, parent_span_id FROM spans"))
    root = rows("SELECT span_id FROM spans WHERE kind = 'SERVER'")[0][0]
    assert root == tp[2]  # the upstream's parent is the proxy's request span
    assert spans == {"chat stream-ok": None, "gateway": root, "stream": root}


def test_the_model_list_passes_through(rig):
    url, up, _, rows, _ = rig
    r = httpx.get(url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.content == httpx.get(up.url + "/v1/models").content
    assert rows("SELECT count(*) FROM requests") == [(0,)]  # not a request to the model


def test_a_callers_traceparent_is_kept(rig):
    url, _, seen, rows, _ = rig
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "json-ok", "messages": []},
        headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-j1"
    assert seen["traceparent"].split("-")[1] == trace
    assert rows("SELECT trace_id, output_tokens, input_tokens FROM requests") == [(trace, 2, 5)]


def test_upstream_down_is_a_502_naming_it_and_recorded(tmp_path):
    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    dead = f"http://127.0.0.1:{_free_port()}"
    px = _Serve(build_proxy_app(ProxyState(dead, store.submit)))
    try:
        r = _chat(px.url, "x")
        assert r.status_code == 502
        err = r.json()["error"]
        assert dead in err["message"] and err["code"] == "upstream_unreachable"
        assert store.flush()
        assert store.query("SELECT http_status, error_type, finish_reason FROM requests") == [
            (502, "upstream_unreachable", "error")
        ]
    finally:
        px.stop()
        store.close()


def test_a_slow_first_byte_is_a_504_after_the_timeout(rig):
    url, _, _, rows, _ = rig
    t = time.monotonic()
    r = _chat(url, "slow-first-byte")
    assert r.status_code == 504 and "no first byte in 1 s" in r.json()["error"]["message"]
    assert time.monotonic() - t < 2.9  # the proxy did not wait for the upstream's 3 s
    assert rows("SELECT error_type FROM requests") == [("upstream_timeout",)]


def test_an_upstream_refusal_passes_through_and_is_recorded(rig):
    url, _, _, rows, _ = rig
    r = _chat(url, "refuse", stream=False)
    assert r.status_code == 503 and r.json()["error"]["message"] == "model is overloaded"
    assert rows("SELECT http_status, error_type FROM requests") == [(503, "upstream_error")]


def test_a_malformed_stream_is_relayed_and_marked(rig):
    url, _, _, rows, _ = rig
    r = _chat(url, "malformed", max_tokens=3)
    assert r.status_code == 200 and b"{this is not json" in r.content
    assert rows("SELECT error_type, output_tokens FROM requests") == [
        ("upstream_malformed_stream", 3)
    ]


def test_a_client_that_leaves_cancels_the_upstream(rig):
    url, _, seen, rows, _ = rig
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={"model": "long", "messages": [], "stream": True, "max_tokens": 200},
        timeout=30,
    ) as r:
        for _ in r.iter_raw():
            break  # one piece, then hang up
    for _ in range(100):
        if seen.get("cancelled"):
            break
        time.sleep(0.05)
    assert seen.get("cancelled") is True  # 200 events would take 10 s
    for _ in range(100):
        got = rows("SELECT finish_reason, error_type FROM requests")
        if got:
            break
        time.sleep(0.05)
    assert got == [("abort", "client_disconnected")]


def test_bad_body_and_missing_key_never_reach_the_upstream(tmp_path):
    seen: dict = {}
    up = _Serve(upstream_app(seen))
    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    gateway = Gateway(single_key_tenants("sk-proxy-0123456789"))
    px = _Serve(build_proxy_app(ProxyState(up.url, store.submit, gateway=gateway)))
    try:
        r = httpx.post(px.url + "/v1/chat/completions", json={"model": "json-ok"}, timeout=10)
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        auth = {"authorization": "Bearer sk-proxy-0123456789"}
        r = httpx.post(px.url + "/v1/chat/completions", content=b"[1, 2", headers=auth, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        assert seen == {}  # nothing was forwarded
        r = httpx.post(
            px.url + "/v1/chat/completions", json={"model": "json-ok"}, headers=auth, timeout=10
        )
        assert r.status_code == 200 and seen["authorization"] == auth["authorization"]
        assert store.flush()
        assert sorted(store.query("SELECT http_status FROM requests")) == [(200,), (400,), (401,)]
    finally:
        px.stop()
        up.stop()
        store.close()


def test_with_the_receiver_the_upstreams_spans_join_the_proxys_trace(tmp_path):
    """`--otlp-receiver`: the upstream exports its request span (vLLM's, from the fixture) with
    the traceparent the proxy sent it, to the proxy's own /v1/traces; one trace in one store
    then holds the proxy's stations and the engine's."""
    from pathlib import Path

    from tokenmill.telemetry.collect import add_receiver

    seen: dict = {}
    up = _Serve(upstream_app(seen))
    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    app = build_proxy_app(ProxyState(up.url, store.submit))
    add_receiver(app, store, request_rows=False)
    px = _Serve(app)
    try:
        assert _chat(px.url, "json-ok", stream=False).status_code == 200
        _, trace, parent, _ = seen["traceparent"].split("-")
        fixture = Path(__file__).resolve().parents[1] / "telemetry/fixtures/otlp"
        doc = json.loads((fixture / "vllm_request_span.json").read_text())
        span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        span["traceId"], span["parentSpanId"] = trace, parent
        r = httpx.post(px.url + "/v1/traces", json=doc, timeout=10)
        assert r.status_code == 200, r.text
        assert store.flush()
        names = store.query(
            "SELECT c.name, p.name FROM spans c LEFT JOIN spans p ON c.parent_span_id = "
            f"p.span_id WHERE c.trace_id = '{trace}' ORDER BY c.start_ns, c.name"
        )
        assert sorted(names, key=str) == sorted(
            [
                ("chat json-ok", None),
                ("gateway", "chat json-ok"),
                ("stream", "chat json-ok"),
                ("llm_request", "chat json-ok"),
                ("schedule", "llm_request"),
                ("prefill", "llm_request"),
                ("decode", "llm_request"),
            ],
            key=str,
        )
        # one request, one row: the proxy's (the engine's span adds stations, not a row)
        assert store.query("SELECT count(*) FROM requests") == [(1,)]
    finally:
        px.stop()
        up.stop()
        store.close()


def test_the_diagnosis_of_a_dead_upstream_names_it(tmp_path):
    """Every request through the proxy fails on an upstream that is down: `error_spike` fires
    on the proxy's store and its first cause names that upstream."""
    from tokenmill.diagnose.findings import diagnose

    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    dead = f"http://127.0.0.1:{_free_port()}"
    px = _Serve(build_proxy_app(ProxyState(dead, store.submit)))
    try:
        for _ in range(12):
            assert _chat(px.url, "x").status_code == 502
            time.sleep(0.05)
        assert store.flush()
        with store.connection_locked() as con:
            report = diagnose(con, window_s=10)
    finally:
        px.stop()
        store.close()
    top = report.findings[0]
    assert top.rule_id == "error_spike", [f.rule_id for f in report.findings]
    assert top.evidence["errors_by_type"] == {"upstream_unreachable": 12}
    assert top.evidence["upstreams"] == [dead]
    assert top.causes[0].startswith(f"the upstream engine {dead}")
    assert "no engine steps" in top.summary
    # what a proxy's store cannot feed is said, not taken for health
    assert "kv_block_leak" in report.not_assessed


def _proxy_cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tokenmill.engine.cli", "proxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--scrape-interval", "-1s", "--scrape-interval: bad duration"),
        ("--scrape-interval", "soon", "--scrape-interval"),
        ("--metrics-url", "ftp://x/metrics", "--metrics-url ftp://x/metrics"),
        ("--tokenizer", "/nonexistent/tok", "--tokenizer /nonexistent/tok: no such folder"),
        ("--max-in-flight", "-1", "--max-in-flight"),
        ("--max-body-bytes", "10", "--max-body-bytes"),
    ],
)
def test_bad_proxy_flags_are_one_line_and_exit_2(tmp_path, flag, value, needle):
    p = _proxy_cli("--upstream", "http://127.0.0.1:9", "--port", str(_free_port()),
                   "--trace-db", str(tmp_path / "p.duckdb"), flag, value)  # fmt: skip
    _out, err = p.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], (p.returncode, err)
    assert not (tmp_path / "p.duckdb").exists()  # nothing started, nothing written


def test_the_proxy_scrapes_its_upstreams_metrics_into_engine_samples(tmp_path):
    """`tokenmill proxy` as a process before an upstream that serves vLLM's exposition text:
    its gauges land in `engine_samples`, kind read from the names."""
    text = (FIXTURES / "metrics" / "vllm.prom").read_text()
    app = upstream_app({})
    app.add_api_route("/metrics", lambda: PlainTextResponse(text), methods=["GET"])
    up = _Serve(app)
    db = tmp_path / "p.duckdb"
    port = _free_port()
    p = _proxy_cli("--upstream", up.url, "--port", str(port), "--trace-db", str(db),
                   "--scrape-interval", "0.2s")  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        time.sleep(1.5)  # several scrapes
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=30)
        up.stop()
    con = duckdb.connect(str(db), read_only=True)
    try:
        n, kinds, urls, waiting = con.execute(
            "SELECT count(*), list(DISTINCT engine_kind), list(DISTINCT url), max(waiting) "
            "FROM engine_samples"
        ).fetchone()
    finally:
        con.close()
    assert n >= 3 and kinds == ["vllm"] and urls == [up.url + "/metrics"]
    assert waiting is not None


def test_past_max_in_flight_a_429_is_recorded_and_the_slot_is_held_until_the_stream_ends(
    tmp_path,
):
    """Two forwarded at once: the third, sent while both stream, is refused with 429
    `queue_full` naming the limit; once they finish, a new one goes through."""
    up = _Serve(upstream_app({}))
    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    px = _Serve(build_proxy_app(ProxyState(up.url, store.submit, max_in_flight=2)))
    try:
        with httpx.Client(timeout=30) as c:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True, "max_tokens": 20}  # fmt: skip
            with (
                c.stream("POST", px.url + "/v1/chat/completions", json=body) as a,
                c.stream("POST", px.url + "/v1/chat/completions", json=body) as b,
            ):
                assert a.status_code == b.status_code == 200
                third = _chat(px.url, "m")
                assert third.status_code == 429, third.text
                err = third.json()["error"]
                assert err["code"] == "queue_full" and "--max-in-flight 2" in err["message"]
                assert third.headers["retry-after"] == "2"
                a.read(), b.read()
            assert _chat(px.url, "m", max_tokens=2).status_code == 200
        assert store.flush()
        rows = store.query("SELECT http_status, error_type FROM requests ORDER BY arrival_ns")
    finally:
        px.stop()
        up.stop()
        store.close()
    assert sorted(rows, key=str) == sorted(
        [(200, None), (200, None), (429, "queue_full"), (200, None)], key=str
    )


def test_the_tokenize_station_counts_prompts_and_holds_the_tenants_limit(tmp_path, smollm2_dir):
    """With the upstream model's tokenizer: a stream without `usage` gets the proxy's count
    (the chat template's tokens included) and a `tokenize` station; a tenant whose prompt limit
    it passes gets a 400 naming `messages`, never forwarded."""
    from tokenmill.engine.api.gateway import Tenant, Tenants, hash_key
    from tokenmill.engine.tokenizer import encode_chat, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    seen: dict = {}
    up = _Serve(upstream_app(seen))
    tenants = Tenants(
        wide=Tenant(name="wide", key_sha256=hash_key("k-wide")),
        narrow=Tenant(name="narrow", key_sha256=hash_key("k-narrow"), max_prompt_tokens=5),
    )
    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    state = ProxyState(up.url, store.submit, gateway=Gateway(tenants), tokenizer=tok)
    px = _Serve(build_proxy_app(state))
    text = "tell me about the sea and the ships on it"
    expect = len(encode_chat(tok, [{"role": "user", "content": text}]))
    try:

        def chat(key: str) -> httpx.Response:
            body = {"model": "no-usage", "stream": True, "max_tokens": 3,
                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
            return httpx.post(px.url + "/v1/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {key}"})  # fmt: skip

        assert chat("k-wide").status_code == 200
        seen.clear()
        r = chat("k-narrow")
        assert r.status_code == 400 and "body" not in seen  # never forwarded
        err = r.json()["error"]
        assert err["param"] == "messages" and err["code"] == "prompt_too_long"
        assert f"is {expect} tokens" in err["message"] and "allows 5" in err["message"]
        assert store.flush()
        rows = store.query(
            "SELECT tenant, http_status, input_tokens FROM requests ORDER BY arrival_ns"
        )
        stations = store.query("SELECT count(*) FROM spans WHERE name = 'tokenize'")
    finally:
        px.stop()
        up.stop()
        store.close()
    assert expect > len(text.split())  # the template's tokens counted too
    assert rows == [("wide", 200, expect), ("narrow", 400, expect)]
    assert stations == [(2,)]


def test_a_metrics_404_is_one_warning_and_its_rules_are_not_assessed(tmp_path):
    """An upstream without `/metrics` (404): the proxy says so once, keeps serving, and the
    diagnosis of its store lists the queue and KV rules as not assessed."""
    from tokenmill.diagnose.findings import diagnose

    up = _Serve(upstream_app({}))  # no /metrics route: 404
    db = tmp_path / "p.duckdb"
    port = _free_port()
    p = _proxy_cli("--upstream", up.url, "--port", str(port), "--trace-db", str(db),
                   "--scrape-interval", "0.2s")  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for _ in range(4):
            assert _chat(url, "m", max_tokens=3).status_code == 200
        time.sleep(1.0)  # several failed scrapes
    finally:
        p.send_signal(signal.SIGINT)
        _out, err = p.communicate(timeout=30)
        up.stop()
    warnings = [line for line in err.splitlines() if ": 404:" in line]
    assert len(warnings) == 1 and up.url + "/metrics" in warnings[0], err
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM engine_samples").fetchone() == (0,)
        report = diagnose(con, window_s=5)
    finally:
        con.close()
    assert report.summary["requests"] == 4
    for rid in ("ttft_queueing", "kv_pressure_preemption", "overload"):
        assert "per-step records" in report.not_assessed[rid], report.not_assessed.get(rid)


def value_of(text: str, name: str) -> float:
    """The value of the first sample of ``name`` in an exposition."""
    line = next(ln for ln in text.splitlines() if ln.split("{")[0].split(" ")[0] == name)
    return float(line.rsplit(" ", 1)[1])


def test_the_proxys_own_metrics_count_what_its_clients_saw(rig):
    """`GET /metrics` on the proxy: requests by status, nothing left in flight, one TTFT and
    the stream's gaps observed; no tenant label; a scraper does not take it for an engine."""
    from tokenmill.telemetry.engine_metrics import detect_kind, parse_samples

    url, up, _seen, rows, _state = rig
    assert _chat(url, "ok", max_tokens=4).status_code == 200
    assert _chat(url, "refuse").status_code == 503
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = parse_samples(text)
    tag = f'upstream="{up.url}"'

    def value(name: str, extra: str = "") -> float:
        line = next(
            ln for ln in text.splitlines()
            if ln.startswith(name + "{") and tag in ln and extra in ln
        )  # fmt: skip
        return float(line.rsplit(" ", 1)[1])

    assert value("tokenmill_proxy_requests_total", 'code="200"') == 1
    assert value("tokenmill_proxy_requests_total", 'code="503"') == 1
    assert value("tokenmill_proxy_requests_in_flight") == 0
    assert value("tokenmill_proxy_time_to_first_token_seconds_count") == 1
    assert value("tokenmill_proxy_inter_token_latency_seconds_count") == 3  # 4 events, 3 gaps
    assert value("tokenmill_proxy_generation_tokens_total") == 4
    assert "tenant" not in text
    # the exporter conventions: the process's own series, no *_created beside the counters
    assert value_of(text, "process_resident_memory_bytes") > 0
    assert "_created" not in text
    assert detect_kind(samples) is None
    # Prometheus' naming conventions, as its own linter reads them
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout
    assert rows("SELECT count(*) FROM requests") == [(2,)]


def test_past_a_hundred_streams_none_wait_unseen_in_the_proxy(rig):
    """Without --max-in-flight the proxy has no limit of its own: 130 streams at once are all
    open at the upstream together (an HTTP client's default pool of 100 connections would hold
    30 back unrecorded)."""
    url, _, seen, rows, _ = rig
    n = 130

    async def one(ac):
        body = {"model": "stream-ok", "messages": [], "stream": True, "max_tokens": 40}
        async with ac.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_raw():
                pass

    async def main():
        limits = httpx.Limits(max_connections=n + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits) as ac:
            await asyncio.gather(*(one(ac) for _ in range(n)))

    asyncio.run(main())
    assert seen["open_max"] == n, seen["open_max"]
    assert rows("SELECT count(*), count(*) FILTER (http_status = 200) FROM requests") == [(n, n)]


def test_a_tenants_rate_limit_is_held_at_the_proxy_as_serve_holds_it(tmp_path):
    """The live soak through the proxy sent one tenant 100 requests in 90 s against its 20 a
    minute and all went upstream: the proxy authenticated tenants but held none of their
    limits. Now the third request in a minute of a tenant allowed 2 gets serve's 429
    (`rate_limit_exceeded`, Retry-After), is never forwarded and is recorded with that error;
    another tenant is not held back, and every admitted request gives its place back."""
    from tokenmill.engine.api.gateway import Tenant, Tenants, hash_key

    seen: dict = {}
    up = _Serve(upstream_app(seen))
    tenants = Tenants(
        slow=Tenant(name="slow", key_sha256=hash_key("k-slow"), requests_per_minute=2),
        free=Tenant(name="free", key_sha256=hash_key("k-free")),
    )
    gateway = Gateway(tenants)
    store = TraceStore(tmp_path / "p.duckdb", flush_interval_s=0.05)
    px = _Serve(build_proxy_app(ProxyState(up.url, store.submit, gateway=gateway)))
    try:

        def chat(key: str, stream: bool) -> httpx.Response:
            body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]}
            return httpx.post(px.url + "/v1/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {key}"})  # fmt: skip

        codes = [chat("k-slow", True).status_code, chat("k-slow", False).status_code]
        seen.clear()
        refused = chat("k-slow", True)
        forwarded = "body" in seen
        other = chat("k-free", True).status_code
        assert store.flush()
        rows = store.query(
            "SELECT tenant, http_status, error_type FROM requests ORDER BY arrival_ns"
        )
    finally:
        px.stop()
        up.stop()
        store.close()
    assert codes == [200, 200] and other == 200
    assert refused.status_code == 429 and not forwarded
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 0 < float(refused.headers["retry-after"]) <= 60
    assert rows[2] == ("slow", 429, "rate_limit_exceeded"), rows
    assert [r[1] for r in rows] == [200, 200, 429, 200]
    assert tenants["slow"].in_flight == 0 and tenants["free"].in_flight == 0
