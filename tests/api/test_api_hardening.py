"""Operators' bug reports against LLM servers, tried on a real `tokenmill serve` (issue 19, items
1, 2, 8 and 9): a non-streamed request whose client hangs up is aborted at once and its tenant's
slot freed; a cut request is metered with the tokens it consumed (a stream closed mid-way, one
cut while still queued); a stopped server records `server_shutdown`, tells its open streams so
and exits 0 without a traceback; small protocol gaps (the 413's `x-request-id`, strict
`stream_options`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server, free_port

from tokenmill.bench.demo import DemoError, wait_for_stop
from tokenmill.engine.api.gateway import hash_key
from tokenmill.engine.cpu_threads import proc_stat_fields

MODEL = "smollm2-135m-instruct"
KEYS = {
    "solo": "sk-solo-1",
    "meter": "sk-meter-2",
    "queued": "sk-queued-3",
    "hog": "sk-hog-4",
    "spell": "sk-spell-5",
    "capped": "sk-capped-6",
}
ADMIN_KEY = "sk-admin-9"
STORY = "Tell me a long story about a lighthouse keeper and the sea."


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    """One engine slot (max-num-seqs 1), so a second request waits in the engine's queue."""
    tmp = tmp_path_factory.mktemp("hardening")
    tenants = "".join(
        f'[tenants.{name}]\nkey_sha256 = "{hash_key(key)}"\n'
        + ("max_concurrent = 1\n" if name == "solo" else "")
        + ("max_output_tokens = 8\n" if name == "capped" else "")
        for name, key in KEYS.items()
    )
    (tmp / "tenants.toml").write_text(tenants + f'[admin]\nkey_sha256 = "{hash_key(ADMIN_KEY)}"\n')
    srv = Server(
        tmp,
        "--model",
        str(smollm2_dir),
        "--tenants",
        str(tmp / "tenants.toml"),
        "--max-num-seqs",
        "1",
        "--max-body-bytes",
        "4096",
        "--device-sample-interval",
        "0",
    )
    srv.tmp = tmp
    yield srv
    srv.stop()


