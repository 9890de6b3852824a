"""`tokenmill proxy` as a live source beside `tokenmill serve`: its dump (`/admin/dump`, the
server's own route) read by `diagnose --url` and the console's live view, its keys (the admin
key on the dump and on the OTLP receiver, a non-loopback bind refused without any key), its
logs as JSON lines, its readiness (`/health/ready` follows the upstream), an upstream that
dies mid-stream, and its store's retention settings reaching the store.

Upstreams are real HTTP servers on 127.0.0.1: aiohttp's (`AiohttpUpstream`, whose routes a
test writes) or the raw one of `test_bad_upstream.py`; the proxy runs as a process where its
command line is under test, in-process over a real DuckDB store otherwise."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
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
from aiohttp import web
from test_bad_upstream import HANG_GUARD_S, RawUpstream, start_proxy
from test_proxy import _free_port, _Serve

from tokenmill.proxy.app import ProxyState, build_proxy_app
from tokenmill.telemetry.remote import FetchError, fetch_dump
from tokenmill.telemetry.store import TraceStore

FIXTURES = Path(__file__).resolve().parents[1] / "telemetry" / "fixtures" / "otlp"
ADMIN, CLIENT = "admin-secret", "client-secret"


class AiohttpUpstream:
    """An aiohttp web server on 127.0.0.1, on its own thread and event loop; ``routes`` is a
    list of ``(method, path, handler)``."""

    def __init__(self, routes):
        self.loop = asyncio.new_event_loop()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        started = threading.Event()

        async def start():
            app = web.Application()
            for method, path, handler in routes:
                app.router.add_route(method, path, handler)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(HANG_GUARD_S)

    def stop(self):
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        fut.result(HANG_GUARD_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _sse(i: int, finish: str | None = None) -> bytes:
    ev = {"id": "chatcmpl-aio", "model": "aio",
          "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


async def _stream(request: web.Request) -> web.StreamResponse:
    """Two events, then (model ``abort``) the connection dropped with no end of stream, or
    (any other model) a whole stream."""
    body = await request.json()
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(2):
        await resp.write(_sse(i))
        await asyncio.sleep(0.02)
    if body["model"] == "abort":
        request.transport.abort()  # the upstream process died: a reset, mid-answer
        return resp
    await resp.write(_sse(2, finish="stop") + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
def store(tmp_path):
    s = TraceStore(tmp_path / "proxy.duckdb", flush_interval_s=0.05)
    yield s
    s.close()


def test_an_upstream_that_dies_mid_stream_ends_the_stream_cleanly_and_the_next_is_served(store):
    """aiohttp's upstream resets the connection after two events: the client gets them, then
    one error event naming the cut and [DONE]; the row says `upstream_stream_cut` (counted
    loss, with the two tokens it saw); the next request through the same proxy is whole."""
    up = AiohttpUpstream([("POST", "/v1/chat/completions", _stream)])
    px = _Serve(build_proxy_app(ProxyState(up.url, store.submit, first_byte_timeout_s=5.0)))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        cut = httpx.post(px.url + "/v1/chat/completions", json={**body, "model": "abort"},
                         timeout=HANG_GUARD_S)  # fmt: skip
        whole = httpx.post(px.url + "/v1/chat/completions", json={**body, "model": "ok"},
                           timeout=HANG_GUARD_S)  # fmt: skip
    finally:
        px.stop()
        up.stop()
    events = [e for e in cut.content.split(b"\n\n") if e.strip()]
    assert cut.status_code == 200 and events[:2] == [_sse(0).strip(), _sse(1).strip()]
    err = json.loads(events[2].removeprefix(b"data: "))["error"]
    assert err["code"] == "upstream_stream_cut" and up.url in err["message"]
    assert events[3:] == [b"data: [DONE]"]
    assert whole.status_code == 200 and whole.content.endswith(b"data: [DONE]\n\n")
    assert b"error" not in whole.content
    assert store.flush()
    rows = store.query(
        "SELECT error_type, output_tokens, finish_reason FROM requests ORDER BY arrival_ns"
    )
    assert rows == [("upstream_stream_cut", 2, "error"), (None, 3, "stop")]


def test_ready_follows_the_upstream_probed_at_most_every_few_seconds(store, monkeypatch):
    """/health/ready: 200 while the upstream's /health answers (one probe serves the checks
    within READY_CACHE_S), 503 naming why when it answers 5xx or cannot be reached, 503
    `draining` once the proxy drains; /health/live stays 200 throughout."""
    import tokenmill.proxy.app as proxy_app

    monkeypatch.setattr(proxy_app, "READY_CACHE_S", 0.5)
    hits, answer = [], {"status": 200}

    async def health(_request):
        hits.append(time.monotonic())
        return web.json_response({"ok": True}, status=answer["status"])

    up = AiohttpUpstream([("GET", "/health", health)])
    state = ProxyState(up.url, store.submit)
    px = _Serve(build_proxy_app(state))
    try:
        first = [httpx.get(px.url + "/health/ready", timeout=HANG_GUARD_S) for _ in range(3)]
        probes_for_three = len(hits)
        time.sleep(0.6)
        answer["status"] = 503  # the engine is (re)loading its model
        loading = httpx.get(px.url + "/health/ready", timeout=HANG_GUARD_S)
        up.stop()
        time.sleep(0.6)
        down = httpx.get(px.url + "/health/ready", timeout=HANG_GUARD_S)
        live = httpx.get(px.url + "/health/live", timeout=HANG_GUARD_S)
        state.draining = True
        draining = httpx.get(px.url + "/health/ready", timeout=HANG_GUARD_S)
    finally:
        px.stop()
    assert [r.status_code for r in first] == [200] * 3 and probes_for_three == 1
    assert first[0].json() == {"status": "ready", "upstream": up.url}
    assert loading.status_code == 503 and loading.headers["retry-after"] == "5"
    assert loading.json()["reason"] == f"upstream {up.url} answered /health with HTTP 503"
    assert down.status_code == 503 and down.json()["status"] == "upstream_unavailable"
    assert down.json()["reason"].startswith(f"upstream {up.url} could not be reached: ")
    assert live.status_code == 200
    assert draining.status_code == 503 and draining.json()["status"] == "draining"


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    return stderr


def test_a_keyed_proxy_hands_its_dump_to_diagnose_and_the_console(tmp_path, capsys):
    """`--api-key` and `--admin-key`: /admin/dump and the OTLP receiver take the admin key
    (401 without a key, 403 for the client's on the dump); `diagnose --url` reads the proxy's
    dump as a server's (every request failing on a dead upstream: `error_spike` naming it);
    the console's live source mirrors it and merges in what is new; an OTLP export past
    `--otlp-max-body-bytes` is a 413."""
    from tokenmill.dashboard.source import StoreHandle
    from tokenmill.diagnose.cli import run as diagnose_run

    dead = f"http://127.0.0.1:{_free_port()}"
    proc, url = start_proxy(dead, tmp_path / "p.duckdb", "--api-key", CLIENT,
                            "--admin-key", ADMIN, "--otlp-receiver",
                            "--otlp-max-body-bytes", "6000")  # fmt: skip
    console = StoreHandle(url + "/v1", api_key=ADMIN, refresh_s=1)
    try:
        auth = {"authorization": f"Bearer {CLIENT}"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(12):
            r = httpx.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=10)
            assert r.status_code == 502
            time.sleep(0.05)
        no_key = httpx.get(url + "/admin/dump", timeout=10)
        client_key = httpx.get(url + "/admin/dump", headers=auth, timeout=10)
        with pytest.raises(FetchError, match="answered 403: admin only"):
            fetch_dump(url, tmp_path / "x.duckdb", api_key=CLIENT)
        assert diagnose_run(None, url=url + "/v1/", api_key=ADMIN, fmt="json") == 0
        report = json.loads(capsys.readouterr().out)
        first = console.snapshot(force=True).con.execute("SELECT count(*) FROM requests")
        first_count = first.fetchone()[0]
        r = httpx.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=10)
        assert r.status_code == 502
        again = console.snapshot(force=True).con.execute("SELECT count(*) FROM requests")
        again_count = again.fetchone()[0]
        otlp = {"content-type": "application/json"}
        span = (FIXTURES / "vllm_request_span.json").read_bytes()
        traces = [
            httpx.post(url + "/v1/traces", content=span, headers={**otlp, **h}, timeout=10)
            for h in ({}, {"authorization": f"Bearer {ADMIN}"})
        ]
        big = httpx.post(url + "/v1/traces", content=b" " * 2000 + span,
                         headers={**otlp, "authorization": f"Bearer {ADMIN}"}, timeout=10)  # fmt: skip
    finally:
        console.close()
        stderr = _stop(proc)
    assert proc.returncode == 0, stderr
    assert no_key.status_code == 401 and client_key.status_code == 403
    top = report["findings"][0]
    assert top["rule"] == "error_spike" and top["evidence"]["upstreams"] == [dead]
    assert top["evidence"]["errors_by_type"] == {"upstream_unreachable": 12}
    assert (first_count, again_count) == (12, 13)
    assert len(console.fetched_rows) == 2  # the whole store, then what was new (merged)
    assert console.telemetry["store"]["writer_alive"] is True
    assert [t.status_code for t in traces] == [401, 200]
    assert big.status_code == 413 and "at most 6000" in big.json()["error"]["message"]


@pytest.mark.parametrize("command", ["proxy", "collect"])
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--host", "0.0.0.0"], "refusing to serve 0.0.0.0 without a key: give --api-key"),
        (["--host", "::"], "refusing to serve :: without a key"),
        (["--host", "192.0.2.7"], "refusing to serve 192.0.2.7 without a key"),
        (["--log-level", "loud"], "--log-level is one of debug, info, warning, error"),
        (["--log-format", "xml"], "--log-format one of text, json (got 'info', 'xml')"),
    ],
)
def test_an_open_non_loopback_bind_and_bad_log_flags_are_one_line_and_exit_2(
    tmp_path, command, args, needle
):
    """As `tokenmill serve` refuses it: no key on a non-loopback address, or a log level or
    format it does not know: one `error:` line, exit 2, nothing started, no store written."""
    extra = ["--upstream", "http://127.0.0.1:9"] if command == "proxy" else []
    db = tmp_path / "s.duckdb"
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", command, *extra, "--trace-db", str(db),
         "--port", str(_free_port()), *args],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert not db.exists()


def _env() -> dict:
    """This environment without keys from the caller's shell, wide enough for one line."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    return {**keep, "COLUMNS": "300"}


def _send_garbage(url: str) -> None:
    """Bytes that are no HTTP request: uvicorn logs a warning and closes the connection."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as s:
        s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        s.settimeout(HANG_GUARD_S)
        while s.recv(4096):
            pass


def test_log_format_json_puts_the_proxys_lines_on_stderr_as_json_objects(tmp_path):
    """`--log-format json`: uvicorn's warning for a request that is not HTTP comes out as one
    JSON object with the level, the logger and the message (as `tokenmill serve` writes it)."""
    up = RawUpstream()
    proc, url = start_proxy(up.url, tmp_path / "p.duckdb", "--log-format", "json")
    try:
        _send_garbage(url)
    finally:
        stderr = _stop(proc)
        up.stop()
    objects = [json.loads(ln) for ln in stderr.splitlines() if ln.startswith("{")]
    warning = next(o for o in objects if o["logger"].startswith("uvicorn"))
    assert warning["level"] == "warning" and "Invalid HTTP request" in warning["message"]
    assert set(warning) >= {"time", "level", "logger", "message", "pid"}
    assert warning["pid"] == proc.pid


def _parsed(command: str, args: list[str]):
    """The command's settings as its command line parses ``args`` (nothing run)."""
    import typer

    if command == "proxy":
        from tokenmill.proxy.cli import ProxyConfig as cls
        from tokenmill.proxy.cli import app
    else:
        from tokenmill.telemetry.collect_cli import CollectConfig as cls
        from tokenmill.telemetry.collect_cli import app
    from tokenmill.engine.settings import from_options

    ctx = typer.main.get_command(app).make_context(command, args)
    return from_options(cls, dict(ctx.params))


@pytest.mark.parametrize("command", ["proxy", "collect"])
def test_the_retention_flags_reach_the_store_and_roll_old_rows_out(tmp_path, command):
    """`--trace-retention`, `--trace-max-bytes`, `--trace-archive` (and the archive's own
    bounds where the store takes them) parsed as serve's, into `open_store`'s TraceStore:
    a row older than the retention rolls out to the archive, a recent one stays."""
    import inspect

    from tokenmill.telemetry.cli import open_store, store_kwargs

    archive = tmp_path / "arch"
    args = ["--trace-retention", "1h", "--trace-max-bytes", "64000000",
            "--trace-archive", str(archive)]  # fmt: skip
    takes_bounds = "archive_max_age_s" in inspect.signature(TraceStore).parameters
    if takes_bounds:
        args += ["--trace-archive-max-age", "7d", "--trace-archive-max-bytes", "5000000"]
    cfg = _parsed(command, (["--upstream", "http://127.0.0.1:9"] if command == "proxy" else [])
                  + args)  # fmt: skip
    store = open_store(tmp_path / "s.duckdb", **store_kwargs(cfg))
    try:
        assert (store.retention_s, store.max_bytes, store.archive) == (3600.0, 64_000_000, archive)
        if takes_bounds:
            assert (store.archive_max_age_s, store.archive_max_bytes) == (7 * 86400.0, 5_000_000)
        now = time.time_ns()
        for rid, age_s in (("old", 2 * 3600), ("new", 60)):
            arrival = now - age_s * 1_000_000_000
            store.submit("requests", {"request_id": rid, "trace_id": rid * 4,
                                      "arrival_ns": arrival, "end_ns": arrival + 1})  # fmt: skip
        assert store.flush()
        assert store._maybe_roll(force=True) is not None
        live = store.query("SELECT request_id FROM requests")
    finally:
        store.close()
    assert live == [("new",)]
    rolled = list(archive.glob("*/requests.parquet"))
    assert len(rolled) == 1
    assert duckdb.sql(f"SELECT request_id FROM '{rolled[0]}'").fetchall() == [("old",)]


def test_a_stopped_upstream_opens_an_engine_stalled_finding_that_names_it(tmp_path):
    """An upstream that takes requests and answers nothing (a stopped process keeps its
    listening socket): the proxy's waiting samples show the requests waiting, the live loop
    opens `engine_stalled` naming the upstream, on GET /v1/findings (admin key) and as
    `tokenmill_finding_active` on /metrics; the requests' rows come when they end."""
    release = threading.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        while not release.is_set():
            await asyncio.sleep(0.1)
        return web.json_response({"error": "released"}, status=503)

    upstream = AiohttpUpstream([("POST", "/v1/chat/completions", hang)])
    proc, url = start_proxy(upstream.url, tmp_path / "p.duckdb", "--api-key", CLIENT,
                            "--admin-key", ADMIN, "--diagnose-every", "1s",
                            "--first-byte-timeout", "120s")  # fmt: skip
    admin = {"authorization": f"Bearer {ADMIN}"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    pool = concurrent.futures.ThreadPoolExecutor(3)
    # the finding needs stall_s (10 s) of silence and a loop period on a shared host: its
    # guard is a hang guard, and the clients wait past it so that none gives up first
    finding_guard_s = 6 * HANG_GUARD_S
    try:
        sent = [
            pool.submit(httpx.post, url + "/v1/chat/completions", json=chat,
                        headers={"authorization": f"Bearer {CLIENT}"},
                        timeout=finding_guard_s + HANG_GUARD_S)
            for _ in range(3)
        ]  # fmt: skip
        refused = httpx.get(url + "/v1/findings", timeout=10)
        deadline, found = time.monotonic() + finding_guard_s, []
        while time.monotonic() < deadline and not found:
            time.sleep(1)
            snap = httpx.get(url + "/v1/findings", headers=admin, timeout=10).json()
            found = [f for f in snap["open"] if f["rule"] == "engine_stalled"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        release.set()
        answers = [f.exception(finding_guard_s + 2 * HANG_GUARD_S) or f.result() for f in sent]
        pool.shutdown()
        stderr = _stop(proc)
        upstream.stop()
    assert refused.status_code == 401
    assert found, f"no engine_stalled finding; last snapshot {snap}"
    assert [getattr(a, "status_code", a) for a in answers] == [503] * 3  # released, none lost
    f = found[0]
    assert f["evidence"]["upstream"] == upstream.url and upstream.url in f["summary"]
    assert f["evidence"]["waiting_requests"] == 3 and f["evidence"]["silent_ms"] >= 10_000
    assert 'tokenmill_finding_active{rule="engine_stalled",severity="critical"} 1.0' in metrics
    assert "finding opened: engine_stalled" in stderr