def _store(srv, tmp_path) -> duckdb.DuckDBPyConnection:
    """A dump of the live store (the admin endpoint flushes it first)."""
    r = httpx.get(
        srv.url + "/admin/dump",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    path = tmp_path / f"dump-{time.monotonic_ns()}.duckdb"
    path.write_bytes(r.content)
    return duckdb.connect(str(path), read_only=True)


def _rows(con, sql: str, params=None) -> list[dict]:
    cur = con.execute(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _request(srv, tmp_path, client_request_id: str) -> tuple[dict, dict, dict | None]:
    """The request's row, its metering span's attributes (None without one) and its
    ``request_abort`` event attributes, once the row is stored (a liveness wait: a cut request
    is recorded when the engine's final record of it arrives)."""
    for _ in range(120):
        con = _store(srv, tmp_path)
        rows = _rows(con, "SELECT * FROM requests WHERE client_request_id = ?", [client_request_id])
        if rows:
            (row,) = rows
            spans = _rows(
                con,
                "SELECT attributes FROM spans WHERE trace_id = ? AND name = 'metering'",
                [row["trace_id"]],
            )
            events = _rows(
                con,
                "SELECT attributes FROM events WHERE kind = 'request_abort' "
                "AND attributes->>'request_id' = ?",
                [row["request_id"]],
            )
            meter = json.loads(spans[0]["attributes"]) if spans else None
            assert len(spans) <= 1 and len(events) <= 1
            return row, meter, json.loads(events[0]["attributes"]) if events else None
        time.sleep(0.5)
    raise AssertionError(f"no requests row for {client_request_id}")


def _counters(srv, tenant: str) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", headers=ADMIN, timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("tenant") == tenant and s.name in (
                "tokenmill_prompt_tokens_total",
                "tokenmill_generation_tokens_total",
            ):
                out[s.name] = s.value
    return out


@pytest.mark.slow
def test_metrics_follows_the_servers_auth_by_default(server):
    """A keyed server (tenants file, [admin] key, no --metrics-key, no --open-metrics): its
    /metrics, whose series name every tenant, answers the admin key only; no key and a
    tenant's key get 401 (before: 200 to anyone, tenant names included)."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert "tenant=" not in r.text
    r = httpx.get(server.url + "/metrics", headers=_auth("spell"), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid metrics key"
    r = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and "tokenmill_requests_total" in r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # stays open


def _wait_idle(srv) -> None:
    for _ in range(240):  # a liveness wait, not a speed bound
        h = srv.health()
        if h["in_flight"] == 0 and not h["engine"]["stats"].get("num_running"):
            return
        time.sleep(0.25)
    raise AssertionError(f"server never went idle: {h}")


@pytest.mark.slow
def test_non_streamed_request_whose_client_hangs_up_is_aborted_and_frees_its_slot(server, tmp_path):
    """Item 1: the client gives up after 2 s on a 2000-token request. Before, the request ran to
    its end as a 200, holding the tenant's only slot (429 meanwhile)."""
    _wait_idle(server)
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.url + "/v1/completions",
            json=body,
            headers={**_auth("solo"), "x-request-id": "hangup-1"},
            timeout=2.0,
        )
    for _ in range(240):  # the server notices the hang-up and releases the slot
        if server.health()["in_flight"] == 0:
            break
        time.sleep(0.05)
    r = httpx.post(
        server.url + "/v1/completions",
        json={**body, "max_tokens": 2},
        headers=_auth("solo"),
        timeout=120,
    )
    assert r.status_code == 200, r.text  # max_concurrent = 1: the cut request's slot is free
    row, meter, abort = _request(server, tmp_path, "hangup-1")
    assert row["error_type"] == "client_disconnected" and row["finish_reason"] == "abort"
    assert row["http_status"] == 499
    assert 0 < row["output_tokens"] < 1000  # aborted within a step, far below max_tokens
    assert abort is not None and abort["output_tokens"] == row["output_tokens"]
    assert meter["gen_ai.usage.output_tokens"] == row["output_tokens"]
    assert meter["gen_ai.usage.input_tokens"] == row["input_tokens"] > 0


@pytest.mark.slow
def test_stream_closed_after_ten_chunks_is_metered_with_every_token_made(server, tmp_path):
    """Item 2: a stream the client closes after 10 chunks gets one metering record whose output
    tokens are all the engine made (those of the step the abort arrived in too), and the
    tenant's Prometheus counters bill the same. Before: no metering record, 10 counted."""
    _wait_idle(server)
    before = _counters(server, "meter")
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def ten_chunks() -> int:
        n = 0
        async with (
            httpx.AsyncClient(timeout=120) as ac,
            ac.stream(
                "POST",
                server.url + "/v1/completions",
                json=body,
                headers={**_auth("meter"), "x-request-id": "ten-chunks"},
            ) as r,
        ):
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
                if n == 10:
                    return n
        return n

    assert asyncio.run(ten_chunks()) == 10
    row, meter, abort = _request(server, tmp_path, "ten-chunks")
    assert row["error_type"] == "client_disconnected"
    assert abort is not None and row["output_tokens"] == abort["output_tokens"] >= 10
    assert meter["gen_ai.usage.output_tokens"] == row["output_tokens"]
    assert meter["gen_ai.usage.input_tokens"] == row["input_tokens"] > 0
    after = _counters(server, "meter")
    assert (
        after["tokenmill_generation_tokens_total"]
        - before.get("tokenmill_generation_tokens_total", 0)
        == (row["output_tokens"])
    )
    assert (
        after["tokenmill_prompt_tokens_total"] - before.get("tokenmill_prompt_tokens_total", 0)
        == (row["input_tokens"])
    )


@pytest.mark.slow
def test_request_cut_while_queued_bills_nothing_but_has_its_record(server, tmp_path):
    """Item 2: with the one engine slot taken, a request waits in the engine's queue; its client
    leaves. It reached the engine, so it has one metering record, of 0 prompt and 0 output
    tokens (it consumed none). Before: its prompt was billed."""
    _wait_idle(server)
    before = _counters(server, "queued")
    hog = {"model": MODEL, "prompt": STORY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    waiter = {**hog, "max_tokens": 20}

    async def main() -> None:
        async with (
            httpx.AsyncClient(timeout=120) as ac,
            ac.stream("POST", server.url + "/v1/completions", json=hog, headers=_auth("hog")) as h,
        ):
            hog_lines = h.aiter_lines()  # kept open: leaving the iterator would close the stream
            while not (await hog_lines.__anext__()).startswith("data: {"):
                pass  # until the hog runs: the engine's one slot is taken
            async with ac.stream(
                "POST",
                server.url + "/v1/completions",
                json=waiter,
                headers={**_auth("queued"), "x-request-id": "queued-1"},
            ) as w:
                assert w.status_code == 200
                for _ in range(240):  # until the engine has it waiting (liveness)
                    stats = (await ac.get(server.url + "/health")).json()["engine"]["stats"]
                    if stats.get("num_waiting"):
                        break
                    await asyncio.sleep(0.1)
                assert stats.get("num_waiting") == 1
                # the waiter's client left; then the hog's

    asyncio.run(main())
    row, meter, abort = _request(server, tmp_path, "queued-1")
    assert row["error_type"] == "client_disconnected" and row["finish_reason"] == "abort"
    assert row["queued_ns"] is not None and row["scheduled_ns"] is None
    assert abort is not None and abort["output_tokens"] == 0
    assert meter is not None  # one metering record: it reached the engine
    assert meter["gen_ai.usage.input_tokens"] == 0 and meter["gen_ai.usage.output_tokens"] == 0
    after = _counters(server, "queued")
    assert after.get("tokenmill_prompt_tokens_total", 0) == before.get(
        "tokenmill_prompt_tokens_total", 0
    )
    assert after.get("tokenmill_generation_tokens_total", 0) == before.get(
        "tokenmill_generation_tokens_total", 0
    )


@pytest.mark.slow
def test_refused_request_bills_nothing(server, tmp_path):
    """Item 2: a request refused before it reached the engine (a body over the limit: 413) has
    no metering record."""
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "word " * 2000},
        headers={**_auth("meter"), "x-request-id": "too-big-1"},
        timeout=60,
    )
    assert r.status_code == 413
    row, meter, abort = _request(server, tmp_path, "too-big-1")
    assert (row["http_status"], meter, abort) == (413, None, None)


@pytest.mark.slow
def test_every_response_carries_the_request_id(server):
    """Item 9: the 413 for an oversized body (declared or streamed) carries `x-request-id`, the
    client's own when it sent one, like every other response (404, 405, 401, 400)."""
    url = server.url + "/v1/completions"
    r = httpx.post(
        url,
        content=b"x" * 5000,
        headers={**_auth("meter"), "content-type": "application/json", "x-request-id": "big-1"},
        timeout=60,
    )
    assert r.status_code == 413 and r.headers["x-request-id"] == "big-1"

    def chunks():  # no Content-Length: refused while the body streams in
        for _ in range(5):
            yield b"x" * 1000

    r = httpx.post(
        url, content=chunks(), headers={**_auth("meter"), "content-type": "application/json"}
    )
    assert r.status_code == 413 and r.headers["x-request-id"].startswith("req-")
    others = [
        httpx.get(server.url + "/v1/nowhere", timeout=30),
        httpx.get(url, timeout=30),
        httpx.post(url, json={"model": MODEL, "prompt": "hi"}, timeout=30),
        httpx.post(url, json={"model": MODEL}, headers=_auth("meter"), timeout=30),
        httpx.get(server.url + "/health", timeout=30),
    ]
    assert [r.status_code for r in others] == [404, 405, 401, 400, 200]
    assert all(r.headers["x-request-id"].startswith("req-") for r in others)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream_options": {"include_usage": False}}, "stream_options"),
        ({"temperature": "0.5"}, "temperature"),  # the same kind: strict numbers
        ({"top_p": True}, "top_p"),
    ],
)
def test_stream_options_are_strict(server, extra, param):
    """Item 9: strict booleans in `stream_options`, and `stream_options` only with streaming
    (OpenAI's behaviour): a 400 naming the field. Before: accepted silently. The same for
    sampling numbers sent as strings or booleans."""
    for endpoint, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ):
        r = httpx.post(
            server.url + endpoint, json={**body, **extra}, headers=_auth("meter"), timeout=60
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert r.headers["x-request-id"]


def _body(endpoint: str, **extra) -> dict:
    if endpoint == "/v1/completions":
        return {"model": MODEL, "prompt": "Hi", "ignore_eos": True, **extra}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "ignore_eos": True,
        **extra,
    }


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("spelling", ["max_tokens", "max_completion_tokens"])
def test_both_spellings_of_the_output_cap_hold_on_both_endpoints(server, endpoint, spelling):
    """Item 3: ``max_completion_tokens`` on ``/v1/completions`` was ignored (1,657+ tokens, to the
    end of the context); both spellings now mean the same on both endpoints, and the tenant's
    ``max_output_tokens`` caps either (a request over it is a 400 naming the spelling used)."""
    r = httpx.post(
        server.url + endpoint, json=_body(endpoint, **{spelling: 5}), headers=_auth("spell"),
        timeout=300,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(
        server.url + endpoint, json=_body(endpoint, **{spelling: 9}), headers=_auth("capped"),
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == spelling and "limit of 8" in r.json()["error"]["message"]


def test_the_tenant_cap_applies_when_no_cap_is_sent(server):
    r = httpx.post(
        server.url + "/v1/completions", json=_body("/v1/completions"), headers=_auth("capped"),
        timeout=300,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.e2e  # a failure drill or tour: `make test-e2e`
@pytest.mark.slow
@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT", "SIGINT")])
def test_shutdown_with_an_open_stream_is_recorded_as_shutdown(tmp_path, smollm2_dir, signals):
    """Item 8: stopping the server (SIGTERM; or Ctrl-C twice, as `make demo` delivers it) while
    a stream is open: the stream's last event names `server_shutdown`, the process exits 0 with
    no traceback, and the store has a `server_shutdown` event, the request with that error type
    and its tokens metered, and no crash. Before: engine_died/crash events or
    client_disconnected, tracebacks in the log, a non-zero exit."""
    db = tmp_path / "traces.duckdb"
    srv = Server(
        tmp_path,
        "--model",
        str(smollm2_dir),
        "--trace-db",
        str(db),
        "--device-sample-interval",
        "0",
        "--shutdown-timeout",  # SIGTERM drains this long, then cuts what is still open
        "1",
    )
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            json=body,
            headers={"x-request-id": "open-at-shutdown"},
            timeout=120,
        ) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    for name in signals:
                        srv.proc.send_signal(getattr(signal, name))
        code = srv.proc.wait(120)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
        srv.log.close()
    log = (tmp_path / f"server-{srv.port}.log").read_text()
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "server_shutdown" and "shutting down" in err["message"]
    assert code == 0, log
    assert "Traceback" not in log and "ERROR" not in log, log
    con = duckdb.connect(str(db), read_only=True)
    kinds = [k for (k,) in con.execute("SELECT kind FROM events").fetchall()]
    assert kinds.count("server_shutdown") == 1, kinds
    assert "engine_crash" not in kinds and "engine_restart" not in kinds
    (row,) = _rows(con, "SELECT * FROM requests WHERE client_request_id = 'open-at-shutdown'")
    assert row["error_type"] == "server_shutdown" and row["finish_reason"] == "abort"
    (meter,) = _rows(
        con,
        "SELECT attributes FROM spans WHERE trace_id = ? AND name = 'metering'",
        [row["trace_id"]],
    )
    assert json.loads(meter["attributes"])["gen_ai.usage.output_tokens"] == row["output_tokens"]
    assert row["output_tokens"] >= 2
    con.close()


@pytest.mark.slow
def test_sigterm_drains_open_streams_before_stopping(tmp_path, smollm2_dir):
    """A rolling deploy: 8 streams open, SIGTERM. From the signal on /health/ready is 503
    ``draining`` (/health/live 200) and a new request gets 503 ``server_shutdown`` with
    Retry-After; every open stream still completes (``length``, ``[DONE]``, no error) within
    --shutdown-timeout, and the process exits 0 with a ``server_draining`` event and no request
    cut."""
    import threading

    db = tmp_path / "traces.duckdb"
    srv = Server(
        tmp_path, "--model", str(smollm2_dir), "--trace-db", str(db),
        "--device-sample-interval", "0", "--shutdown-timeout", "120",
    )  # fmt: skip
    started = threading.Barrier(9)
    results: list[dict] = []

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"{STORY} ({i})", "max_tokens": 24,
                "ignore_eos": True, "stream": True}  # fmt: skip
        events, waited = [], False
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 2 and not waited:
                    waited = True
                    started.wait(120)
        chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        results.append({"done": events[-1] == "data: [DONE]", "chunks": chunks})

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        started.wait(180)  # every stream has its first tokens
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the loop takes the signal between steps
            ready = httpx.get(srv.url + "/health/ready", timeout=30)
            if ready.status_code == 503:
                break
            time.sleep(0.05)
        assert (ready.status_code, ready.json()["status"]) == (503, "draining")
        assert httpx.get(srv.url + "/health/live", timeout=30).status_code == 200
        late = httpx.post(
            srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )  # fmt: skip
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1, late.text
        assert late.json()["error"]["code"] == "server_shutdown"
        for t in threads:
            t.join(300)
        code = srv.proc.wait(120)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
        srv.log.close()
    log = (tmp_path / f"server-{srv.port}.log").read_text()
    assert code == 0 and "Traceback" not in log, log
    assert len(results) == 8 and all(r["done"] for r in results), results
    for r in results:
        assert not any("error" in c for c in r["chunks"]), r["chunks"][-2:]
        assert r["chunks"][-1]["choices"][0]["finish_reason"] == "length"
    con = duckdb.connect(str(db), read_only=True)
    kinds = [k for (k,) in con.execute("SELECT kind FROM events").fetchall()]
    assert kinds.count("server_draining") == 1, kinds
    cut = con.execute(
        "SELECT count(*) FROM requests WHERE error_type = 'server_shutdown' AND queued_ns IS NOT NULL"
    ).fetchone()[0]
    assert cut == 0
    done = con.execute("SELECT count(*) FROM requests WHERE finish_reason = 'length'").fetchone()
    assert done[0] == 8
    con.close()


def test_restarts_back_off_and_a_crash_loop_gives_up(monkeypatch):
    """The first restart in the window is at once, then 1, 2, 4 ... s up to the cap; the
    limit's crash within the window makes the worker ``failed`` with one event naming the
    count and the last reason; crashes older than the window no longer count."""
    from tokenmill.engine.api import worker as w
    from tokenmill.engine.config import EngineConfig

    clock = [1000.0]
    monkeypatch.setattr(w.time, "monotonic", lambda: clock[0])
    worker = w.EngineWorker(EngineConfig())
    worker.max_crashes, worker.crash_window_s = 4, 60.0
    events = []
    worker.add_event_listener(lambda *e: events.append(e))
    waits = []
    for _ in range(3):
        assert not worker._crash_loop("exit 70")
        waits.append(worker._backoff_s())
        clock[0] += 10
    assert waits == [0.0, 1.0, 2.0]
    clock[0] += 60  # the first three leave the window
    assert not worker._crash_loop("exit 70") and worker._backoff_s() == 0.0
    for _ in range(2):
        clock[0] += 1
        assert not worker._crash_loop("exit 70")
    assert worker._backoff_s() == 2.0
    clock[0] += 1
    assert worker._crash_loop("exit 70: fault drill") and worker.state == "failed"
    (kind, severity, message) = events[-1]
    assert (kind, severity) == ("engine_crash_loop", "error")
    assert "crashed 4 times in 60 s" in message and "fault drill" in message
    big = w.EngineWorker(EngineConfig())
    big.max_crashes = 100
    for _ in range(12):
        big._crash_loop("x")
    assert big._backoff_s() == w.RESTART_BACKOFF_MAX_S


@pytest.mark.e2e  # a failure drill or tour: `make test-e2e`
@pytest.mark.slow
def test_a_crash_looping_engine_ends_the_server_in_one_line(tmp_path, smollm2_dir):
    """An engine core that dies at its first step every time (the crash drill): after three
    crashes the server stops on its own, exits 1, and its last line says why."""
    import contextlib

    port = free_port()
    log = tmp_path / "serve.err"
    with open(log, "w") as errf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.engine.cli", "serve", "--model", str(smollm2_dir),
             "--port", str(port), "--no-trace-db", "--fault-crash-after-steps", "1",
             "--engine-restart-limit", "3", "--engine-restart-window", "600"],
            stdout=subprocess.DEVNULL, stderr=errf, cwd=tmp_path,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    deadline = time.monotonic() + 400
    codes = set()
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            # each request that reaches the engine makes it step, and crash
            with contextlib.suppress(httpx.HTTPError):
                codes.add(httpx.post(url, json=body, timeout=60).status_code)
            time.sleep(0.3)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 1, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error:") and "crashed 3 times" in last, err[-3000:]
    assert codes <= {500, 503} and codes, codes  # no request was ever served
    assert "Traceback" not in err


@pytest.mark.slow
def test_engine_core_exits_when_its_api_process_is_killed(tmp_path, smollm2_dir):
    """SIGKILL of the API process (an OOM kill, `kill -9`) sends no Shutdown: the engine core
    must notice it was re-parented and exit, not hold the model and KV cache with nobody to
    serve (one such orphan, 2 GB resident, outlived a profiling run on 2026-12-01)."""
    srv = Server(tmp_path, "--model", str(smollm2_dir), "--no-trace-db")
    engine_pid = srv.health()["engine"]["pid"]
    try:
        assert _alive(engine_pid)
        srv.proc.kill()
        srv.proc.wait(30)
        for _ in range(300):  # a liveness bound (the loop checks every IDLE_POLL_MS), not timing
            if not _alive(engine_pid):
                break
            time.sleep(0.1)
        assert not _alive(engine_pid), f"engine core {engine_pid} outlived its API process"
    finally:
        srv.log.close()
        if _alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child not yet reaped)."""
    fields = proc_stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _child(code: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])


def test_demo_wait_treats_a_stopped_child_as_a_stop_and_a_failed_one_as_an_error():
    """Item 8 (`tokenmill demo`): a Ctrl-C reaches the server and console too, and they may end
    before the demo sees it; that is a stop (exit 0), not "the server or the console stopped"."""
    clean = _child(0)
    clean.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_for_stop({"console": running, "server": clean}, poll_s=0.01) == "server"
        failed = _child(3)
        failed.wait()
        with pytest.raises(DemoError, match="server stopped with exit code 3"):
            wait_for_stop({"console": running, "server": failed}, poll_s=0.01)
    finally:
        running.kill()
        running.wait()


class _Telemetry:
    def __init__(self):
        self.recorded = []

    def on_request(self, tl):
        self.recorded.append(tl)


def _state():
    from tokenmill.engine.api.app import ServerState
    from tokenmill.engine.api.stations import MeteringStation

    return ServerState(
        worker=None,
        gateway=None,
        tokenize=None,
        admission=None,
        metering=MeteringStation(),
        model_name=MODEL,
        max_body_bytes=1 << 20,
        block_size=16,
        telemetry=_Telemetry(),
    )


def _final(rid: str, *, scheduled: bool, output_tokens: int):
    from tokenmill.engine.messages import RequestOutput, RequestStats

    t = 1_000_000_000
    return RequestOutput(
        request_id=rid,
        new_token_ids=[],
        new_text="",
        token_ns=[],
        finished=True,
        finish_reason="abort",
        stop_reason=None,
        error_type=None,
        error_message=None,
        stats=RequestStats(
            input_tokens=12,
            output_tokens=output_tokens,
            cached_tokens=4 if scheduled else 0,
            preemptions=0,
            recomputed_tokens=0,
            queued_ns=t + 1,
            scheduled_ns=t + 2 if scheduled else None,
            first_token_ns=t + 3 if output_tokens else None,
        ),
        arrival_ns=t,
        finished_ns=t + 4,
    )


@pytest.mark.parametrize("final_first", [False, True])
def test_cut_request_is_recorded_once_with_the_engine_final_record(final_first):
    """Item 2: a request whose stream was left is recorded once, with the engine's final count
    (13 tokens, not the 10 the stream had seen), whether that record arrives before or after
    the response is over; its usage bills the prompt (it was prefilled) and the 13 tokens."""
    from tokenmill.engine.api.timeline import RequestTimeline

    async def main():
        state = _state()
        tl = RequestTimeline(arrival_ns=1, method="POST", path="/v1/completions")
        tl.request_id, tl.tenant, tl.stats.input_tokens, tl.stats.output_tokens = (
            "cmpl-1",
            "t",
            12,
            10,
        )
        state.unsettled.add("cmpl-1")  # _observed: the stream was left before the final output
        final = _final("cmpl-1", scheduled=True, output_tokens=13)
        if final_first:
            state.on_engine_final(final)
            assert state.telemetry.recorded == []
            state.finish(tl)
        else:
            state.finish(tl)
            assert state.telemetry.recorded == [] and state.unrecorded == 1
            state.on_engine_final(final)
        state.on_engine_final(final)  # a duplicate is ignored
        return state

    state = asyncio.run(main())
    (tl,) = state.telemetry.recorded
    assert tl.stats.output_tokens == 13 and tl.finish_reason == "abort"
    assert tl.usage == {
        "prompt_tokens": 12,
        "completion_tokens": 13,
        "total_tokens": 25,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert state.unrecorded == 0 and not state.unsettled


def test_request_cut_in_the_queue_bills_nothing_and_one_never_sent_has_no_usage():
    """Item 2: cut while queued (never scheduled): one usage of zeros; never reached the engine
    (no engine record at all): no usage, so no metering record."""
    from tokenmill.engine.api.timeline import RequestTimeline

    async def main():
        state = _state()
        queued = RequestTimeline(arrival_ns=1, method="POST", path="/v1/completions")
        queued.request_id, queued.tenant, queued.stats.input_tokens = "cmpl-q", "t", 12
        state.unsettled.add("cmpl-q")
        state.finish(queued)
        state.on_engine_final(_final("cmpl-q", scheduled=False, output_tokens=0))
        refused = RequestTimeline(arrival_ns=1, method="POST", path="/v1/completions")
        refused.request_id, refused.tenant, refused.stats.input_tokens = "cmpl-r", "t", 12
        state.finish(refused)
        return state

    queued, refused = asyncio.run(main()).telemetry.recorded
    assert queued.usage["prompt_tokens"] == queued.usage["completion_tokens"] == 0
    assert queued.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert refused.usage is None and refused.metering_start_ns is None
